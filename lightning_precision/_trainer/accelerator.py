"""TrainerXPUAccelerator: the XPU accelerator for the Trainer (the Fabric one, ``xpu.py``, imports nothing of
``lightning.pytorch``). Importing this module registers it under ``"xpu"`` in the Trainer's registry where the name is
free."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator as TrainerAccelerator
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from typing_extensions import override

from lightning_precision._accelerators.xpu import XPU_BACKEND, XPUAccelerator, strategy_fix, xpu_available

__all__ = ["TrainerXPUAccelerator"]


class TrainerXPUAccelerator(TrainerAccelerator, XPUAccelerator):
    """Intel XPU accelerator for the Trainer: ``Trainer(strategy=TrainerXPUAccelerator.strategy(devices=4))``; device
    stats from ``torch.xpu.memory_stats``."""

    _single_strategy = SingleDeviceStrategy
    _ddp_strategy = DDPStrategy
    entry_point = "L.Trainer"

    @override
    def setup(self, trainer: Any) -> None:
        # Fabric has no such hook; the Trainer's stops DDP over gloo here, before the first step.
        # Only Lightning's own choice is stopped: gloo, or None (resolved to gloo for a device it does not know). An
        # explicit backend is the user's (oneCCL's "ccl" from the IPEX workflow reduces XPU tensors too).
        strategy = trainer.strategy
        if hasattr(strategy, "process_group_backend") and strategy.process_group_backend in (None, "gloo"):
            raise ValueError(
                f"`{type(strategy).__name__}` reduces over 'gloo', which cannot reduce XPU tensors. Pass the XPU"
                f" strategy: {strategy_fix(type(self))} (DDP over {XPU_BACKEND!r})."
            )

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return dict(torch.xpu.memory_stats(device)) if xpu_available() else {}


TrainerXPUAccelerator.register_accelerators(AcceleratorRegistry)
