"""GradientUnderflowMonitor's accumulated state, one ``Accumulator``: the exponent histograms over the run, and the
window's counts until they are logged. Everything stays on the device until a sync."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_precision._core.accumulator import Accumulator, Reduce, as_reduce_op
from lightning_precision._core.true.rounding_meter import ROUNDING_COUNTS
from lightning_precision._single_pass import HIST_MAX, HIST_MIN
from lightning_precision._upstream.lightning import unwrapped_name

if TYPE_CHECKING:
    from lightning_precision.functional import CastStats

__all__ = ["ACTIVATION", "PARAM", "add_counts", "add_histogram", "add_rounding", "histogram_of", "load_histograms",
           "module_path", "new_state", "pending_device", "sync_state", "synced_counts", "synced_rounding"]

_COUNT = "count/"  # the accumulator's per-window CastStats, one int64 [5] state per key ("count/param/fp16")
_ROUNDING = "rounding/"  # per-window `RoundingMeter` counts, one int64 row of ROUNDING_COUNTS per weight format
# Row 0 parameter gradients, row 1 activation gradients: the global totals ("last": already summed across processes)
# and this process's part since the last sync ("sum").
_TOTALS = ("histogram/param", "histogram/activation")
_PENDING = ("pending/param", "pending/activation")
PARAM, ACTIVATION = 0, 1  # the histograms' rows


def new_state() -> Accumulator:
    """The histograms, declared; the window's counts join as ``count/<key>`` states when first measured."""
    state = Accumulator()
    for totals, pending in zip(_TOTALS, _PENDING, strict=True):
        state.add_state(totals, torch.zeros(HIST_MAX - HIST_MIN, dtype=torch.int64), "last")
        state.add_state(pending, torch.zeros(HIST_MAX - HIST_MIN, dtype=torch.int64), "sum")
    return state


def histogram_of(state: Accumulator, row: int) -> Tensor:
    totals = state[_TOTALS[row]]
    return totals + state[_PENDING[row]].to(totals.device)


def add_histogram(state: Accumulator, row: int, hist: Tensor) -> None:
    state.update(_PENDING[row], hist)


def module_path(param_name: str) -> str:
    """The module a parameter belongs to, the key of its per-layer counts."""
    param_name = unwrapped_name(param_name)
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def _stacked(stats: CastStats) -> Tensor:
    fields = [getattr(stats, f.name) for f in dataclasses.fields(stats)]
    return torch.stack([f.to(fields[0].device) for f in fields])


def add_counts(state: Accumulator, key: str, stats: CastStats) -> None:
    name = _COUNT + key
    if name not in state:
        state.add_state(name, torch.zeros(5, dtype=torch.int64), "sum")
    state.update(name, _stacked(stats))


def add_rounding(state: Accumulator, fmt: str, row: Tensor) -> None:
    name = _ROUNDING + fmt
    if name not in state:
        state.add_state(name, torch.zeros(len(ROUNDING_COUNTS), dtype=torch.int64), "sum")
    state.update(name, row)


def pending_device(state: Accumulator) -> torch.device:
    """Where the counts are (a collective may need them on the GPU)."""
    return state[_PENDING[0]].device


def sync_state(state: Accumulator, reduce: Reduce | None, counts: bool) -> dict[str, Tensor]:
    """One sync: the window's counts (``counts``: gradient and rounding ones) and this process's histograms since
    the last sync, summed across processes by ``reduce`` in one call; the histograms join the totals, so every
    process holds the same global histogram. Returns the counts by state name, and forgets them."""
    counted = [name for prefix in (_COUNT, _ROUNDING) for name in state.names(prefix)] if counts else []
    synced = state.sync(as_reduce_op(reduce), [*counted, *_PENDING])
    for totals, pending in zip(_TOTALS, _PENDING, strict=True):
        state.set(totals, state[totals].to(synced[pending].device) + synced[pending])
    state.reset(*_PENDING)
    state.remove_state(*counted)
    return {name: synced[name] for name in counted}


def synced_counts(synced: dict[str, Tensor]) -> dict[str, Tensor]:
    """The synced gradient counts by key (``param/fp16``), rows of ``CastStats``' fields."""
    return {name[len(_COUNT):]: row for name, row in synced.items() if name.startswith(_COUNT)}


def synced_rounding(synced: dict[str, Tensor]) -> dict[str, Tensor]:
    """The synced rounding counts by weight format."""
    return {name[len(_ROUNDING):]: row for name, row in synced.items() if name.startswith(_ROUNDING)}


def load_histograms(state: Accumulator, saved: Mapping[str, Tensor]) -> None:
    """Restore the global histograms of a checkpoint (``"histogram"``, ``"activation_histogram"``), with nothing of
    this process pending."""
    for totals, key in zip(_TOTALS, ("histogram", "activation_histogram"), strict=True):
        state.set(totals, saved[key].to(torch.int64))
    state.reset(*_PENDING)
