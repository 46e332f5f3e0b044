"""The autocast core with an optional loss scaler: what ``FP16MixedPrecision`` and ``XPUPrecision`` share.

With a ``ScalerConfig`` the plugin scales the loss with a bounded, counting ``GradScaler`` (see ``_scaler``); with
``None`` (bf16 on XPU) it is a plain autocast plugin that answers the same logging questions with "no loss scale".
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_precision._lightning import optimizer_handles_unscaling
from lightning_precision.fabric._autocast import MatmulPrecision, _AutocastPrecision
from lightning_precision.fabric._scaler import ScalerConfig, _TrackingGradScaler

__all__ = ["_ScaledPrecision", "check_optimizer", "with_scaler_state"]


def check_optimizer(owner: str, optimizer: Any) -> None:
    if isinstance(optimizer, LBFGS):
        raise ValueError(
            f"`{owner}` cannot drive `{type(optimizer).__name__}`: a loss scaler cannot skip a step that re-evaluates"
            " its closure. Use another optimizer, or `BF16MixedPrecision`, which needs no scaler."
        )


class _ScaledPrecision(_AutocastPrecision):
    """Autocast in ``compute_dtype`` with a loss scaler built from ``scaler`` (``None``: no scaler).

    The scale is updated once per backward, after every optimizer that uses its gradients has stepped: at the next
    backward, or when ``loss_scale``, ``skipped_steps``, ``metrics()`` or ``state_dict()`` is read (torch's documented
    pattern for several optimizers; updating after each optimizer would unscale the second with the new scale).
    """

    def __init__(
        self,
        compute_dtype: torch.dtype,
        scaler: Optional[ScalerConfig],
        skip_schedulers_on_overflow: bool,
        device: Optional[str],
        matmul_precision: Optional[MatmulPrecision],
        reduce_dtype: torch.dtype,
    ) -> None:
        super().__init__(compute_dtype, device=device, matmul_precision=matmul_precision, reduce_dtype=reduce_dtype)
        owner = type(self).__name__
        if not isinstance(skip_schedulers_on_overflow, bool):
            raise ValueError(f"`{owner}(skip_schedulers_on_overflow={skip_schedulers_on_overflow!r})`: pass True or"
                             " False.")
        self.scaler_config = scaler
        self.skip_schedulers_on_overflow = skip_schedulers_on_overflow
        # Built for cpu until the model's device is known, then rebuilt there with its state.
        self.scaler: Optional[_TrackingGradScaler] = (
            _TrackingGradScaler(device or "cpu", scaler, owner=owner) if scaler is not None else None
        )
        self.step_was_skipped = False
        self._update_pending = False

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        if self.scaler is not None and self.scaler.device_type != device_type:
            state = self.scaler.state_dict()
            self.scaler = _TrackingGradScaler(device_type, self.scaler.config, owner=type(self).__name__)
            self.scaler.load_state_dict(state)

    @property
    @override
    def loss_scale(self) -> Optional[float]:
        """The current loss scale (reads the device); ``None`` without a scaler."""
        if self.scaler is None:
            return None
        self.apply_pending_update()
        return float(self.scaler.scale_tensor())

    @property
    @override
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients had inf/nan (reads the device); 0 without a scaler."""
        if self.scaler is None:
            return 0
        self.apply_pending_update()
        return int(self.scaler.skipped_tensor())

    @override
    def metrics(self) -> dict[str, Tensor]:
        """``precision/loss_scale`` and ``precision/skipped_steps`` as tensors on the device (nothing without a scaler).

        Nothing is synchronised until a logger reads them, so calling this only on logging steps costs nothing
        elsewhere: ``if step % 50 == 0: fabric.log_dict(plugin.metrics(), step)``. Call it after the iteration's last
        optimizer step: it applies the scale update that step left pending.
        """
        if self.scaler is None:
            return {}
        self.apply_pending_update()
        return {
            "precision/loss_scale": self.scaler.scale_tensor().float(),
            "precision/skipped_steps": self.scaler.skipped_tensor().float(),
        }

    def apply_pending_update(self) -> None:
        """Update the scale for the optimizer steps taken since the last backward, if not done yet (it happens by
        itself at the next backward). May raise ``SkippedStepsError`` (see ``max_consecutive_skips``)."""
        if self._update_pending and self.scaler is not None:
            self._update_pending = False
            # Called by a read, maybe between two optimizers' steps on one backward: those still to step keep the
            # scale their gradients carry.
            self.scaler.update_before_every_step()

    def _scale_loss(self, tensor: Tensor) -> Tensor:
        return tensor if self.scaler is None else self.scaler.scale(tensor)

    @override
    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        if self._update_pending and self.scaler is not None:  # every optimizer of the last backward has stepped
            self._update_pending = False
            self.scaler.update()
        super().backward(self._scale_loss(tensor), model, *args, **kwargs)

    def _scaler_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.scaler is None:
            self.step_was_skipped = False
            return optimizer.step(**kwargs)
        check_optimizer(type(self).__name__, optimizer)
        output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        if self.skip_schedulers_on_overflow:
            self.step_was_skipped = self.scaler.step_was_skipped(optimizer)  # type: ignore[arg-type]
        self._update_pending = True
        return output

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        return self._scaler_step(optimizer, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is None:
            return
        if optimizer_handles_unscaling(optimizer):
            raise NotImplementedError(
                f"`{type(optimizer).__name__}` unscales inside `step()` (a fused optimizer), so its gradients cannot"
                " be unscaled for clipping. Use the non-fused optimizer to clip."
            )
        self.scaler.unscale_(optimizer)

    # Keys of the state that a subclass keeps beside the scaler's (FP8Precision's plan): never given to the scaler.
    _own_state_keys: tuple[str, ...] = ()

    def scaler_state_dict(self) -> dict[str, Any]:
        """The loss scaler's state alone (what Lightning's ``MixedPrecision`` can resume); ``{}`` without one."""
        if self.scaler is None:
            return {}
        self.apply_pending_update()
        return self.scaler.state_dict()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler_state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict({k: v for k, v in state_dict.items() if k not in self._own_state_keys})

    def __getstate__(self) -> dict[str, Any]:
        # torch refuses to pickle (or deepcopy) a GradScaler between a step and its update, which is where this plugin
        # rests at the end of every iteration: apply the update first, as any other read of the state does.
        self.apply_pending_update()
        return super().__getstate__()


def with_scaler_state(load_own_state: Callable[[Any, dict[str, Any]], None]) -> Callable[[Any, dict[str, Any]], None]:
    """Decorates the ``load_state_dict`` of a subclass that keeps state of its own beside the scaler's (declared in
    ``_own_state_keys``): the scaler's part is loaded first, then the subclass reads what it keeps."""

    @functools.wraps(load_own_state)
    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        _ScaledPrecision.load_state_dict(self, state_dict)
        load_own_state(self, state_dict)

    return load_state_dict
