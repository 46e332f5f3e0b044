"""Every change the plugins make outside themselves, to the whole process: named here, made while a plugin needs it,
undone when the last plugin that holds it lets go (its ``teardown``) or is garbage collected.

- ``FABRIC_THROUGHPUT`` and ``TRAINER_THROUGHPUT``: Lightning's ThroughputMonitor (Fabric's, and the Trainer's, which
  has its own dispatch) maps a precision plugin to the dtype of its peak FLOPs through a private function that takes
  any plugin it does not know for fp32; wrapped, it asks ours for ``peak_flops_dtype`` (others are answered as
  before). Held from the moment a plugin exists (built, or copied and unpickled, which skip ``__init__``: its
  ``__new__``) until it is collected, not released at ``teardown``: the Trainer's monitor reads the dtype in its
  ``setup``, before the plugin sees the next stage (``validate`` after ``fit``).
- ``STATE_INIT_HOOK``: torch's global optimizer-step pre-hook of the true-precision plugins. torch's distributed
  checkpoint takes a step at lr 0 on a fresh optimizer to learn its states' layout; the hook has such a step taken by
  the plugin's own fp32 step (``TruePrecision.take_state_init``). Held from ``convert_module`` (which comes before any
  checkpoint is loaded) until ``teardown``.

tests/core/test_process_effects.py checks that each is made, undone, and made again by a plugin used again.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_precision._upstream.lightning import (
    FABRIC_THROUGHPUT_MODULE,
    TRAINER_THROUGHPUT_MODULE,
    install_throughput_dtype,
)

__all__ = ["FABRIC_THROUGHPUT", "STATE_INIT_HOOK", "TRAINER_THROUGHPUT", "ProcessEffect"]


class ProcessEffect:
    """One change to the process, made by ``install`` (which returns what undoes it) when the first holder takes it,
    undone when the last one releases it or is collected."""

    def __init__(self, name: str, install: Callable[..., Callable[[], None]]) -> None:
        self.name = name
        self._install = install
        self._undo: Callable[[], None] | None = None
        self._holders: weakref.WeakSet[Any] = weakref.WeakSet()
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()  # holders whose collection releases them

    @property
    def made(self) -> bool:
        """Whether the change is in force."""
        return self._undo is not None

    def holders(self) -> list[Any]:
        """The live holders (the hook of ``STATE_INIT_HOOK`` asks each)."""
        return list(self._holders)

    def hold(self, holder: Any, *install_args: Any) -> None:
        """``holder`` needs the change: made now if not in force (``install(*install_args)``)."""
        if holder not in self._watched:
            self._watched.add(holder)
            weakref.finalize(holder, self._collected)
        self._holders.add(holder)
        if self._undo is None:
            self._undo = self._install(*install_args)

    def release(self, holder: Any) -> None:
        self._holders.discard(holder)
        self._collected()

    def _collected(self) -> None:
        if not self._holders and self._undo is not None:
            undo, self._undo = self._undo, None
            undo()


def _state_init_hook() -> Callable[[], None]:
    return register_optimizer_step_pre_hook(_before_any_step).remove


def _before_any_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Before every optimizer step of the process: one that meets an empty state may be torch's distributed checkpoint
    learning the states' layout; each true-precision plugin alive is asked (it passes over its own step, which runs the
    step hooks, this one among them, before it has created the states)."""
    if optimizer.state:
        return
    for plugin in STATE_INIT_HOOK.holders():
        plugin.take_state_init(optimizer)


# Held with the plugin class whose instances the monitor asks (`hold(plugin, AutocastPrecision)`).
FABRIC_THROUGHPUT = ProcessEffect("Fabric's ThroughputMonitor reads the plugin's compute dtype",
                                  functools.partial(install_throughput_dtype, FABRIC_THROUGHPUT_MODULE))
TRAINER_THROUGHPUT = ProcessEffect("the Trainer's ThroughputMonitor reads the plugin's compute dtype",
                                   functools.partial(install_throughput_dtype, TRAINER_THROUGHPUT_MODULE))
STATE_INIT_HOOK = ProcessEffect("a global optimizer-step pre-hook of the true-precision plugins", _state_init_hook)
