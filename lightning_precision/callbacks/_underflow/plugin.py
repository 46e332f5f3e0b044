"""What GradientUnderflowMonitor reads off a precision plugin: whether its backward is fp16, and the loss scale the
gradients carry. Nothing here synchronises with the device."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_precision._core.scaling.scaler import InStepScaler, scale_of

__all__ = ["fp16_backward", "hooks_see_scaled_loss", "loss_scale_of", "scale_in_gradients", "unscaled"]


def fp16_backward(plugin: Any) -> bool:
    """Whether the plugin's backward runs in fp16 with a loss scaler: ours (compute_dtype) or Lightning's 16-mixed."""
    return loss_scale_of(plugin) is not None and (
        getattr(plugin, "compute_dtype", None) == torch.float16 or getattr(plugin, "precision", None) == "16-mixed"
    )


def hooks_see_scaled_loss(plugin: Any) -> bool:
    """Lightning's MixedPrecision hands ``on_before_backward`` the scaled loss; ours hand it the real one."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return isinstance(plugin, MixedPrecision)


def loss_scale_of(plugin: Any) -> Tensor | None:
    """The loss scale of a precision plugin with an enabled ``GradScaler`` (ours or Lightning's), as a device tensor
    (no synchronisation), or None when gradients are not scaled."""
    scaler = getattr(plugin, "scaler", None)
    if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
        return None
    return scale_of(scaler)


def scale_in_gradients(plugin: Any) -> Tensor | None:
    """The loss scale the gradients still carry at ``on_before_optimizer_step`` (no synchronisation): a plugin that
    unscales inside its own step (``FP16TruePrecision``: in fp16 the small gradients would flush), else None."""
    scaler = getattr(plugin, "scaler", None)
    if not isinstance(scaler, InStepScaler) or not scaler.is_enabled():
        return None
    return scaler.carried_scale()


def unscaled(g: Tensor, scale: Tensor | float) -> Tensor:
    """``g / scale`` in (at least) fp32: in fp16 the small values would flush (a 0-d scale does not promote ``g``)."""
    wide = g.to(torch.promote_types(g.dtype, torch.float32))
    return wide / (scale.to(wide.device) if isinstance(scale, Tensor) else scale)
