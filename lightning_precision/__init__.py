"""lightning-precision: fast, observable and safe low-precision training for PyTorch Lightning.

Trainer plugins live here (``lightning_precision.FP16MixedPrecision``); Fabric plugins of the same names live in
``lightning_precision.fabric``.
"""

import lightning_precision.accelerators  # noqa: F401  (registers accelerator='xpu' where the name is free)
from lightning_precision.fabric._scaler import ScalerConfig, SkippedStepsError
from lightning_precision.fp8 import FP8LayerPolicy
from lightning_precision.plan import PlanRule, PrecisionPlan
from lightning_precision.plugins import (
    BF16MixedPrecision,
    FP8Precision,
    FP16MixedPrecision,
    NVFP4Precision,
    XPUPrecision,
)
from lightning_precision.warnings import NoEffectWarning

__version__ = "0.1.0"

__all__ = [
    "BF16MixedPrecision",
    "FP16MixedPrecision",
    "FP8LayerPolicy",
    "FP8Precision",
    "NVFP4Precision",
    "NoEffectWarning",
    "PlanRule",
    "PrecisionPlan",
    "ScalerConfig",
    "SkippedStepsError",
    "XPUPrecision",
    "__version__",
]
