"""Callbacks; each is a thin layer over pure functions of ``lightning_precision.functional`` or ``.fp8``.

The modules beneath (``amax``, ``channels_last``, ``guard``, ``mfu``, ``underflow``) are the implementation: import
from here."""

import lightning_precision._trainer.accelerator  # noqa: F401  (registers accelerator="xpu" where the name is free)
from lightning_precision.callbacks.amax import AmaxHistoryLogger
from lightning_precision.callbacks.channels_last import ChannelsLast
from lightning_precision.callbacks.guard import FP8Guard
from lightning_precision.callbacks.mfu import MFUMonitor, MFUWindow
from lightning_precision.callbacks.underflow import GradientUnderflowMonitor

__all__ = [
    "AmaxHistoryLogger",
    "ChannelsLast",
    "FP8Guard",
    "GradientUnderflowMonitor",
    "MFUMonitor",
    "MFUWindow",
]
