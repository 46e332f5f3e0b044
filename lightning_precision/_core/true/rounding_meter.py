"""What rounding does to the 16-bit weights in the true-precision step, counted on the device."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ROUNDING_COUNTS", "RoundingMeter"]

# What a `RoundingMeter` counts per weight dtype, in this order (one int64 row).
ROUNDING_COUNTS = ("stepped", "updated", "lost_to_nearest", "moved")


class RoundingMeter:
    """What rounding does to the 16-bit weights, counted on the device (no host read) while a ``TrueStep`` holds it as
    its ``meter``: per weight dtype, one int64 row of ``ROUNDING_COUNTS``: the elements stepped, those whose fp32
    update was nonzero, those of them that rounding to nearest leaves at their old 16-bit value (what a plain 16-bit
    step, Lightning's ``bf16-true``, loses), and those whose stored 16-bit value changed under the step's own rounding
    (a compensated weight keeps the rest of its update in its remainder)."""

    def __init__(self) -> None:
        self.counts: dict[torch.dtype, Tensor] = {}

    def add(self, old: Tensor, before: Tensor, new: Tensor, landed: Tensor | None) -> None:
        """``old``: the 16-bit weight before the step; ``before``: the fp32 value it stood for (with its remainder);
        ``new``: the fp32 value after the step; ``landed``: what the step writes (``None``: ``new`` rounded to
        nearest)."""
        nearest = new.to(old.dtype)
        updated = new != before
        written = nearest if landed is None else landed
        row = torch.stack([torch.zeros((), dtype=torch.int64, device=old.device) + old.numel(),
                           torch.count_nonzero(updated), torch.count_nonzero(updated & (nearest == old)),
                           torch.count_nonzero(updated & (written != old))])
        total = self.counts.get(old.dtype)
        self.counts[old.dtype] = row if total is None else total + row.to(total.device)

    def take(self) -> dict[torch.dtype, Tensor]:
        """The counts so far, forgotten here."""
        counts, self.counts = self.counts, {}
        return counts
