"""Flat buffers with a view per parameter, made once and kept, whose memory is held only while a step runs.

The true-precision step widens a chunk of 16-bit parameters to fp32 and steps views of those fp32 copies. Made each
step, a view per parameter is an op per parameter (on a GPU every op costs a launch's worth of host time); kept, the
views would hold the fp32 copies between steps (bf16-mixed's memory). So the views are made once, and the flat tensor
under them gives its memory back after each step by resizing its storage to 0 (as FSDP2 frees an unsharded parameter
while its views stay): ``UntypedStorage.resize_`` is no aten op, and the views are valid again once it is resized back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Buffer", "Workspace"]


class Buffer:
    """One flat tensor of ``dtype`` and its views shaped as ``shapes``, its memory taken by ``take`` and freed by
    ``free``."""

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device) -> None:
        numels = [math.prod(shape) for shape in shapes]
        self.flat = torch.empty(sum(numels), dtype=dtype, device=device)
        self.nbytes = self.flat.untyped_storage().nbytes()
        self.views = [part.view(shape) for part, shape in zip(self.flat.split(numels), shapes, strict=True)]

    def take(self) -> Buffer:
        storage = self.flat.untyped_storage()
        if storage.nbytes() != self.nbytes:
            storage.resize_(self.nbytes)
        return self

    def free(self) -> None:
        self.flat.untyped_storage().resize_(0)


class Workspace:
    """The buffers of one chunk of parameters (their local shapes, on one device, weights of one dtype), by role and
    dtype, made when first asked for; those taken during a step are freed by ``free``."""

    def __init__(self, shapes: Sequence[torch.Size], device: torch.device, weight_dtype: torch.dtype) -> None:
        self.shapes = list(shapes)
        self.weight_dtype = weight_dtype
        self.device = device
        self.total = sum(math.prod(shape) for shape in shapes)
        self._buffers: dict[tuple[str, torch.dtype], Buffer] = {}
        self._taken: list[Buffer] = []
        self._numels: Tensor | None = None
        # Per parameter, what the optimizer steps in its place and their gradients, and per state name what it updates
        # (aliases of the views, kept: the same objects every step); set by the step.
        self.stand_ins: list[Tensor] = []
        self.stand_in_grads: list[Tensor] = []
        self.aliases: dict[str, list[Tensor]] = {}

    def buffer(self, role: str, dtype: torch.dtype) -> Buffer:
        buffer = self._buffers.get((role, dtype))
        if buffer is None:
            buffer = self._buffers[(role, dtype)] = Buffer(self.shapes, dtype, self.device)
        else:
            buffer.take()
        if all(b is not buffer for b in self._taken):
            self._taken.append(buffer)
        return buffer

    def numels(self) -> Tensor:
        """The parameters' element counts on the device, made once by a fill each: ``torch.tensor(counts, device=...)``
        would copy from pageable host memory, which waits for the device on CUDA."""
        if self._numels is None:
            self._numels = torch.empty(len(self.shapes), dtype=torch.int64, device=self.device)
            for i, shape in enumerate(self.shapes):
                self._numels[i] = math.prod(shape)
        return self._numels

    def per_element(self, values: Tensor) -> Tensor:
        """One value per parameter, repeated over its elements (flat, the buffers' layout)."""
        return values.repeat_interleave(self.numels(), output_size=self.total)

    def free(self) -> None:
        for buffer in self._taken:
            buffer.free()
        self._taken.clear()
