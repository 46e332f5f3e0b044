"""Precision plugins for the Trainer: ``Trainer(plugins=[FP16MixedPrecision()])``."""

import lightning_precision._trainer.accelerator  # noqa: F401  (registers accelerator="xpu" where the name is free)
from lightning_precision._trainer.bf16_mixed import BF16MixedPrecision
from lightning_precision._trainer.bf16_true import BF16TruePrecision
from lightning_precision._trainer.fp8 import FP8Precision, NVFP4Precision
from lightning_precision._trainer.fp16_mixed import FP16MixedPrecision
from lightning_precision._trainer.fp16_true import FP16TruePrecision
from lightning_precision._trainer.xpu import XPUPrecision

__all__ = ["BF16MixedPrecision", "BF16TruePrecision", "FP16MixedPrecision", "FP16TruePrecision", "FP8Precision",
           "NVFP4Precision", "XPUPrecision"]
