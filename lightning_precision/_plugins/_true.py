"""What the Trainer adds to the true-precision plugins: optimizers checked at setup, and ``gradient_clip_val`` done in
fp32 inside the step. The rest (the closure, the inf/nan check after it, held schedulers, logging, checkpoints) is the
Trainer's part of every plugin that trains (``TrainerScaledPrecision``).

Which hooks see what: ``on_after_backward`` and ``on_before_optimizer_step`` see the 16-bit gradients, at the loss
scale under ``FP16TruePrecision`` (``plugin.loss_scale``; unscaled in fp16 the small ones would flush): they are
unscaled, and clipped, in fp32 inside the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision._plugins._scaled import TrainerScaledPrecision

if TYPE_CHECKING:  # what the mixin is always mixed with, for the type checker
    from lightning_precision.fabric._true import TruePrecision as FabricCore
else:
    FabricCore = object

__all__ = ["TrainerTruePrecision"]


class TrainerTruePrecision(TrainerScaledPrecision, FabricCore):  # type: ignore[misc]  # Trainer and Fabric hooks differ
    """Mixed into ``class X(TrainerTruePrecision, FabricX)`` where ``FabricX`` is a ``TruePrecision``."""

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        for optimizer in optimizers:  # at setup, not at the first step
            self._check_steppable(optimizer, {})
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.clip_in_step(optimizer, max_norm=float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.clip_in_step(optimizer, max_value=float(clip_val))
