"""Mixed precision on Intel XPU for the Trainer."""

from __future__ import annotations

from typing import Any

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision._trainer.scaled import TrainerScaledPrecision
from lightning_precision.fabric.xpu import XPUPrecision as _FabricXPUPrecision

__all__ = ["XPUPrecision"]


class XPUPrecision(TrainerScaledPrecision, _FabricXPUPrecision):
    """bf16 (default) or fp16 autocast on Intel GPUs for the Trainer:
    ``Trainer(strategy=TrainerXPUAccelerator.strategy(devices=1), plugins=[XPUPrecision()])``.

    Same arguments as :class:`lightning_precision.fabric.XPUPrecision` (keyword-only). In fp16 the Trainer behaviour
    (hooks, loss-scale logging, scheduler holding, checkpoints) is ``FP16MixedPrecision``'s; in bf16 there is no
    scaler. With IPEX
    in use, the model and its single optimizer are passed through ``ipex.optimize`` in place at ``connect``.
    """

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
        if self._ipex_module is not None:
            if len(optimizers) > 1:
                raise ValueError("`XPUPrecision(ipex=True)` optimizes one optimizer; this model configures several.")
            self.ipex_optimize(model, optimizers[0] if optimizers else None)
        return model, optimizers, lr_schedulers
