"""fp16 mixed precision for Fabric: fp16 autocast plus a loss scaler, for real on every device (CPU included)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_precision._lightning import optimizer_handles_unscaling
from lightning_precision.fabric._autocast import MatmulPrecision, _AutocastPrecision
from lightning_precision.fabric._scaler import ScalerConfig, _TrackingGradScaler


def _check_optimizer(owner: str, optimizer: Any) -> None:
    if isinstance(optimizer, LBFGS):
        raise ValueError(
            f"`{owner}` cannot drive `{type(optimizer).__name__}`: a loss scaler cannot skip a step that re-evaluates"
            " its closure. Use another optimizer, or `BF16MixedPrecision`, which needs no scaler."
        )


class FP16MixedPrecision(_AutocastPrecision):
    """fp16 autocast with a ``torch.amp.GradScaler``: ``Fabric(plugins=[FP16MixedPrecision()])``.

    Unlike Lightning's ``precision="16-mixed"``, which becomes bf16 on CPU, this runs fp16 autocast and a CPU
    ``GradScaler`` there too (slow without native fp16, but the numerics are the real ones).

    The scale is updated once per backward, after every optimizer that uses its gradients has stepped: at the next
    backward, or when ``loss_scale``, ``skipped_steps``, ``metrics()`` or ``state_dict()`` is read (torch's documented
    pattern for several optimizers; updating after each optimizer would unscale the second with the new scale).

    Args:
        init_scale: initial loss scale, in ``[min_scale, max_scale]``.
        growth_factor: scale multiplier after ``growth_interval`` steps without inf/nan.
        backoff_factor: scale multiplier on a step with inf/nan (that step is skipped).
        growth_interval: overflow-free steps before the scale grows.
        device: autocast device type; ``None`` takes it from where the model lives.
        matmul_precision: ``torch.set_float32_matmul_precision`` inside the forward and backward passes, restored after.
        skip_schedulers_on_overflow: record whether each step was skipped (``step_was_skipped``) so that step-interval
            LR schedulers are not advanced on it. The Trainer plugin does this for you (Lightning issue #5558).
        min_scale, max_scale: bounds of the scale (defaults 2**-24 and 2**24). torch's scaler has none, and at a scale
            of 2**-128 its unscale writes NaN into every weight on the next clean step.
        max_consecutive_skips: skipped steps in a row before the run stops with ``SkippedStepsError`` (default 50;
            None: never), instead of training nothing.
        reduce_dtype: the dtype FSDP2 reduces gradients in under ``mp_policy`` (fp32 by default; bf16 halves the bytes).
    """

    precision = "16-mixed"
    # Subclasses whose dtype needs no scaling (XPUPrecision in bf16) keep the same code with a disabled scaler.
    _uses_scaler = True

    def __init__(
        self,
        init_scale: float = ScalerConfig.init_scale,
        growth_factor: float = ScalerConfig.growth_factor,
        backoff_factor: float = ScalerConfig.backoff_factor,
        growth_interval: int = ScalerConfig.growth_interval,
        device: Optional[str] = None,
        matmul_precision: Optional[MatmulPrecision] = None,
        skip_schedulers_on_overflow: bool = True,
        min_scale: float = ScalerConfig.min_scale,
        max_scale: float = ScalerConfig.max_scale,
        max_consecutive_skips: Optional[int] = ScalerConfig.max_consecutive_skips,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(torch.float16, device=device, matmul_precision=matmul_precision, reduce_dtype=reduce_dtype)
        owner = type(self).__name__
        self.scaler_config = ScalerConfig(init_scale, growth_factor, backoff_factor, growth_interval, min_scale,
                                          max_scale, max_consecutive_skips)
        self.scaler_config.validate(owner)
        if not isinstance(skip_schedulers_on_overflow, bool):
            raise ValueError(f"`{owner}(skip_schedulers_on_overflow={skip_schedulers_on_overflow!r})`: pass True or"
                             " False.")
        self.skip_schedulers_on_overflow = skip_schedulers_on_overflow
        # Built for cpu until the model's device is known, then rebuilt there with its state.
        self.scaler = _TrackingGradScaler(device or "cpu", self.scaler_config, enabled=self._uses_scaler)
        self.step_was_skipped = False
        self._update_pending = False

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        if self.scaler.device_type != device_type:
            state = self.scaler.state_dict()
            self.scaler = _TrackingGradScaler(device_type, self.scaler_config, enabled=self._uses_scaler)
            self.scaler.load_state_dict(state)

    @property
    @override
    def loss_scale(self) -> Optional[float]:
        """The current loss scale (reads the device); ``None`` without a scaler (``XPUPrecision`` in bf16)."""
        if not self._uses_scaler:
            return None
        self.apply_pending_update()
        return float(self.scaler.scale_tensor())

    @property
    @override
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients had inf/nan (reads the device)."""
        if not self._uses_scaler:
            return 0
        self.apply_pending_update()
        return int(self.scaler.skipped_tensor())

    @override
    def metrics(self) -> dict[str, Tensor]:
        """``precision/loss_scale`` and ``precision/skipped_steps`` as tensors on the device.

        Nothing is synchronised until a logger reads them, so calling this only on logging steps costs nothing
        elsewhere: ``if step % 50 == 0: fabric.log_dict(plugin.metrics(), step)``. Call it after the iteration's last
        optimizer step: it applies the scale update that step left pending.
        """
        if not self._uses_scaler:
            return {}
        self.apply_pending_update()
        return {
            "precision/loss_scale": self.scaler.scale_tensor().float(),
            "precision/skipped_steps": self.scaler.skipped_tensor().float(),
        }

    def apply_pending_update(self) -> None:
        """Update the scale for the optimizer steps taken since the last backward, if not done yet (it happens by
        itself at the next backward). May raise ``SkippedStepsError`` (see ``max_consecutive_skips``)."""
        if self._update_pending:
            self._update_pending = False
            # Called by a read, maybe between two optimizers' steps on one backward: those still to step keep the
            # scale their gradients carry.
            self.scaler.update_before_every_step()

    @override
    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        if self._update_pending:  # every optimizer of the last backward has stepped
            self._update_pending = False
            self.scaler.update()
        super().backward(self.scaler.scale(tensor), model, *args, **kwargs)

    def _scaler_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        _check_optimizer(type(self).__name__, optimizer)
        output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        if self.skip_schedulers_on_overflow:
            self.step_was_skipped = self.scaler.step_was_skipped(optimizer)  # type: ignore[arg-type]
        self._update_pending = self.scaler.is_enabled()
        return output

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        return self._scaler_step(optimizer, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if optimizer_handles_unscaling(optimizer):
            raise NotImplementedError(
                f"`{type(optimizer).__name__}` unscales inside `step()` (a fused optimizer), so its gradients cannot"
                " be unscaled for clipping. Use the non-fused optimizer to clip."
            )
        self.scaler.unscale_(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        self.apply_pending_update()
        return self.scaler.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)
