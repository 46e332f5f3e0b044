"""What every Trainer plugin adds to its Fabric class: device resolution at ``connect``, the Trainer's ThroughputMonitor
taught the plugin's compute dtype, and checkpoint compatibility."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision._core.autocast import AutocastPrecision
from lightning_precision._upstream.lightning import TRAINER_THROUGHPUT_MODULE, install_throughput_dtype

if TYPE_CHECKING:  # what the mixin is always mixed with, for the type checker
    FabricCore = AutocastPrecision
else:
    FabricCore = object

__all__ = ["LIGHTNING_AMP_KEY", "TrainerHooks"]

# Keys under which Lightning's own plugin saves the scaler: its class name, and the pre-1.6 name.
LIGHTNING_AMP_KEY = "MixedPrecision"
_LIGHTNING_AMP_KEYS = (LIGHTNING_AMP_KEY, "native_amp_scaling_state")


class TrainerHooks(TrainerPrecision, FabricCore):
    """Mixed into ``class X(TrainerHooks, FabricX)``: Trainer hooks first, Fabric behaviour after (see MRO)."""

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        # Strategies call this after moving the model: the first moment its device is known, and the one step that
        # resolves it (hardware checks, FSDP2's checks).
        self._module_ref = weakref.ref(model)
        self.resolve_device()
        return super().connect(model, optimizers, lr_schedulers)

    def _install_throughput_dtype(self) -> None:
        super()._install_throughput_dtype()
        install_throughput_dtype(TRAINER_THROUGHPUT_MODULE, AutocastPrecision)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        with self._backward_scope():
            super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        # Fabric accepts any Precision, Trainer plugins included, and then fails deep inside `fabric.backward`.
        if not isinstance(module, pl.LightningModule):
            name = type(self).__name__
            raise TypeError(
                f"`lightning_precision.{name}` is the Trainer plugin and cannot run `fabric.backward`. With Fabric,"
                f" use `from lightning_precision.fabric import {name}`."
            )
        return super().pre_backward(tensor, module)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The Trainer loads `checkpoint[type(self).__qualname__]` right after this hook; a run started with
        # Lightning's MixedPrecision saved its scaler under another key, so take it from there.
        if type(self).__qualname__ in checkpoint:
            return
        for key in _LIGHTNING_AMP_KEYS:
            if key in checkpoint:
                self.load_state_dict(checkpoint[key])
                return
