"""AmaxHistoryLogger's record of one step: the extremes of every entry (a layer's input, weight or output gradient) as
its hooks see them, written into the step's ring slot at the flush in a few ops whatever the number of layers."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_precision._upstream.torch import CUDA_KERNEL_DTYPES, foreach_copy_, foreach_norm

__all__ = ["StepExtremes", "weight_values"]

# The weight dtypes whose amax the flush takes in one `_foreach_norm` (those its CUDA kernel takes).
_NORM_DTYPES = CUDA_KERNEL_DTYPES["_foreach_norm"][0]
# The dtypes whose first call of a step writes its extremes into a preallocated table (`record`).
_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def weight_values(weight: Any) -> Tensor:
    """A weight as numbers. Under FSDP2 with torchao's float8 all-gather, a layer's forward sees its weight already
    gathered in fp8 (a ``Float8TrainingTensor``, which has no reductions): its values are the fp8 data times the scale,
    whose amax is the full weight's amax (the scale maps it to the format's max, which fp8 holds exactly)."""
    to_values = getattr(weight, "to_original_precision", None)
    return to_values() if callable(to_values) else weight


def _write_plan(key: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor | None]:
    """For a step's records (entry of each, in order): the distinct entries, and where an entry was recorded more than
    once, a gather [entries, most calls] of record positions (padded with the position past the end, a zero) whose
    row max is the entry's amax."""
    entries = list(dict.fromkeys(key))
    if len(entries) == len(key):
        return torch.tensor(entries, device=device), None
    positions: dict[int, list[int]] = {e: [] for e in entries}
    for r, e in enumerate(key):
        positions[e].append(r)
    width = max(len(p) for p in positions.values())
    gather = [positions[e] + [len(key)] * (width - len(positions[e])) for e in entries]
    return torch.tensor(entries, device=device), torch.tensor(gather, device=device)


