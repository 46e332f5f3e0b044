"""True bf16 for the Trainer."""

from lightning_precision._trainer.true import TrainerTruePrecision
from lightning_precision.fabric.bf16_true import BF16TruePrecision as _FabricBF16TruePrecision

__all__ = ["BF16TruePrecision"]


class BF16TruePrecision(TrainerTruePrecision, _FabricBF16TruePrecision):
    """bf16 weights, gradients and optimizer states that train like fp32: ``Trainer(plugins=[BF16TruePrecision()])``.

    Same arguments as :class:`lightning_precision.fabric.BF16TruePrecision` (keyword-only). ``gradient_clip_val``
    clips in fp32 inside the step; ``precision/skipped_steps`` is logged at the logger's cadence (a step whose
    gradients hold inf/nan is skipped, never written into the weights).
    """
