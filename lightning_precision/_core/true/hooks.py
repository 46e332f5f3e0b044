"""What surrounds a true-precision step: the optimizer's step hooks run once around it, a Ctrl-C held until it has
landed, and which optimizers are being stepped (their hooks see the real parameters then)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch.optim import Optimizer

from lightning_precision._upstream.torch import optimizer_step_hooks

__all__ = ["Interrupts", "interrupts_held", "is_stepping", "step_hooks_once", "stepping"]

_STEPPING: set[int] = set()  # ids of the optimizers a TrueStep is stepping now


def is_stepping(optimizer: Optimizer) -> bool:
    """Whether a ``TrueStep`` is inside a step of ``optimizer`` (its step hooks see the real parameters then)."""
    return id(optimizer) in _STEPPING


@contextmanager
def stepping(optimizer: Optimizer) -> Generator[None, None, None]:
    """``is_stepping(optimizer)`` inside."""
    _STEPPING.add(id(optimizer))
    try:
        yield
    finally:
        _STEPPING.discard(id(optimizer))


@contextmanager
def step_hooks_once(optimizer: Optimizer) -> Generator[None, None, None]:
    """The optimizer's step hooks (its own and torch's global ones) run once around the whole step, on the real
    parameters, and are held while the optimizer steps on stand-ins: run per chunk, a hook that counts steps, or
    averages the model's weights (an EMA), would run several times a step and see it half taken. The post-hooks run
    only when the step completes. What a pre-hook returns is ignored (the step takes no arguments)."""
    pre, post = optimizer_step_hooks(optimizer)
    args: tuple[Any, ...] = (optimizer,)  # what torch's step wrapper passes its hooks
    for hook in [hook for hooks in pre for hook in hooks.values()]:
        hook(optimizer, args, {})
    held = [dict(hooks) for hooks in pre + post]
    for hooks in pre + post:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, kept in zip(pre + post, held, strict=True):
            added = dict(hooks)  # registered during the step: kept, after the others
            hooks.clear()
            hooks.update(kept)
            hooks.update(added)
    for hook in [hook for hooks in post for hook in hooks.values()]:
        hook(optimizer, args, {})


class Interrupts:
    """What ``interrupts_held`` received, and whether a second Ctrl-C is held too (while the step writes)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.writing = False

    @contextmanager
    def held_entirely(self) -> Generator[None, None, None]:
        self.writing = True
        try:
            yield
        finally:
            self.writing = False


@contextmanager
def interrupts_held() -> Generator[Interrupts, None, None]:
    """A Ctrl-C during the step is held until the step ends and raised then: raised between two chunks, it would leave
    some parameters stepped and others not. A second Ctrl-C raises at once while the optimizer steps (a step that hangs
    can still be stopped), and is held while the new values are written. Only in the main thread and where SIGINT has
    Python's default handler."""
    interrupts = Interrupts()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield interrupts
        return

    def hold(signum: int, _: Any) -> None:
        if interrupts.received and not interrupts.writing:
            raise KeyboardInterrupt
        interrupts.received.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupts.received:
        raise KeyboardInterrupt
