"""The range of loss scales: a fact of fp32, shared by the scaler (``_core/scaling/scaler.py``) and the pure functions
(``functional.recommend_loss_scale``), which import no Lightning."""

from __future__ import annotations

__all__ = ["MAX_LOG2_SCALE", "SCALE_RANGE"]

# 1/scale must be a normal fp32 number in both directions, or unscaling is no longer exact (and at 2**-128, inf).
MAX_LOG2_SCALE = 126
SCALE_RANGE = (2.0**-MAX_LOG2_SCALE, 2.0**MAX_LOG2_SCALE)
