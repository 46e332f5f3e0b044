"""True fp16 for the Trainer."""

from lightning_precision._trainer.true import TrainerTruePrecision
from lightning_precision.fabric.fp16_true import FP16TruePrecision as _FabricFP16TruePrecision

__all__ = ["FP16TruePrecision"]


class FP16TruePrecision(TrainerTruePrecision, _FabricFP16TruePrecision):
    """fp16 weights, gradients and optimizer states that train like fp32, never a NaN weight:
    ``Trainer(plugins=[FP16TruePrecision()])``.

    Same arguments as :class:`lightning_precision.fabric.FP16TruePrecision` (keyword-only). Logs
    ``precision/loss_scale`` and ``precision/skipped_steps`` at the logger's cadence; ``gradient_clip_val`` clips in
    fp32 inside the step (of the unscaled gradients).
    """
