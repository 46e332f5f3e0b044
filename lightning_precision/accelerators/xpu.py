"""XPUAccelerator: Intel GPUs through upstream torch's ``torch.xpu`` (no IPEX needed), for Fabric and the Trainer.

Lightning 2.6 rejects ``accelerator="xpu"`` (#20848). Importing ``lightning_precision`` registers this accelerator
under ``"xpu"`` with both registries, and teaches both connectors two things they get wrong for an accelerator they do
not know: the default single-device strategy (they pick ``cpu``) and the DDP backend (they pick ``gloo``, which cannot
reduce XPU tensors; torch's backend for XPU is ``xccl``). Not run on real Intel hardware here: no XPU exists on this
project's machines.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from lightning.fabric.accelerators import Accelerator as FabricAccelerator
from lightning.pytorch.accelerators import Accelerator as TrainerAccelerator
from typing_extensions import override

XPU_BACKEND = "xccl"


def xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def xpu_device_count() -> int:
    return torch.xpu.device_count() if xpu_available() else 0


def describe_missing_xpu() -> str:
    """What was found instead of an XPU, for the error."""
    if not hasattr(torch, "xpu"):
        why = f"torch {torch.__version__} has no torch.xpu (torch >= 2.5 with XPU support is needed)"
    elif not torch.xpu._is_compiled():
        why = f"torch {torch.__version__} was built without XPU support (install PyTorch's XPU build)"
    else:
        why = "torch.xpu.device_count() is 0 (no Intel GPU visible: check the driver and ZE_AFFINITY_MASK)"
    others = [f"cuda x{torch.cuda.device_count()}"] if torch.cuda.is_available() else []
    if torch.backends.mps.is_available():
        others.append("mps")
    return f"{why}; found instead: {', '.join(others + ['cpu'])}"


def parse_xpu_devices(devices: Union[int, str, list[int]]) -> list[int]:
    """``devices`` as XPU indices: an int n (the first n; -1 or "auto" for all), "0,2", or a list of indices."""
    count = xpu_device_count()
    if devices in ("auto", -1, "-1"):
        return list(range(count))
    if isinstance(devices, str):
        devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
    if isinstance(devices, int):
        if devices < 1 or devices > count:
            raise ValueError(f"`devices={devices}` asks for {devices} XPU(s), but {count} are available.")
        return list(range(devices))
    missing = [d for d in devices if not 0 <= d < count]
    if missing:
        raise ValueError(f"`devices={devices}`: XPU indices {missing} do not exist ({count} available).")
    return list(devices)


class XPUAccelerator(FabricAccelerator):
    """Intel XPU accelerator for Fabric: ``Fabric(accelerator="xpu")``."""

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "xpu":
            raise ValueError(f"XPUAccelerator got device {device}; expected an xpu device.")
        torch.xpu.set_device(device)

    @override
    def teardown(self) -> None:
        if xpu_available():
            torch.xpu.empty_cache()

    @staticmethod
    @override
    def parse_devices(devices: Union[int, str, list[int]]) -> list[int]:
        return parse_xpu_devices(devices)

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("xpu", i) for i in parse_xpu_devices(devices)]

    @staticmethod
    @override
    def auto_device_count() -> int:
        return xpu_device_count()

    @staticmethod
    @override
    def is_available() -> bool:
        return xpu_available()

    @classmethod
    def name(cls) -> str:
        return "xpu"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: Any) -> None:  # Lightning's registry (its class is private)
        accelerator_registry.register("xpu", cls, description=cls.__name__, override=True)


class TrainerXPUAccelerator(TrainerAccelerator, XPUAccelerator):
    """Intel XPU accelerator for the Trainer: ``Trainer(accelerator="xpu")``; device stats from
    ``torch.xpu.memory_stats``."""

    @override
    def setup(self, trainer: Any) -> None:
        pass

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return dict(torch.xpu.memory_stats(device)) if xpu_available() else {}
