"""The autocast core with an optional loss scaler: what every plugin that trains shares.

With a ``ScalerConfig`` (fp16) the plugin scales the loss with a bounded, counting ``GradScaler`` (see ``_scaler``).
Without one (bf16, fp8 in bf16) it scales nothing, and with ``skip_nonfinite`` the same scaler machinery runs at a
fixed scale of 1 as a guard: a step with inf/nan gradients is skipped, counted and stopped after
``max_consecutive_skips`` in a row, schedulers are held, the counters are checkpointed. With neither it is plain
autocast, as Lightning's plugins are.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_precision._core.autocast import AutocastPrecision, MatmulPrecision
from lightning_precision._core.scaler import NonFiniteGuard, ScalerConfig, TrackingGradScaler
from lightning_precision._core.true_keys import check_readable_states
from lightning_precision._upstream.lightning import optimizer_handles_unscaling

__all__ = ["SKIP_NONFINITE_DEFAULT", "ScaledPrecision", "check_optimizer", "closure_driven"]

# Whether plugins without loss scaling skip steps with inf/nan gradients unless told: off, because the check costs more
# than the 2% of a step allowed a default (3-7% on benchmarks/plugin_overhead.py's MLP, docs/benchmarks.md).
SKIP_NONFINITE_DEFAULT = False


def closure_driven(optimizer: Any) -> bool:
    """Whether ``optimizer`` evaluates its closure inside ``step`` (its gradients do not exist before it): LBFGS, or any
    optimizer whose ``step`` requires a closure."""
    cls: Any = type(optimizer)
    return _requires_closure(cls)


@functools.cache
def _requires_closure(cls: Any) -> bool:
    if issubclass(cls, LBFGS):
        return True
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def check_optimizer(owner: str, optimizer: Any) -> None:
    if closure_driven(optimizer):
        raise ValueError(
            f"`{owner}` cannot drive `{type(optimizer).__name__}`: a loss scaler cannot skip a step that re-evaluates"
            " its closure. Use another optimizer, or `BF16MixedPrecision`, which needs no scaler."
        )


class ScaledPrecision(AutocastPrecision):
    """Autocast in ``compute_dtype`` with a loss scaler built from ``scaler``; without one (``None``), the non-finite
    guard when ``skip_nonfinite``, else nothing.

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
    ) -> None:
        super().__init__(compute_dtype, device=device, matmul_precision=matmul_precision, reduce_dtype=reduce_dtype)
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
        # What scales and skips: the loss scaler, or the guard (a scaler at a fixed scale of 1). Built for cpu until the
        # model's device is known, then rebuilt there with its state.
        self._scaler: TrackingGradScaler | None = None
        if scaler is not None:
            self._scaler = self.scaler_class(device or "cpu", scaler, owner=owner)
        elif skip_nonfinite:
            self._scaler = NonFiniteGuard(device or "cpu", max_consecutive_skips, owner=owner)
        self.step_was_skipped = False
        self._update_pending = False

    @property
    def scaler(self) -> TrackingGradScaler | None:
        """The loss scaler (a ``torch.amp.GradScaler``); ``None`` without loss scaling, as for Lightning's bf16 plugin
        (``trainer.scaler`` reads it), also where the non-finite guard skips steps."""
        return self._scaler if self.scaler_config is not None else None

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        if self._scaler is not None and self._scaler.device_type != device_type:
            state = self._scaler.state_dict()
            owner = type(self).__name__
            self._scaler = (self.scaler_class(device_type, self._scaler.config, owner=owner) if self.scaler_config
                           else NonFiniteGuard(device_type, self._scaler.config.max_consecutive_skips, owner=owner))
            self._scaler.load_state_dict(state)

    @property
    @override
    def loss_scale(self) -> float | None:
        """The current loss scale: applies the scale update pending since the last optimizer step (a write), then
        reads the device; ``None`` without loss scaling (the guard's scale is no loss scale)."""
        if self._scaler is None or self.scaler_config is None:
            return None
        self.apply_pending_update()
        return float(self._scaler.scale_tensor())

    @property
    @override
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients had inf/nan: applies the pending scale update (a write), then
        reads the device; 0 when nothing is skipped."""
        if self._scaler is None:
            return 0
        self.apply_pending_update()
        return int(self._scaler.skipped_tensor())

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
        if self._scaler is None:
            return {}
        self.apply_pending_update()
        metrics = {"precision/skipped_steps": self._scaler.skipped_tensor().float()}
        if self.scaler_config is not None:
            metrics = {"precision/loss_scale": self._scaler.scale_tensor().float(), **metrics}
        return metrics

    def update_after_every_step(self) -> None:
        """Update the scale now that every optimizer of the last backward has stepped (the Trainer knows when)."""
        if self._update_pending and self._scaler is not None:
            self._update_pending = False
            self._scaler.update()

    def apply_pending_update(self) -> None:
        """Update the scale for the optimizer steps taken since the last backward, if not done yet (it happens by
        itself at the next backward). May raise ``SkippedStepsError`` (see ``max_consecutive_skips``)."""
        if self._update_pending and self._scaler is not None:
            self._update_pending = False
            # Called by a read, maybe between two optimizers' steps on one backward: those still to step keep the
            # scale their gradients carry.
            self._scaler.update_before_every_step()

    def _scale_loss(self, tensor: Tensor) -> Tensor:
        return tensor if self._scaler is None else self._scaler.scale(tensor)

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        self.update_after_every_step()  # at a backward, every optimizer of the last one has stepped
        super().backward(self._scale_loss(tensor), model, *args, **kwargs)

    def check_readable_states(self, optimizer: Any) -> None:
        """Refuse, naming the cause and the fix, an optimizer whose states a true-precision plugin encoded (its
        checkpoint resumed by this plugin): the optimizer would fail on a bare ``KeyError``."""
        if not self.reads_encoded_states:
            check_readable_states(type(self).__name__, getattr(optimizer, "optimizer", optimizer))

    def _scaler_step(self, optimizer: Optimizable, closure_step: Callable[[], Any] | None = None,
                     **kwargs: Any) -> Any:
        """Step ``optimizer`` through the scaler or the guard. ``closure_step``: how a closure-driven optimizer steps
        (evaluating the closure itself), for the guard to undo if it leaves non-finite weights."""
        self.check_readable_states(optimizer)
        if self._scaler is None:
            self.step_was_skipped = False
            return optimizer.step(**kwargs) if closure_step is None else closure_step()
        if (self._update_pending and isinstance(self._scaler, NonFiniteGuard)
                and self._scaler.has_stepped(optimizer)):  # type: ignore[arg-type]
            # The guard, and a new iteration whose backward did not come through the plugin (`loss.backward()` by
            # hand): at a scale of 1 nothing was missed but the update, applied now.
            self.update_after_every_step()
        if self.scaler_config is not None:
            check_optimizer(type(self).__name__, optimizer)
            output = self._scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        elif closure_step is not None or "closure" in kwargs:
            assert isinstance(self._scaler, NonFiniteGuard)
            output = self._scaler.step_undoing_nonfinite(optimizer,  # type: ignore[arg-type]
                                                        closure_step or functools.partial(optimizer.step, **kwargs))
        else:
            output = self._scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        if self.skip_schedulers_on_overflow:
            self.step_was_skipped = self._scaler.step_was_skipped(optimizer)  # type: ignore[arg-type]
        self._update_pending = True
        return output

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        output = self._scaler_step(optimizer, **kwargs)
        self._after_optimizer_step()
        return output

    def _after_optimizer_step(self) -> None:
        """Hook for subclasses: runs after each optimizer step (skipped or not); the Trainer's step calls it too."""

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self._scaler is None:
            return
        if optimizer_handles_unscaling(optimizer) and self.scaler_config is not None:
            raise NotImplementedError(
                f"`{type(optimizer).__name__}` unscales inside `step()` (a fused optimizer), so its gradients cannot"
                " be unscaled for clipping. Use the non-fused optimizer to clip."
            )
        # The guard (scale 1) checks now, fused optimizers included: clipping by value after this could clamp an inf
        # into a finite gradient that the fused step's own check would let through.
        self._scaler.unscale_(optimizer)

    # Keys of the state that a subclass keeps beside the scaler's (FP8Precision's plan): never given to the scaler.
    _own_state_keys: tuple[str, ...] = ()

    def scaler_state_dict(self) -> dict[str, Any]:
        """The loss scaler's state alone (what Lightning's ``MixedPrecision`` can resume), or the guard's counters;
        ``{}`` for plain autocast."""
        if self._scaler is None:
            return {}
        self.apply_pending_update()
        return self._scaler.state_dict()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler_state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._scaler is not None:
            self._scaler.load_state_dict({k: v for k, v in state_dict.items() if k not in self._own_state_keys})

    def __getstate__(self) -> dict[str, Any]:
        # torch refuses to pickle (or deepcopy) a GradScaler between a step and its update, which is where this plugin
        # rests at the end of every iteration: apply the update first, as any other read of the state does.
        self.apply_pending_update()
        return super().__getstate__()

