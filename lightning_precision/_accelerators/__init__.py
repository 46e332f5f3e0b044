"""Accelerators; importing ``lightning_precision`` registers ``"xpu"`` with Lightning's registries where the name is
free. Nothing of Lightning's is patched: pick the XPU strategy with ``XPUAccelerator.strategy(devices)``."""

from lightning.fabric.accelerators import ACCELERATOR_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.accelerators import AcceleratorRegistry as _TRAINER_REGISTRY

from lightning_precision._accelerators.xpu import TrainerXPUAccelerator, XPUAccelerator

# One name, two registries: Fabric's gets the Fabric class, the Trainer's the Trainer class (which inherits it).
XPUAccelerator.register_accelerators(_FABRIC_REGISTRY)
TrainerXPUAccelerator.register_accelerators(_TRAINER_REGISTRY)

__all__ = ["TrainerXPUAccelerator", "XPUAccelerator"]
