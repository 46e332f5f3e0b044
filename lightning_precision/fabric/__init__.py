"""Precision plugins for Lightning Fabric: ``Fabric(plugins=[BF16MixedPrecision()])``."""

import lightning_precision._accelerators  # noqa: F401  (registers accelerator="xpu" where the name is free)
from lightning_precision._core.scaling.scaler import ScalerConfig
from lightning_precision.fabric.bf16_mixed import BF16MixedPrecision
from lightning_precision.fabric.bf16_true import BF16TruePrecision
from lightning_precision.fabric.fp8 import FP8Precision, NVFP4Precision
from lightning_precision.fabric.fp16_mixed import FP16MixedPrecision
from lightning_precision.fabric.fp16_true import FP16TruePrecision
from lightning_precision.fabric.xpu import XPUPrecision

__all__ = ["BF16MixedPrecision", "BF16TruePrecision", "FP16MixedPrecision", "FP16TruePrecision", "FP8Precision",
           "NVFP4Precision", "ScalerConfig", "XPUPrecision"]
