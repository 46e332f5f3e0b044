"""The autocast core with an optional loss scaler: what every plugin that trains shares.

With a ``ScalerConfig`` (fp16) the plugin scales the loss with a bounded, counting ``GradScaler`` (see ``_scaler``).
Without one (bf16, fp8 in bf16) it scales nothing, and with ``skip_nonfinite`` the same scaler machinery runs at a
fixed scale of 1 as a guard: a step with inf/nan gradients is skipped, counted and stopped after
``max_consecutive_skips`` in a row, schedulers are held, the counters are checkpointed. With neither it is plain
autocast, as Lightning's plugins are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision._core.autocast import AutocastPrecision, MatmulPrecision
from lightning_precision._core.scaling.scaler import ScalerConfig, TrackingGradScaler
from lightning_precision._core.scaling.step_policy import StepPolicy, make_step_policy
from lightning_precision._core.true.keys import check_readable_states

__all__ = ["SKIP_NONFINITE_DEFAULT", "ScaledPrecision"]

# Whether plugins without loss scaling skip steps with inf/nan gradients unless told: off, because the check costs more
# than the 2% of a step allowed a default (3-7% on benchmarks/plugin_overhead.py's MLP, docs/benchmarks.md).
SKIP_NONFINITE_DEFAULT = False


class ScaledPrecision(AutocastPrecision):
    """Autocast in ``compute_dtype`` and a step policy chosen once from the arguments
    (``_core/scaling/step_policy.py``): the loss scaler built from ``scaler``; without one (``None``), the non-finite
    guard when ``skip_nonfinite``, else Lightning's plain step.

    The scale is updated once per backward, after every optimizer that uses its gradients has stepped: at the next
    backward, or when ``loss_scale``, ``skipped_steps``, ``metrics()`` or ``state_dict()`` is read (torch's documented
    pattern for several optimizers; updating after each optimizer would unscale the second with the new scale).
    """

    # Whether the plugin reads the states a true-precision plugin encodes, and clips inside its own step whatever the
    # optimizer (a fused one never sees the gradients): the true-precision plugins.
    reads_encoded_states = False
    clips_in_step = False
    # The loss scaler's class (the true-precision plugins check in `unscale_` and unscale inside their step).
    scaler_class: type[TrackingGradScaler] = TrackingGradScaler

    def __init__(
        self,
        compute_dtype: torch.dtype,
        scaler: ScalerConfig | None,
        skip_schedulers_on_overflow: bool,
        device: str | None,
        matmul_precision: MatmulPrecision | None,
        reduce_dtype: torch.dtype,
        skip_nonfinite: bool = False,
        max_consecutive_skips: int | None = ScalerConfig.max_consecutive_skips,
        eval_precision: str | None = None,
    ) -> None:
        super().__init__(compute_dtype, device=device, matmul_precision=matmul_precision, reduce_dtype=reduce_dtype,
                         eval_precision=eval_precision)
        owner = type(self).__name__
        for name, value in (("skip_schedulers_on_overflow", skip_schedulers_on_overflow),
                            ("skip_nonfinite", skip_nonfinite)):
            if not isinstance(value, bool):
                raise ValueError(f"`{owner}({name}={value!r})`: pass True or False.")
        self.scaler_config = scaler
        self.skip_schedulers_on_overflow = skip_schedulers_on_overflow
        # A loss scaler always skips non-finite steps (it must, to back off); without one, the guard does if asked.
        self.skip_nonfinite = scaler is not None or skip_nonfinite
        if scaler is None:
            ScalerConfig(init_scale=1.0, max_consecutive_skips=max_consecutive_skips).validate(owner)
            if not skip_nonfinite and max_consecutive_skips != ScalerConfig.max_consecutive_skips:
                raise ValueError(f"`{owner}(max_consecutive_skips={max_consecutive_skips!r})`: without loss scaling"
                                 " this"
                                 " plugin skips nothing unless asked, so the limit would have no effect. Pass"
                                 " `skip_nonfinite=True` too, or leave `max_consecutive_skips` out.")
        self.step_policy: StepPolicy = make_step_policy(owner, scaler, skip_nonfinite, max_consecutive_skips,
                                                       reads_skips=skip_schedulers_on_overflow,
                                                       scaler_class=self.scaler_class)

    @property
    def scaler(self) -> TrackingGradScaler | None:
        """The loss scaler (a ``torch.amp.GradScaler``); ``None`` without loss scaling, as for Lightning's bf16 plugin
        (``trainer.scaler`` reads it), also where the non-finite guard skips steps."""
        return self.step_policy.loss_scaler

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (its gradients held inf or nan)."""
        return self.step_policy.step_was_skipped

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        self.step_policy.on_device(device_type)

    @property
    @override
    def loss_scale(self) -> float | None:
        """The current loss scale: applies the scale update pending since the last optimizer step (a write), then
        reads the device; ``None`` without loss scaling (the guard's scale is no loss scale)."""
        return self.step_policy.loss_scale()

    @property
    @override
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients had inf/nan: applies the pending scale update (a write), then
        reads the device; 0 when nothing is skipped."""
        return self.step_policy.skipped_steps()

    @override
    def metrics(self) -> dict[str, Tensor]:
        """``precision/loss_scale`` (with loss scaling) and ``precision/skipped_steps`` (whenever steps are skipped) as
        tensors on the device; nothing for plain autocast.

        Nothing is synchronised until a logger reads them, so calling this only on logging steps costs nothing
        elsewhere: ``if step % 50 == 0: fabric.log_dict(plugin.metrics(), step)``. Call it after the iteration's last
        optimizer step: it applies the scale update that step left pending.
        """
        return self.scaler_metrics()

    def scaler_metrics(self) -> dict[str, Tensor]:
        """The loss scaler's (or the guard's) part of ``metrics()``, without what a subclass adds: what the Trainer
        logs."""
        return self.step_policy.metrics()

    def update_after_every_step(self) -> None:
        """Update the scale now that every optimizer of the last backward has stepped (the Trainer knows when)."""
        self.step_policy.update_after_every_step()

    def apply_pending_update(self) -> None:
        """Update the scale for the optimizer steps taken since the last backward, if not done yet (it happens by
        itself at the next backward). May raise ``SkippedStepsError`` (see ``max_consecutive_skips``)."""
        self.step_policy.apply_pending_update()

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        self.update_after_every_step()  # at a backward, every optimizer of the last one has stepped
        super().backward(self.step_policy.scale_loss(tensor), model, *args, **kwargs)

    def check_readable_states(self, optimizer: Any) -> None:
        """Refuse, naming the cause and the fix, an optimizer whose states a true-precision plugin encoded (its
        checkpoint resumed by this plugin): the optimizer would fail on a bare ``KeyError``."""
        if not self.reads_encoded_states:
            check_readable_states(type(self).__name__, getattr(optimizer, "optimizer", optimizer))

    def _scaler_step(self, optimizer: Optimizable, closure_step: Callable[[], Any] | None = None,
                     **kwargs: Any) -> Any:
        """Step ``optimizer`` through the step policy. ``closure_step``: how a closure-driven optimizer steps
        (evaluating the closure itself), for the guard to undo if it leaves non-finite weights."""
        self.check_readable_states(optimizer)
        return self.step_policy.step(optimizer, closure_step, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        output = self._scaler_step(optimizer, **kwargs)
        self._after_optimizer_step()
        return output

    def _after_optimizer_step(self) -> None:
        """Hook for subclasses: runs after each optimizer step (skipped or not); the Trainer's step calls it too."""

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.step_policy.unscale_for_clipping(optimizer)

    # Keys of the state that a subclass keeps beside the scaler's (FP8Precision's plan): never given to the scaler.
    _own_state_keys: tuple[str, ...] = ()

    def scaler_state_dict(self) -> dict[str, Any]:
        """The loss scaler's state alone (what Lightning's ``MixedPrecision`` can resume), or the guard's counters;
        ``{}`` for plain autocast."""
        return self.step_policy.state_dict()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler_state_dict()

    @override
    def _repr_kept(self) -> dict[str, Any]:
        # A loss scaler always skips non-finite steps: `skip_nonfinite` is the guard's argument, without one.
        return {"scaler": self.scaler_config, "skip_nonfinite": self.scaler_config is None and self.skip_nonfinite}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step_policy.load_state_dict({k: v for k, v in state_dict.items() if k not in self._own_state_keys})

    def __getstate__(self) -> dict[str, Any]:
        # torch refuses to pickle (or deepcopy) a GradScaler between a step and its update, which is where this plugin
        # rests at the end of every iteration: apply the update first, as any other read of the state does.
        self.apply_pending_update()
        return super().__getstate__()
