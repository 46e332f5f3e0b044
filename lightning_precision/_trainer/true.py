"""What the Trainer adds to the true-precision plugins: optimizers checked at setup, and ``gradient_clip_val`` done in
fp32 inside the step. The rest (the closure, the inf/nan check after it, held schedulers, logging, checkpoints) is the
Trainer's part of every plugin that trains (``TrainerScaledPrecision``).

Which hooks see what, as under Lightning's plugins: ``on_after_backward`` sees the 16-bit gradients as backward left
them (at the loss scale under ``FP16TruePrecision``), ``on_before_optimizer_step`` and ``configure_gradient_clipping``
see them unscaled. Under ``FP16TruePrecision`` the unscaled fp16 gradients are a copy for the hooks (unscaled in fp16
the smallest flush): the step unscales the scaled ones in fp32, unless a hook changed the gradients (a clip by hand),
whose values it then takes. ``gradient_clip_val`` clips in fp32 inside the step, fused optimizers included (they never
see the 16-bit gradients).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import Optimizable
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision._trainer.scaled import TrainerScaledPrecision

if TYPE_CHECKING:  # what the mixin is always mixed with, for the type checker
    from lightning_precision._core.true.precision import TruePrecision as FabricCore
else:
    FabricCore = object

__all__ = ["TrainerTruePrecision"]


class TrainerTruePrecision(TrainerScaledPrecision, FabricCore):
    """Mixed into ``class X(TrainerTruePrecision, FabricX)`` where ``FabricX`` is a ``TruePrecision``."""

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        for optimizer in optimizers:  # at setup, not at the first step
            self._check_steppable(optimizer, {})
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def _unscale_before_hooks(self, optimizer: Optimizable) -> None:
        scaler = self.step_policy.scaler
        assert scaler is not None  # true precision always checks its steps
        scaler.unscale_(optimizer)  # type: ignore[arg-type]  # the check alone: the gradients stay scaled
        self.unscale_for_hooks(optimizer)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.clip_in_step(optimizer, max_norm=float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.clip_in_step(optimizer, max_value=float(clip_val))
