"""bf16 mixed precision for the Trainer."""

from lightning_precision.fabric.bf16_mixed import BF16MixedPrecision as _FabricBF16MixedPrecision
from lightning_precision.plugins._trainer import _TrainerPrecision

__all__ = ["BF16MixedPrecision"]


class BF16MixedPrecision(_TrainerPrecision, _FabricBF16MixedPrecision):
    """bf16 autocast for the Trainer: ``Trainer(plugins=[BF16MixedPrecision()])``.

    Same arguments as :class:`lightning_precision.fabric.BF16MixedPrecision`; no scaler.
    """
