"""Callbacks; each is a thin layer over a pure function in ``lightning_precision.functional`` or beside it."""

import lightning_precision._accelerators.trainer  # noqa: F401  (registers accelerator="xpu" where the name is free)
from lightning_precision.callbacks.amax import AmaxHistoryLogger
from lightning_precision.callbacks.channels_last import ChannelsLast, apply_channels_last, to_channels_last
from lightning_precision.callbacks.guard import FP8Guard, GuardEvent
from lightning_precision.callbacks.mfu import MFUMonitor, MFUWindow
from lightning_precision.callbacks.underflow import GradientUnderflowMonitor

__all__ = [
    "AmaxHistoryLogger",
    "ChannelsLast",
    "FP8Guard",
    "GradientUnderflowMonitor",
    "GuardEvent",
    "MFUMonitor",
    "MFUWindow",
    "apply_channels_last",
    "to_channels_last",
]
