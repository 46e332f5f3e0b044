"""Holding step-interval LR schedulers on optimizer steps the loss scaler skipped (Lightning issue #5558).

Lightning steps schedulers from its epoch loop, after the optimizer step and before any hook, so the hold lives in the
scheduler objects themselves: ``connect`` hands Lightning a stand-in for each step-interval scheduler the user
configured, whose ``step()`` does nothing right after a skipped step of its optimizer. Schedulers Lightning adds on its
own (``Tuner.lr_find`` swaps in its sweep after ``connect``) are never touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

__all__ = ["HeldScheduler", "hold_step_schedulers"]


class HeldScheduler:
    """Forwards everything to ``scheduler`` (state, attributes, ``isinstance`` checks) except ``step()``, which is
    skipped while ``is_held(scheduler.optimizer)`` is true."""

    def __init__(self, scheduler: Any, is_held: Callable[[Optimizer], bool]) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "_is_held", is_held)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(held, StepLR) and Lightning's ReduceLROnPlateau checks see the scheduler
        return type(self.scheduler)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "_is_held"):  # not set yet (copy, pickle build the object bare): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)

    def __reduce__(self) -> tuple:  # pickle rebuilds the stand-in, not the scheduler its __class__ answers with
        return HeldScheduler, (self.scheduler, self._is_held)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = getattr(self.scheduler, "optimizer", None)
        if optimizer is not None and self._is_held(optimizer):
            return None
        return self.scheduler.step(*args, **kwargs)

    def __repr__(self) -> str:
        return f"HeldScheduler({self.scheduler!r})"


def hold_step_schedulers(configs: list[Any], is_held: Callable[[Optimizer], bool]) -> list[Any]:
    """Lightning's ``LRSchedulerConfig`` list with each step-interval scheduler replaced by a ``HeldScheduler``."""
    return [
        dataclasses.replace(c, scheduler=HeldScheduler(c.scheduler, is_held))
        if c.interval == "step" and not isinstance(c.scheduler, HeldScheduler) else c
        for c in configs
    ]
