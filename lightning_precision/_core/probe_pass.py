"""Passes that run beside a training step without being one: ``GradientUnderflowMonitor``'s probe backward (the same
graph at a far larger loss scale) and ``MFUMonitor``'s FLOP count (a forward and backward of the first batch).

Every measuring hook (``AmaxHistoryLogger``'s, ``GradientUnderflowMonitor``'s activation hooks, ``FP8Guard``'s and the
``layers="auto"`` probe's) ignores a pass another part runs, and the plugins' after-backward bookkeeping does not count
one as a backward of the step: without this, ``AmaxHistoryLogger`` beside the monitor under fp16 recorded the probe's
output gradients, 2**16 times the real ones, as a step of its history.

Process-wide, not thread-local: autograd runs a CUDA backward, and so its tensor hooks, on a thread of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["in_probe_pass", "probe_pass"]

_RUNNING: list[object] = []  # the owners of the passes in progress


@contextmanager
def probe_pass(owner: object) -> Iterator[None]:
    """Mark the pass run inside as ``owner``'s: the others' hooks ignore it (``in_probe_pass``)."""
    _RUNNING.append(owner)
    try:
        yield
    finally:
        _RUNNING.remove(owner)


def in_probe_pass(me: object = None) -> bool:
    """Whether a pass of another owner than ``me`` is running: a hook of ``me`` then measures nothing."""
    return bool(_RUNNING) and any(owner is not me for owner in _RUNNING)  # asked in every hook: cheap when none runs
