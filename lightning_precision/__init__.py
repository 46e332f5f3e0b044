"""lightning-precision: fast, observable and safe low-precision training for PyTorch Lightning.

Trainer plugins live here (``lightning_precision.FP16MixedPrecision``); Fabric plugins of the same names live in
``lightning_precision.fabric``.

Names load on first use (PEP 562): ``import lightning_precision`` alone imports neither torch nor Lightning, so the
command line's ``--version`` and ``--help`` answer at once. The first name used (or an import of the ``fabric``,
``callbacks`` subpackage) registers ``accelerator="xpu"`` with Lightning.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name and the module that defines it.
_SOURCE = {
    "BF16MixedPrecision": "lightning_precision._trainer",
    "BF16TruePrecision": "lightning_precision._trainer",
    "FP16MixedPrecision": "lightning_precision._trainer",
    "FP16TruePrecision": "lightning_precision._trainer",
    "FP8LayerPolicy": "lightning_precision.fp8",
    "FP8Precision": "lightning_precision._trainer",
    "NVFP4Precision": "lightning_precision._trainer",
    "NoEffectWarning": "lightning_precision._warnings",
    "PlanRule": "lightning_precision.fp8",
    "PrecisionPlan": "lightning_precision.fp8",
    "ScalerConfig": "lightning_precision._core.scaling.scaler",
    "SkippedStepsError": "lightning_precision._core.scaling.scaler",
    "TrainerXPUAccelerator": "lightning_precision._accelerators",
    "XPUAccelerator": "lightning_precision._accelerators",
    "XPUPrecision": "lightning_precision._trainer",
}

__all__ = [
    "BF16MixedPrecision",
    "BF16TruePrecision",
    "FP16MixedPrecision",
    "FP16TruePrecision",
    "FP8LayerPolicy",
    "FP8Precision",
    "NVFP4Precision",
    "NoEffectWarning",
    "PlanRule",
    "PrecisionPlan",
    "ScalerConfig",
    "SkippedStepsError",
    "TrainerXPUAccelerator",
    "XPUAccelerator",
    "XPUPrecision",
    "__version__",
]  # written out (not `[*_SOURCE, ...]`) for linters and editors; tests/package/test_public_api.py checks both agree

if TYPE_CHECKING:  # what type checkers and editors see
    from lightning_precision._accelerators import TrainerXPUAccelerator, XPUAccelerator
    from lightning_precision._core.scaling.scaler import ScalerConfig, SkippedStepsError
    from lightning_precision._trainer import (
        BF16MixedPrecision,
        BF16TruePrecision,
        FP8Precision,
        FP16MixedPrecision,
        FP16TruePrecision,
        NVFP4Precision,
        XPUPrecision,
    )
    from lightning_precision._warnings import NoEffectWarning
    from lightning_precision.fp8 import FP8LayerPolicy, PlanRule, PrecisionPlan


def __getattr__(name: str) -> Any:
    if name in _SOURCE:
        import lightning_precision._trainer.accelerator  # noqa: F401  (registers accelerator="xpu" where the name is free)

        value = getattr(importlib.import_module(_SOURCE[name]), name)
        globals()[name] = value  # loaded once
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule, as `import` made it an attribute
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
