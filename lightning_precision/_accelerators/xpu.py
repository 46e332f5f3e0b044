"""XPUAccelerator: Intel GPUs through upstream torch's ``torch.xpu`` (no IPEX needed), for Fabric (the Trainer's
subclass is ``_trainer/accelerator.py``).

Lightning 2.6 rejects ``accelerator="xpu"`` (Lightning #20848). Importing ``lightning_precision`` registers this
accelerator under ``"xpu"``, unless the name is taken (a Lightning that ships its own XPU accelerator keeps it).

For an accelerator they do not know, Lightning's connectors pick the wrong strategy: single-device on ``cpu``, and DDP
over ``gloo``, which cannot reduce XPU tensors (torch's backend for XPU is ``xccl``). Nothing here patches them: the
right strategy comes from ``XPUAccelerator.strategy(devices)`` (Fabric) or ``TrainerXPUAccelerator.strategy(devices)``
(the Trainer), public objects passed as ``strategy=``; the wrong one is stopped before the first step with that fix.
Not run on real Intel hardware here: no XPU exists on this project's machines.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator as FabricAccelerator
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from typing_extensions import override

from lightning_precision._upstream.torch import xpu_is_compiled

__all__ = ["XPU_BACKEND", "XPUAccelerator", "describe_missing_xpu", "parse_xpu_devices", "strategy_fix",
           "xpu_available", "xpu_device_count"]

XPU_BACKEND = "xccl"


def xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def xpu_device_count() -> int:
    return torch.xpu.device_count() if xpu_available() else 0


def describe_missing_xpu() -> str:
    """What was found instead of an XPU, for the error."""
    if not hasattr(torch, "xpu"):
        why = f"torch {torch.__version__} has no torch.xpu (torch >= 2.5 with XPU support is needed)"
    elif not xpu_is_compiled():
        why = f"torch {torch.__version__} was built without XPU support (install PyTorch's XPU build)"
    else:
        why = "torch.xpu.device_count() is 0 (no Intel GPU visible: check the driver and ZE_AFFINITY_MASK)"
    others = [f"cuda x{torch.cuda.device_count()}"] if torch.cuda.is_available() else []
    if torch.backends.mps.is_available():
        others.append("mps")
    return f"{why}; found instead: {', '.join(others + ['cpu'])}"


def parse_xpu_devices(devices: int | str | list[int]) -> list[int]:
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


def strategy_fix(cls: Any) -> str:
    """The call that picks the right strategy, for the errors of ``cls`` (Fabric's accelerator or the Trainer's)."""
    return (f"`{cls.entry_point}(strategy={cls.__name__}.strategy(devices=...))`, from"
            " `lightning_precision`")


class XPUAccelerator(FabricAccelerator):
    """Intel XPU accelerator for Fabric: ``Fabric(strategy=XPUAccelerator.strategy(devices=1))``. With
    ``accelerator="xpu"`` alone Lightning picks a CPU or gloo strategy, which ``setup_device`` stops with this fix.

    Constructing it without an XPU raises an error that says why (torch without XPU support, or no device visible) and
    what was found instead; Lightning builds it exactly when ``accelerator="xpu"`` is asked for.
    """

    _single_strategy: Any = FabricSingleDeviceStrategy
    _ddp_strategy: Any = FabricDDPStrategy
    entry_point = "L.Fabric"  # named in the errors' fix

    def __init__(self) -> None:
        if not xpu_available():
            raise RuntimeError(
                f"`accelerator='xpu'` was asked for, but no Intel XPU is available: {describe_missing_xpu()}."
            )
        super().__init__()

    @classmethod
    def strategy(cls, devices: int | str | list[int] = "auto", num_nodes: int = 1) -> Any:
        """The strategy for ``devices`` XPUs, with this accelerator: one device gives a single-device strategy on it,
        several (or several nodes) DDP over XCCL. Lightning would pick ``cpu`` and ``gloo``."""
        accelerator = cls()
        indices = parse_xpu_devices(devices)
        if num_nodes <= 1 and len(indices) <= 1:
            device = torch.device("xpu", indices[0] if indices else 0)
            return cls._single_strategy(device=device, accelerator=accelerator)
        return cls._ddp_strategy(accelerator=accelerator, parallel_devices=[torch.device("xpu", i) for i in indices],
                                 process_group_backend=XPU_BACKEND)

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "xpu":
            raise ValueError(
                f"{type(self).__name__} was given the strategy's device {device}: Lightning picks a CPU strategy for"
                f" accelerators it does not know. Pass the XPU strategy: {strategy_fix(type(self))}."
            )
        torch.xpu.set_device(device)

    @override
    def teardown(self) -> None:
        if xpu_available():
            torch.xpu.empty_cache()

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> list[int]:
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
        # Never replace a registration: an "xpu" Lightning (or another package) registered first is left in place.
        if "xpu" not in accelerator_registry:
            accelerator_registry.register("xpu", cls, description=cls.__name__)
