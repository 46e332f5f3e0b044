"""Teach Lightning's two accelerator connectors about XPU: a clear error when none is present, the right default
strategy, and the XCCL backend for DDP. Installed once, when ``lightning_precision`` is imported; each wrapper defers
to Lightning unless the accelerator is XPU."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import connector as fabric_connector
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.connectors import accelerator_connector

from lightning_precision.accelerators.xpu import XPU_BACKEND, XPUAccelerator, describe_missing_xpu, xpu_available


def is_xpu(flag: Any) -> bool:
    return flag == "xpu" or isinstance(flag, XPUAccelerator)


def choose_xpu_strategy(parallel_devices: list, num_nodes: int, single: type, ddp: type) -> Any:
    """One device: a single-device strategy on it (Lightning would pick cpu). Several, or several nodes: DDP over
    XCCL (Lightning would pick gloo, which has no XPU support)."""
    if num_nodes <= 1 and len(parallel_devices) <= 1:
        return single(device=parallel_devices[0] if parallel_devices else torch.device("xpu", 0))
    return ddp(process_group_backend=XPU_BACKEND)


def _patch(connector_cls: type, single: type, ddp: type) -> None:
    if getattr(connector_cls, "_lightning_precision_xpu", False):
        return
    original_init = connector_cls._set_parallel_devices_and_init_accelerator
    original_choose = connector_cls._choose_strategy

    def _set_parallel_devices_and_init_accelerator(self: Any) -> None:
        if is_xpu(self._accelerator_flag) and not xpu_available():
            raise RuntimeError(f"`accelerator='xpu'` was asked for, but no Intel XPU is available: {describe_missing_xpu()}.")
        original_init(self)

    def _choose_strategy(self: Any) -> Any:
        if is_xpu(self._accelerator_flag):
            return choose_xpu_strategy(self._parallel_devices, self._num_nodes_flag, single, ddp)
        return original_choose(self)

    connector_cls._set_parallel_devices_and_init_accelerator = _set_parallel_devices_and_init_accelerator
    connector_cls._choose_strategy = _choose_strategy
    connector_cls._lightning_precision_xpu = True


def install() -> None:
    _patch(accelerator_connector._AcceleratorConnector, SingleDeviceStrategy, DDPStrategy)
    _patch(fabric_connector._Connector, FabricSingleDeviceStrategy, FabricDDPStrategy)
