"""fp8 training for the Trainer."""

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.types import Optimizable
from typing_extensions import override

from lightning_precision.fabric.fp8 import FP8Precision as _FabricFP8Precision
from lightning_precision.fabric.fp8 import NVFP4Precision as _FabricNVFP4Precision
from lightning_precision.plugins._trainer import _TrainerPrecision, log_metrics

__all__ = ["FP8Precision", "NVFP4Precision"]


class FP8Precision(_TrainerPrecision, _FabricFP8Precision):
    """fp8 linear layers inside bf16 autocast for the Trainer: ``Trainer(plugins=[FP8Precision()])``.

    Same arguments as :class:`lightning_precision.fabric.FP8Precision`. The model is converted in the strategy's
    ``convert_module`` (before it is moved and wrapped), so checkpoints hold the converted layers: resume with the
    same plugin. With ``ModelParallelStrategy`` (FSDP2), convert before sharding: call
    ``self.trainer.precision_plugin.convert_module(self)`` at the top of ``configure_model``.
    """

    # A batch of `layers="auto"` is a training step here, however many backward passes and optimizers it runs.
    _batch_per_backward = False

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        self._measured_batch()
        self._manual_model: Optional[pl.LightningModule] = None
        with super().train_step_context():
            yield
        # With manual optimization the backward passes ran inside `training_step`: the count is known by now.
        model, self._manual_model = self._manual_model, None
        if model is not None:
            log_metrics(model, self.metrics())

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        output = super().optimizer_step(optimizer, model, closure, **kwargs)
        self._after_optimizer_step()
        if model.automatic_optimization:  # after the closure's backward: once per optimizer step
            log_metrics(model, self.metrics())
        else:  # once per training step, however many optimizers it steps
            self._manual_model = model
        return output

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_manual_model", None)
        return state


class NVFP4Precision(FP8Precision, _FabricNVFP4Precision):
    """NVFP4 linear layers through Transformer Engine for the Trainer: ``Trainer(plugins=[NVFP4Precision()])``. Same
    arguments as :class:`lightning_precision.fabric.NVFP4Precision`; compute capability >= 10.0."""
