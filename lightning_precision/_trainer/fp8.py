"""fp8 training for the Trainer."""

from collections.abc import Generator
from contextlib import contextmanager

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.nn import Module
from typing_extensions import override

from lightning_precision._trainer.scaled import TrainerScaledPrecision
from lightning_precision.fabric.fp8 import FP8Precision as _FabricFP8Precision
from lightning_precision.fabric.fp8 import NVFP4Precision as _FabricNVFP4Precision

__all__ = ["FP8Precision", "NVFP4Precision"]


class FP8Precision(TrainerScaledPrecision, _FabricFP8Precision):
    """fp8 linear layers inside bf16 autocast for the Trainer: ``Trainer(plugins=[FP8Precision()])``.

    Same arguments as :class:`lightning_precision.fabric.FP8Precision`. With fp16 compute the loss scaler behaves as in
    ``FP16MixedPrecision`` (hooks, logging at the logger's cadence, held schedulers, checkpoints). The model is
    converted in the strategy's
    ``convert_module`` (before it is moved and wrapped), so checkpoints hold the converted layers: resume with the
    same plugin. With ``ModelParallelStrategy`` (FSDP2), convert before sharding: call
    ``self.trainer.precision_plugin.convert_module(self)`` at the top of ``configure_model``.
    """

    # A batch of `layers="auto"` is a training step here, however many backward passes and optimizers it runs.
    _batch_per_backward = False

    @override
    def _to_be_sharded(self, module: Module) -> bool:
        """A LightningModule of a Trainer whose strategy is ``ModelParallelStrategy``: the plugin is converting inside
        ``configure_model``, before FSDP2 shards it."""
        if not isinstance(module, pl.LightningModule):
            return False
        try:
            strategy = module.trainer.strategy
        except RuntimeError:  # not attached to a Trainer (Lightning's own error for it)
            return False
        return isinstance(strategy, ModelParallelStrategy)

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        self._measured_batch()
        with super().train_step_context():
            yield


class NVFP4Precision(FP8Precision, _FabricNVFP4Precision):
    """NVFP4 linear layers through Transformer Engine for the Trainer: ``Trainer(plugins=[NVFP4Precision()])``. Same
    arguments as :class:`lightning_precision.fabric.NVFP4Precision`; compute capability >= 10.0."""