def _table(entries: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    table = torch.zeros(entries, 2, dtype=dtype, device=device)
    return table, [(row[0], row[1]) for row in table]


class StepExtremes:
    """This step's extremes: a tensor's first call of the step writes (min, max) straight into a preallocated row per
    entry (``layer * 3 + kind``) of its dtype's table (fp32, bf16, fp16); repeated calls, float64 and subclasses go to
    ``records``. ``extremes`` is the fp32 table, which the flush reduces into the ring slot."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.extremes = torch.zeros(0, 2)
        self.tables: dict[torch.dtype, tuple[Tensor, list[tuple[Tensor, Tensor]]]] = {}
        self.written: dict[torch.dtype, set[int]] = {}
        self.records: list[tuple[int, tuple[Tensor, Tensor]]] = []
        self.plans: dict[tuple[int, ...], tuple[Tensor, Tensor | None]] = {}
        self.modules: list[nn.Module] = []
        self.defer_weights = False  # on an accelerator, unsharded: see `reset`
        self.weights_seen: set[int] = set()
        # Layers whose plain weight ran this step: their amaxes are taken together at the flush (`record_deferred`).
        self.weights_ran: dict[int, None] = {}

    def reset(self, modules: list[nn.Module], device: torch.device, defer_weights: bool) -> None:
        """Tables for ``modules`` (three entries each) on ``device``; ``defer_weights``: on an accelerator, where the
        weights' amaxes are one ``_foreach_norm`` at the flush (a launch, not one a layer). Nothing of a step that did
        not end (an exception, a fit stopped between forward and step) carries over."""
        self.weights_seen.clear()
        self.records.clear()
        self.plans.clear()
        self.modules = modules
        self.device = device
        self.defer_weights = defer_weights
        self.tables = {dtype: _table(len(modules) * 3, dtype, device) for dtype in _TABLE_DTYPES}
        self.extremes = self.tables[torch.float32][0]
        self.written = {dtype: set() for dtype in _TABLE_DTYPES}
        self.weights_ran.clear()

    def record(self, i: int, k: int, t: Tensor) -> None:
        # One reduction per tensor, one pass with no |t| temporary (abs().amax() writes |t| first; vector_norm(inf) is
        # 10x slower on CPU), combined into the history once per step (see flush). An fp32 tensor's first call in the
        # step writes its extremes into this step's preallocated row: no allocation, nothing to gather at the flush.
        # The caller turns gradients off (once a hook, not once a tensor: the context costs microseconds on a CPU),
        # rather than `t.detach()`: a detach is an aten op per tensor.
        j = i * 3 + k
        written = self.written.get(t.dtype)
        if written is not None and j not in written and type(t) in (Tensor, nn.Parameter) and t.device == self.device:
            written.add(j)
            torch.aminmax(t, out=self.tables[t.dtype][1][j])
        else:  # float64, a subclass, or a repeated call (accumulation, a re-used layer)
            self.records.append((j, torch.aminmax(t)))

    def record_weight(self, i: int, weight: Any) -> None:
        """Layer ``i``'s weight, once a step (it changes only at the optimizer step), or at the flush with the others
        where it is a plain tensor the fused norm takes."""
        if self.defer_weights and type(weight) in (Tensor, nn.Parameter) and weight.dtype in _NORM_DTYPES and \
                weight.device == self.device:
            self.weights_ran[i] = None  # measured with the others at the flush
        elif i not in self.weights_seen:  # the weight changes only at the optimizer step
            self.weights_seen.add(i)
            self.record(i, 1, weight_values(weight))

    def record_deferred(self) -> None:
        """On an accelerator, the amax of every plain weight that ran this step, taken at the flush (weights change
        only at the optimizer step, after it): one ``_foreach_norm(inf)`` for all layers written into their rows by
        one copy, not a reduction per layer."""
        if not self.weights_ran:
            return
        layers = list(self.weights_ran)
        self.weights_ran.clear()
        weights: list[Tensor] = [cast(Tensor, self.modules[i].weight) for i in layers]  # plain: see `record_weight`
        with torch.no_grad():
            amaxes = foreach_norm(weights, math.inf)
        rows = self.tables[torch.float32][1]
        foreach_copy_([rows[i * 3 + 1][1] for i in layers], amaxes)
        self.written[torch.float32].update(i * 3 + 1 for i in layers)

    def flush(self, slot: Tensor, last: Tensor) -> None:
        """Write this step's recorded amaxes into its ring ``slot`` (max over repeated calls: accumulation, re-used
        layers), in place, and each entry's last non-zero amax into ``last`` (both flat views). An ordinary step: about
        ten small ops, two more for each other dtype whose table was written, whatever the number of layers (each
        distinct op costs tens of microseconds on a CPU right after a backward, whose matrix products have evicted the
        caches)."""
        self.record_deferred()
        # Every entry: the tables' rows (zero where nothing was written) replace the slot's stale values; the other
        # dtypes' tables join the fp32 one where they were written (widening to fp32 is exact; nan propagates).
        extremes = self.extremes.abs_()
        for dtype, (table, _) in self.tables.items():
            if dtype != torch.float32 and self.written[dtype]:
                torch.maximum(extremes, table.abs(), out=extremes)
                table.zero_()
                self.written[dtype].clear()
        torch.amax(extremes, dim=1, out=slot)
        extremes.zero_()
        self.written[torch.float32].clear()
        if self.records:
            self._flush_records(slot)
        torch.where(slot > 0, slot, last, out=last)
        self.weights_seen.clear()

    def _flush_records(self, slot: Tensor) -> None:
        key = tuple(j for j, _ in self.records)
        plan = self.plans.get(key)
        if plan is None:  # a host-to-device copy from pageable memory syncs the stream: once per pattern
            plan = self.plans[key] = _write_plan(key, slot.device)
        entries, gather = plan
        extremes = torch.stack([v for _, pair in self.records for v in pair]).view(-1, 2)
        amax = extremes.abs().amax(dim=1).to(slot)
        if gather is not None:  # an entry recorded more than once: the max of its calls
            amax = torch.cat([amax, amax.new_zeros(1)])[gather].amax(dim=1)
        slot.index_copy_(0, entries, torch.maximum(slot.index_select(0, entries), amax))
        self.records.clear()
