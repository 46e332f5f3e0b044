"""Every private Lightning name the package uses, each with the reason no public route serves.

``tests/upstream/test_upstream_lightning.py`` exercises what we rely on against the installed Lightning, so that an
upstream change fails loudly there instead of misbehaving in a run.

Nothing here imports ``lightning.pytorch`` at import time: the Fabric plugins use this module too. The Trainer's
names are imported inside the functions only the Trainer side calls.

ThroughputMonitor's compute dtype: Lightning's ThroughputMonitor (Fabric's and the Trainer's) picks the device's peak
FLOPs for MFU from the precision plugin's class through ``_plugin_to_compute_dtype``, an isinstance dispatch over
Lightning's own plugins (upstream: "TODO: integrate this into the precision plugins"); every other plugin counts as
fp32. Decision: keep the replacement, fenced here with its canary. No public route exists: the monitor takes no dtype
argument and asks no method of the plugin, and dropping the replacement would make the monitor report MFU against the
fp32 peak for our plugins, a wrong number reported silently (several times too high on GPUs whose bf16 peak is a
multiple of their fp32 one). The
wrapper asks our plugins for their ``peak_flops_dtype`` and defers to Lightning for every other plugin, so nothing
changes for anyone else; when Lightning asks the plugin itself, the wrapper goes.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

# Whether an optimizer unscales inside `step()` (fused optimizers); Lightning's MixedPrecision asks the same, and no
# public API of torch or Lightning answers it.
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling as optimizer_handles_unscaling

# Casting a floating-point output to the default dtype, exactly as Lightning's own precision plugins do it; no public
# function does the same cast (floating tensors only, integer and bool left alone).
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor as convert_fp_tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "FABRIC_MODULE_PREFIX",
    "FABRIC_THROUGHPUT_MODULE",
    "TRAINER_THROUGHPUT_MODULE",
    "after_closure",
    "batches_that_stepped",
    "convert_fp_tensor",
    "install_throughput_dtype",
    "optimizer_handles_unscaling",
    "publish_metrics",
    "should_update_logs",
    "unwrapped_name",
]


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether the logger connector writes on this step (``Trainer(log_every_n_steps=...)``). Lightning exposes no
    public way to ask; the plugins and callbacks read device values only on such steps."""
    return trainer._logger_connector.should_update_logs


def after_closure(plugin: Any, model: pl.LightningModule, optimizer: Any) -> None:
    """What Lightning's Trainer ``Precision.optimizer_step`` does between the closure and the step: the callbacks' and
    the LightningModule's ``on_before_optimizer_step``, then gradient clipping at the Trainer's ``gradient_clip_val``.
    The seam's ``optimizer_step`` must unscale and check between the closure and these hooks, so it cannot call
    Lightning's step whole; no public method runs the hooks and clipping in Lightning's order."""
    plugin._after_closure(model, optimizer)


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """Optimizer steps taken so far in the fit, counted the way the logger connector counts them (``global_step``
    counts every optimizer's step, so it runs ahead with several optimizers)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def publish_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int, callback_metrics: bool = False) -> None:
    """``metrics`` to every logger of the Trainer at ``step`` (loggers write on rank zero), and with
    ``callback_metrics`` into ``trainer.callback_metrics`` and ``trainer.logged_metrics`` too (where
    ``ModelCheckpoint``, ``EarlyStopping`` and the user look), without ``LightningModule.log``: each of its calls
    moves the whole result collection (about 0.6 ms a key on a CPU), which made a logging step of many keys cost
    several training steps. Both properties return the
    logger connector's own dicts (``_callback_metrics``, ``_logged_metrics``), which it updates in place and never
    clears during a fit: values put there stay, as a logged value does."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
    if callback_metrics:  # and `trainer.logged_metrics`, as `self.log` did
        values = {k: torch.tensor(v) for k, v in metrics.items()}
        trainer._logger_connector._callback_metrics.update(values)
        trainer._logger_connector._logged_metrics.update(values)


# ---- ThroughputMonitor (see the module docstring) --------------------------------------------------------------------

FABRIC_THROUGHPUT_MODULE = "lightning.fabric.utilities.throughput"
# The Trainer's monitor has its own dispatch, which calls the Fabric one bound at its import: both are wrapped.
TRAINER_THROUGHPUT_MODULE = "lightning.pytorch.callbacks.throughput_monitor"


def install_throughput_dtype(module_name: str, plugin_class: type[Any]) -> Callable[[], None]:
    """Teach the ThroughputMonitor of ``module_name`` the ``peak_flops_dtype`` of every ``plugin_class`` instance;
    returns what undoes it (Lightning's own function put back, unless someone wrapped it after us)."""
    module: Any = importlib.import_module(module_name)
    original = module._plugin_to_compute_dtype
    wrapped = _wrap(original, plugin_class)
    module._plugin_to_compute_dtype = wrapped

    def undo() -> None:
        if module._plugin_to_compute_dtype is wrapped:
            module._plugin_to_compute_dtype = original

    return undo


def _wrap(original: Callable[[Any], torch.dtype], plugin_class: type[Any]) -> Callable[[Any], torch.dtype]:
    @functools.wraps(original)
    def plugin_to_compute_dtype(plugin: Any) -> torch.dtype:
        if isinstance(plugin, plugin_class):
            return plugin.peak_flops_dtype
        return original(plugin)

    return plugin_to_compute_dtype


# The attribute under which Fabric's model wrapper (`fabric.setup(model)`) holds the model (`_forward_module`):
# `named_parameters()` of the wrapper prefixes every name with it, and no public name strips it. Per-layer metric keys
# drop it, so they read the same under the Trainer and Fabric.
FABRIC_MODULE_PREFIX = "_forward_module."


def unwrapped_name(name: str) -> str:
    """A parameter name as the user's own model names it, also when it came from Fabric's wrapper."""
    return name[len(FABRIC_MODULE_PREFIX):] if name.startswith(FABRIC_MODULE_PREFIX) else name
