"""GradientUnderflowMonitor's activation hooks: a forward hook on every leaf module whose output gradient, in the
backward passes it captures, goes to the monitor's measure (the real backward) or to the probe's own histogram (the
probe backward, at the probe's scale)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_precision._core.probe_pass import in_probe_pass
from lightning_precision.functional import exponent_histogram

__all__ = ["ActivationHooks"]


class ActivationHooks:
    """The hooks of ``owner`` (whose own probe pass they measure, and no other's): ``measure(grad, scale)`` takes each
    activation gradient of a real backward while ``capturing``, with the loss scale it carries."""

    def __init__(self, owner: object, measure: Callable[[Tensor, Tensor | None], None]) -> None:
        self.owner = owner
        self.measure = measure
        self.handles: list[Any] = []
        self.on = False
        self.scale: Tensor | None = None
        # While the probe's backward runs: its effective scale, and the activation gradients its hooks saw.
        self.probe_scale: Tensor | None = None
        self.probe_histogram: Tensor | None = None

    def attach(self, module: nn.Module) -> None:
        """Hook every leaf module's output."""
        for sub in module.modules():
            if next(sub.children(), None) is None:
                self.handles.append(sub.register_forward_hook(self.forward_hook))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def capturing(self, on: bool, loss_scale: Tensor | float | None = None) -> None:
        """Measure activation gradients of the coming backward passes (``loss_scale``: the scale they carry)."""
        self.on = on
        self.scale = torch.as_tensor(loss_scale) if loss_scale is not None else None

    @contextmanager
    def probing(self, scale: Tensor) -> Iterator[list[Tensor | None]]:
        """Inside: the probe's backward at ``scale``, whose activation gradients go to its histogram alone (not a
        second count of the step); the one-item list holds that histogram once done (None if none was seen)."""
        seen: list[Tensor | None] = [None]
        self.probe_scale, self.probe_histogram = scale, None
        try:
            yield seen
        finally:
            seen[0], self.probe_scale, self.probe_histogram = self.probe_histogram, None, None

    def forward_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.on and isinstance(output, Tensor) and output.requires_grad and output.is_floating_point() \
                and not in_probe_pass(self.owner):
            # A hook on the output tensor, not a full backward hook: those fail when the next op is in-place
            # (ReLU(inplace=True) in torchvision's ResNets); the gradient seen is the same.
            output.register_hook(self.grad_hook)

    def grad_hook(self, grad: Tensor) -> None:
        if in_probe_pass(self.owner):  # another's pass through this step's graph
            return
        if self.probe_scale is not None:  # inside the probe's backward: its histogram only, at its own scale
            try:
                hist = exponent_histogram(grad, 1.0 / self.probe_scale)
            except (RuntimeError, TypeError, ValueError):
                return  # the real backward's hook reports it
            self.probe_histogram = hist if self.probe_histogram is None else self.probe_histogram + hist
            return
        self.measure(grad, self.scale)
