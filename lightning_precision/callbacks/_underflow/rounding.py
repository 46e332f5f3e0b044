"""What rounding does to the 16-bit weights of a true-precision run, for GradientUnderflowMonitor: a meter armed in
the plugin's fp32 step while it steps, and the fractions logged from its counts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_precision._core.true.rounding_meter import ROUNDING_COUNTS, RoundingMeter
from lightning_precision.formats import get_format

if TYPE_CHECKING:
    from lightning_precision._core.true.step import TrueStep

__all__ = ["UpdateRounding", "rounding_metrics"]


class UpdateRounding:
    """The meter a true-precision step counts into while armed (``arm`` until ``disarm``)."""

    def __init__(self) -> None:
        self.meter = RoundingMeter()
        self.armed: TrueStep | None = None  # the true-precision step counting into `meter` now

    def arm(self, stepper: TrueStep) -> None:
        stepper.meter, self.armed = self.meter, stepper

    def disarm(self, device: torch.device) -> dict[str, Tensor]:
        """The counts of the armed step by weight format (none when nothing was armed); the step counts no more. The
        armed step's own format is there even when nothing was stepped, so that every process syncs the same states
        (each then counts what its own step did); ``device``: where such a row of zeros goes."""
        stepper, self.armed = self.armed, None
        if stepper is None:
            return {}
        stepper.meter = None
        counts = self.meter.take()
        counts.setdefault(stepper.dtype, torch.zeros(len(ROUNDING_COUNTS), dtype=torch.int64, device=device))
        return {get_format(dtype).name: row for dtype, row in counts.items()}


def rounding_metrics(per_format: dict[str, Tensor]) -> dict[str, Tensor]:
    """What rounding lost and moved, as fractions of the elements whose fp32 update was nonzero; a format none of
    whose elements was stepped in the window (every step skipped, or not stepped by the true step) is left out:
    unknown, not 0."""
    metrics: dict[str, Tensor] = {}
    for fmt, row in per_format.items():
        counts = dict(zip(ROUNDING_COUNTS, row.unbind(), strict=True))
        if int(counts["stepped"]) == 0:  # read on a logging step
            continue
        updated = counts["updated"].clamp(min=1).double()
        metrics[f"precision/update_lost/{fmt}"] = counts["lost_to_nearest"].double() / updated
        metrics[f"precision/update_moved/{fmt}"] = counts["moved"].double() / updated
    return metrics
