"""bf16 mixed precision for the Trainer."""

from lightning_precision._trainer.scaled import TrainerScaledPrecision
from lightning_precision.fabric.bf16_mixed import BF16MixedPrecision as _FabricBF16MixedPrecision

__all__ = ["BF16MixedPrecision"]


class BF16MixedPrecision(TrainerScaledPrecision, _FabricBF16MixedPrecision):
    """bf16 autocast for the Trainer: ``Trainer(plugins=[BF16MixedPrecision()])``.

    Same arguments as :class:`lightning_precision.fabric.BF16MixedPrecision`; no loss scaling. With
    ``skip_nonfinite=True`` a step whose gradients hold inf/nan is skipped, ``precision/skipped_steps`` is
    logged at the logger's cadence, and the step-interval LR schedulers you configured are held on skipped steps.
    """
