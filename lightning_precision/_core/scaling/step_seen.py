"""What the loss scaler sees of an optimizer's step: whether it ran, through the optimizer's public step post-hook
(registered once per optimizer: registering and removing one every step cost as much as the rest of the scaler's
bookkeeping together), and, for an optimizer that evaluates its closure inside its step, whether the step left a
weight non-finite (then undone).

Torch alone: the scaler sits deep in the plugins' imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["StepSeen", "run_undoing_nonfinite"]


class StepSeen:
    """An optimizer's step post-hook, registered once: ``stepped`` is set when the optimizer's step ran, and cleared by
    the scaler before each of its ``step`` calls. Holds nothing else, so the optimizer keeps no scaler alive."""

    __slots__ = ("stepped",)

    def __init__(self) -> None:
        self.stepped = False

    def __call__(self, *_: Any) -> None:
        self.stepped = True


def run_undoing_nonfinite(optimizer: Optimizer, closure_step: Callable[[], Any]) -> tuple[Any, bool]:
    """``closure_step()`` (``optimizer``'s step, which evaluates its closure: LBFGS), and whether it left a weight
    non-finite: then the weights are put back as they were. One copy of the parameters, and a host read per
    parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [p.detach().clone() for p in params]
    output = closure_step()
    bad = not all(bool(torch.isfinite(p).all()) for p in params)
    if bad:
        with torch.no_grad():
            for p, before in zip(params, saved, strict=True):
                p.copy_(before)
    return output, bad
