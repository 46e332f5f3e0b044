"""fp16 mixed precision for the Trainer: the Fabric plugin plus the Trainer's closure, hooks, logging and schedulers."""

from __future__ import annotations

from lightning_precision._trainer.scaled import TrainerScaledPrecision
from lightning_precision.fabric.fp16_mixed import FP16MixedPrecision as _FabricFP16MixedPrecision

__all__ = ["FP16MixedPrecision"]


class FP16MixedPrecision(TrainerScaledPrecision, _FabricFP16MixedPrecision):
    """fp16 autocast with a ``GradScaler`` for the Trainer: ``Trainer(plugins=[FP16MixedPrecision()])``.

    Same arguments as :class:`lightning_precision.fabric.FP16MixedPrecision` (keyword-only). In addition, at the
    logger's cadence it logs ``precision/loss_scale`` and ``precision/skipped_steps`` (no device read on other steps),
    and with ``skip_schedulers_on_overflow=True`` (the default) the step-interval LR schedulers you configured are not
    advanced after a step the scaler skipped (Lightning's own schedulers, such as ``Tuner.lr_find``'s sweep, are left
    alone).

    The scale is updated after the optimizer step with automatic optimization (one optimizer per backward), and at the
    end of ``training_step`` with manual optimization, so that several optimizers stepped after one backward are all
    unscaled with the same scale.

    Which hooks see scaled values:

    - ``on_before_backward``: the unscaled loss (Lightning's ``MixedPrecision`` passes the scaled one);
    - ``on_after_backward``: scaled gradients (unscaling waits until every accumulated backward pass is done);
    - ``on_before_optimizer_step`` and ``configure_gradient_clipping``: unscaled gradients, except with fused
      optimizers, which unscale inside ``step`` (clipping then raises, as in Lightning).
    """
