"""Accelerators; importing ``lightning_precision`` registers ``"xpu"`` with Lightning's registries where the name is
free. Nothing of Lightning's is patched: pick the XPU strategy with
``TrainerXPUAccelerator.strategy(devices)`` for the Trainer, ``XPUAccelerator.strategy(devices)`` for Fabric.

Importing this package registers the Fabric accelerator (Fabric's plugins import nothing of ``lightning.pytorch``);
``_accelerators.trainer`` registers the Trainer's, imported by the Trainer plugins, the callbacks and the top-level
package's names.
"""

from typing import Any

from lightning.fabric.accelerators import ACCELERATOR_REGISTRY

from lightning_precision._accelerators.xpu import XPUAccelerator

# One name, two registries: Fabric's gets the Fabric class here, the Trainer's the Trainer class (which inherits it).
XPUAccelerator.register_accelerators(ACCELERATOR_REGISTRY)

__all__ = ["TrainerXPUAccelerator", "XPUAccelerator"]


def __getattr__(name: str) -> Any:
    if name == "TrainerXPUAccelerator":  # the Trainer's side, loaded (and registered) on first use
        from lightning_precision._trainer.accelerator import TrainerXPUAccelerator

        return TrainerXPUAccelerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
