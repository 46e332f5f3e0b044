"""Every private Lightning API the package uses, in one place, each with the reason no public one serves; the one
exception is the XPU accelerator's connector patching in ``accelerators/_connectors.py`` (to be replaced by public
objects, issue 14).

``tests/test_lightning_private.py`` checks each of them against the installed Lightning, so an upstream change fails
loudly there instead of misbehaving in a run.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import lightning.pytorch as pl
import torch

# Casting a floating-point output to the default dtype, exactly as Lightning's own precision plugins do it.
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor as convert_fp_tensor  # noqa: F401

# Whether an optimizer unscales inside `step()` (fused optimizers); Lightning's MixedPrecision asks the same.
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling as optimizer_handles_unscaling  # noqa: F401

__all__ = [
    "batches_that_stepped",
    "convert_fp_tensor",
    "install_throughput_dtype",
    "optimizer_handles_unscaling",
    "should_update_logs",
    "unwrapped_name",
]


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether the logger connector writes on this step (``Trainer(log_every_n_steps=...)``). Lightning exposes no
    public way to ask; the plugins and callbacks read device values only on such steps."""
    return trainer._logger_connector.should_update_logs


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """Optimizer steps taken so far in the fit, counted the way the logger connector counts them."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


# ---- ThroughputMonitor ------------------------------------------------------------------------------------------------
# Lightning's ThroughputMonitor (Trainer and Fabric) picks the device's peak FLOPs for MFU from the precision plugin's
# class (`_plugin_to_compute_dtype`, an isinstance dispatch over Lightning's own plugins: "TODO: integrate this into the
# precision plugins"), so any other plugin counts as fp32. The wrapper below asks our plugins for their
# `peak_flops_dtype` and defers to Lightning for every other plugin: nothing changes for anyone else.

_THROUGHPUT_MODULES = ("lightning.fabric.utilities.throughput", "lightning.pytorch.callbacks.throughput_monitor")
_MARK = "_lightning_precision_wrapped"


def install_throughput_dtype() -> None:
    """Teach both ThroughputMonitors our plugins' compute dtype. Idempotent; called when a plugin is built."""
    import importlib

    for name in _THROUGHPUT_MODULES:
        module = importlib.import_module(name)
        original = module._plugin_to_compute_dtype
        if not getattr(original, _MARK, False):
            module._plugin_to_compute_dtype = _wrap(original)


def _wrap(original: Callable[[Any], torch.dtype]) -> Callable[[Any], torch.dtype]:
    from lightning_precision.fabric._autocast import AutocastPrecision

    @functools.wraps(original)
    def plugin_to_compute_dtype(plugin: Any) -> torch.dtype:
        if isinstance(plugin, AutocastPrecision):
            return plugin.peak_flops_dtype
        return original(plugin)

    setattr(plugin_to_compute_dtype, _MARK, True)
    return plugin_to_compute_dtype


# The attribute under which Fabric's model wrapper (`fabric.setup(model)`) holds the model: `named_parameters()` of the
# wrapper prefixes every name with it. Per-layer metric keys drop it, so they read the same under the Trainer and Fabric.
FABRIC_MODULE_PREFIX = "_forward_module."


def unwrapped_name(name: str) -> str:
    """A parameter name as the user's own model names it, also when it came from Fabric's wrapper."""
    return name[len(FABRIC_MODULE_PREFIX):] if name.startswith(FABRIC_MODULE_PREFIX) else name
