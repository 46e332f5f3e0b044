"""fp16 mixed precision for Fabric: fp16 autocast plus a loss scaler, for real on every device (CPU included)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

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

    Args:
        init_scale: initial loss scale.
        growth_factor: scale multiplier after ``growth_interval`` steps without inf/nan.
        backoff_factor: scale multiplier on a step with inf/nan (that step is skipped).
        growth_interval: overflow-free steps before the scale grows.
        device: autocast device type; ``None`` takes it from where the model lives.
        matmul_precision: ``torch.set_float32_matmul_precision`` for the run, restored at teardown.
        skip_schedulers_on_overflow: record whether each step was skipped (``step_was_skipped``) so that step-interval
            LR schedulers are not advanced on it. The Trainer plugin does this for you (Lightning issue #5558).
    """

    precision = "16-mixed"
    # Subclasses whose dtype needs no scaling (XPUPrecision in bf16) keep the same code with a disabled scaler.
    _uses_scaler = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: Optional[str] = None,
        matmul_precision: Optional[MatmulPrecision] = None,
        skip_schedulers_on_overflow: bool = True,
    ) -> None:
        super().__init__(torch.float16, device=device, matmul_precision=matmul_precision)
        self.scaler_config = ScalerConfig(init_scale, growth_factor, backoff_factor, growth_interval)
        self.scaler_config.validate(type(self).__name__)
        self.skip_schedulers_on_overflow = skip_schedulers_on_overflow
        # Built for cpu until the model's device is known, then rebuilt there with its state.
        self.scaler = _TrackingGradScaler(device or "cpu", self.scaler_config, enabled=self._uses_scaler)
        self.step_was_skipped = False

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        if self.scaler._device != device_type:
            state = self.scaler.state_dict()
            self.scaler = _TrackingGradScaler(device_type, self.scaler_config, enabled=self._uses_scaler)
            self.scaler.load_state_dict(state)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (reads the device)."""
        return float(self.scaler.scale_tensor())

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients had inf/nan (reads the device)."""
        return int(self.scaler.skipped_tensor())

    def metrics(self) -> dict[str, Tensor]:
        """``precision/loss_scale`` and ``precision/skipped_steps`` as tensors on the device.

        Nothing is synchronised until a logger reads them, so calling this only on logging steps costs nothing
        elsewhere: ``if step % 50 == 0: fabric.log_dict(plugin.metrics(), step)``.
        """
        if not self._uses_scaler:
            return {}
        return {
            "precision/loss_scale": self.scaler.scale_tensor().float(),
            "precision/skipped_steps": self.scaler.skipped_tensor().float(),
        }

    @override
    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        super().backward(self.scaler.scale(tensor), model, *args, **kwargs)

    def _scaler_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        _check_optimizer(type(self).__name__, optimizer)
        output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        if self.skip_schedulers_on_overflow:
            self.step_was_skipped = self.scaler.step_was_skipped(optimizer)  # type: ignore[arg-type]
        self.scaler.update()
        return output

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        return self._scaler_step(optimizer, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if _optimizer_handles_unscaling(optimizer):
            raise NotImplementedError(
                f"`{type(optimizer).__name__}` unscales inside `step()` (a fused optimizer), so its gradients cannot"
                " be unscaled for clipping. Use the non-fused optimizer to clip."
            )
        self.scaler.unscale_(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)
