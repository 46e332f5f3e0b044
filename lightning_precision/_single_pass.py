"""Every count of ``functional``'s cast statistics and the exponent histogram from one bincount per chunk.

The int32 bits of a non-negative fp32 value are ordered as the values are, so "how many |x| meet a bound" is "how many
bit patterns lie below some X". A non-decreasing key of the bits that steps up at every such X (every power of two, for
the histogram, and every format's bound) turns one bincount into all of them: count(bits < X) = cumsum(hist)[key(X)].
Each bound's X is found by evaluating the very comparison the counts are defined by (``|x| * scale <= bound`` in fp32,
the bound a Python float) on the bit patterns around it, so the counts are those comparisons', bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_precision.formats import AnyFormat, NumberFormat

__all__ = ["HIST_MAX", "HIST_MIN", "INF_BITS", "KeyPlan", "in_one_pass", "key_plan", "magnitude_bits", "single_pass"]

# Exponent histograms: one bin per power of two, log2|x| in [HIST_MIN, HIST_MAX), covering fp32 subnormals to max.
HIST_MIN, HIST_MAX = -150, 129
PASS_CHUNK = 2**16  # the smallest chunk: below it, the cost of an op's call outweighs its work

INF_BITS = 0x7F800000  # +inf's bits; |x| bits above it are nan
_COARSE = 18  # 32 key levels per binade of normal values (5 mantissa bits); below 2**23 one per power of two
_LEVELS = (0x7FFFFFFF >> _COARSE) + 1
_WINDOW = 8  # bit patterns searched each side of a bound's estimate


def magnitude_bits(chunk: Tensor, out: Tensor) -> Tensor:
    """|x| of a bf16, fp16 or fp32 chunk as the int32 bits of its fp32 value (a bf16 value's are its own, shifted)."""
    if chunk.dtype == torch.bfloat16:
        return out.copy_(chunk.view(torch.int16)).bitwise_and_(0x7FFF).bitwise_left_shift_(16)
    if chunk.dtype == torch.float32:
        return torch.bitwise_and(chunk.view(torch.int32), 0x7FFFFFFF, out=out)
    out.view(torch.float32).copy_(chunk)
    return out.bitwise_and_(0x7FFFFFFF)


def _host_level(x: int) -> int:
    return max(x.bit_length(), x >> _COARSE)


@dataclass(frozen=True)
class KeyPlan:
    """The key: ``2 * level + edge``, times ``len(tables) + 1``, plus a flag per table and per cut. ``edge`` is 0 at a
    power of two of normal values and at zero, else 1: so ``x <= 2**k`` (every format's flush bound) and inf apart from
    nan are steps too. A cut is a bit pattern X that is still no step: its flag is ``bits >= X``. With many cuts of
    normal values, they share tables (one cut per level a table, so each flag steps only inside its cut's level): the
    flag is ``bits >= table[bits >> 18]``, gathered once for any number of cuts."""

    tables: tuple[Tensor, ...]
    cuts: tuple[Tensor, ...]  # X - 1, int32 0-d tensors

    @property
    def bins(self) -> int:
        return (len(self.tables) + 1) * 2 * _LEVELS + len(self.cuts)

    def key(self, bits: Tensor, work: Sequence[Tensor] | None = None) -> Tensor:
        """The key of each bit pattern, computed in ``work`` (three int32 tensors shaped as ``bits``: the result is the
        first) so that a pass over many chunks allocates nothing per chunk."""
        key, bucket, tmp = work if work is not None else [torch.empty_like(bits) for _ in range(3)]
        torch.bitwise_right_shift(bits, _COARSE, out=bucket)
        # Subnormals: floor(log2 bits) + 1, from the exponent of the bits converted to fp32 (exact below 2**24); zero
        # gets -126. Above, the bucket (larger): 32 levels per binade, a step at each power of two.
        key.view(torch.float32).copy_(bits)
        torch.maximum(key.bitwise_right_shift_(23).sub_(126), bucket, out=key)
        # ``a >= b`` as ``-((b - a) >> 31)`` for a, b in [0, 2**31) (no overflow): integer ops, a third of the cost of a
        # compare into a bool tensor and an add. The edge: mantissa bits >= 1.
        torch.bitwise_and(bits, 0x7FFFFF, out=tmp).sub_(1).bitwise_right_shift_(31)  # -1 at an edge, else 0
        key.mul_(2).add_(1).add_(tmp)
        if self.tables:
            key.mul_(len(self.tables) + 1)
            for table in self.tables:  # a table holds X - 1; index_select: [ ] would cost four times as much
                key.sub_(torch.index_select(table, 0, bucket, out=tmp).sub_(bits).bitwise_right_shift_(31))
        for below_cut in self.cuts:
            key.sub_(torch.sub(below_cut, bits, out=tmp).bitwise_right_shift_(31))
        return key


def _is_step(x: int) -> bool:
    """Whether the key steps at bit pattern ``x`` without a cut: a new level, or just past a normal power of two."""
    return _host_level(x) != _host_level(x - 1) or ((x - 1) & 0x7FFFFF == 0 and x - 1 >= 1 << 23)


_TABLE_FROM = 5  # cuts of normal values from which one gather costs less than a flag each


def key_plan(host: Iterable[int], device: Sequence[Tensor], on: torch.device) -> KeyPlan:
    """The key for bounds known on the host (``host``) and on the device only (``device``: a tensor scale on a GPU)."""
    steps = sorted({x for x in host if 0 < x <= 0x7FFFFFFF and not _is_step(x)})
    normal = [x for x in steps if x >= 1 << 23] if sum(x >= 1 << 23 for x in steps) >= _TABLE_FROM else []
    rounds: list[dict[int, int]] = []  # bucket -> cut
    for x in normal:  # subnormal levels span several buckets: those cuts get a flag of their own
        free = next((r for r in rounds if x >> _COARSE not in r), None)
        if free is None:
            rounds.append(free := {})
        free[x >> _COARSE] = x
    tables = []
    for r in rounds:
        # X - 1 per bucket; elsewhere flag 0 (but at nan's last bit pattern, where no count ends: harmless)
        table = torch.full((_LEVELS,), 0x7FFFFFFE, dtype=torch.int32)
        table[list(r)] = torch.tensor(list(r.values()), dtype=torch.int32) - 1
        tables.append(table.to(on))
    cuts = [torch.tensor(x - 1, dtype=torch.int32, device=on) for x in steps if x not in normal]
    return KeyPlan(tuple(tables), (*cuts, *(x.to(torch.int32) - 1 for x in device)))


def _turning_bits(estimates: Sequence[float | Tensor], predicate: Callable[[int, Tensor], Tensor],
                  device: torch.device) -> Tensor:
    """For each row i, the least bit pattern in [0, inf] at which ``predicate(i, |x| values)`` holds (``INF_BITS + 1``:
    none), searched around ``estimates[i]`` (a magnitude within a few fp32 ulps of the turn) and at 0 and inf. The
    predicate must be monotone in |x|."""
    est = torch.stack([torch.as_tensor(e, dtype=torch.float64, device=device) for e in estimates]).float().abs()
    near = est.view(torch.int32).clamp(0, INF_BITS)[:, None] + torch.arange(-_WINDOW, _WINDOW + 1, device=device)
    ends = torch.tensor([0, INF_BITS], dtype=torch.int32, device=device).expand(len(estimates), 2)
    candidates = torch.cat([ends, near.clamp(0, INF_BITS).to(torch.int32)], dim=1)
    values = candidates.view(torch.float32)
    holds = torch.stack([predicate(i, values[i]) for i in range(len(estimates))])
    return torch.where(holds, candidates, INF_BITS + 1).amin(dim=1)


Question = Callable[[Tensor], Tensor]


def _questions(formats: Sequence[AnyFormat], dtype: torch.dtype) -> list[tuple[Question, float, bool]]:
    """What each count of ``_counts`` asks of m = |x| * scale (negated where it counts the values below its turn), a
    magnitude the answer turns near (before the scale), and whether the count is of the values below the turn."""
    top = torch.finfo(dtype).max

    def above(bound: float) -> Question:
        return lambda m: ~(m <= bound)

    def at_least(bound: float) -> Question:
        return lambda m: m >= bound

    rows: list[tuple[Question, float, bool]] = [
        (lambda m: m != 0, 2.0**-150, True), (above(top), top, True), (lambda m: m == math.inf, top, False)]
    for f in formats:
        assert isinstance(f, NumberFormat)  # block formats are counted chunk by chunk (``in_one_pass``)
        rows += [(above(f.flush_bound), f.flush_bound, True), (at_least(f.overflow_bound), f.overflow_bound, False)]
    return rows


def _bounds(formats: Sequence[AnyFormat], scale: float | Tensor | None, device: torch.device) -> Tensor:
    """[lo, hi) bit-pattern ranges, int32 [2, 3 + 2n], whose counts are ``_counts``'s for |x| * scale."""
    rows = _questions(formats, torch.float32)
    scaled = scale is not None and (isinstance(scale, Tensor) or scale != 1.0)

    def predicate(i: int, values: Tensor) -> Tensor:
        return rows[i][0](values.mul(scale) if scale is not None and scaled else values)

    # in fp64: a bound over a scale may lie beyond fp32's range (the bound itself may: fp32's overflow bound)
    divisor: float | Tensor = 1.0
    if scale is not None and scaled:
        divisor = scale.double() if isinstance(scale, Tensor) else scale
    estimates = [e / divisor for _, e, _ in rows]
    turns = _turning_bits(estimates, predicate, device)
    below = torch.tensor([b for _, _, b in rows], device=device)
    zero, top = torch.zeros_like(turns), torch.full_like(turns, INF_BITS + 1)
    return torch.stack([torch.where(below, zero, turns), torch.where(below, turns, top)])


_POWERS = [1 << j for j in range(23)] + [e << 23 for e in range(1, 256)]  # fp32 bits of 2**-149 .. 2**127, then inf


def _histogram_from(count_below: Tensor) -> Tensor:
    """The exponent histogram (bins HIST_MIN .. HIST_MAX - 1) from the counts below each of ``_POWERS``."""
    per_bin = count_below[1:] - count_below[:-1]  # [2**e, 2**(e+1)) for e = -149 .. 127
    return torch.nn.functional.pad(per_bin, (-149 - HIST_MIN, HIST_MAX - 128))


_POWER_BITS = torch.tensor(_POWERS, dtype=torch.int32)
_PLANS: dict[tuple, tuple[Tensor, KeyPlan, Tensor]] = {}  # bounds, key and the queries' keys, by formats and scale


def _scale_key(scale: float | Tensor | None, device: torch.device) -> tuple | None:
    """How a scale is cached: by value where reading it costs no synchronisation (a float, a tensor on the CPU)."""
    if scale is None or (not isinstance(scale, Tensor) and scale == 1.0):
        return ("none",)
    if not isinstance(scale, Tensor):
        return ("float", float(scale))
    if scale.device.type == "cpu" and device.type == "cpu" and scale.numel() == 1:
        return ("tensor", str(scale.dtype), tuple(scale.shape), scale.item())
    return None


def _plan_for(questions: Sequence[tuple[Sequence[AnyFormat], float | Tensor | None]],
              device: torch.device) -> tuple[Tensor, KeyPlan, Tensor]:
    """The [lo, hi) bit ranges of every count asked (int32 [2, k]), the key that steps at each, and the keys of the
    queries (the ranges' ends, then ``_POWERS``); cached where no scale lives only on a GPU."""
    keys = [_scale_key(s, device) for _, s in questions]
    cache = None if any(k is None for k in keys) else \
        (str(device), tuple((tuple(f.name for f in fmts), k) for (fmts, _), k in zip(questions, keys, strict=True)))
    if cache is not None and cache in _PLANS:
        return _PLANS[cache]
    host, on_device = [], []
    parts = []
    for (fmts, scale), k in zip(questions, keys, strict=True):
        if k is None:  # a scale on the device: its bounds stay there, each a cut of its own
            part = _bounds(fmts, scale, device)
            on_device += list(part.flatten().unbind())
        else:
            part = _bounds(fmts, None if k == ("none",) else scale, torch.device("cpu"))
            host += part.flatten().tolist()
        parts.append(part.to(device))
    plan = key_plan(host, on_device, device)
    bounds = torch.cat(parts, dim=1)
    queries = torch.cat([bounds.flatten(), _POWER_BITS.to(device)])
    entry = (bounds, plan, plan.key(queries).long())
    if cache is not None:
        if len(_PLANS) > 64:
            _PLANS.clear()
        _PLANS[cache] = entry
    return entry


def single_pass(flat: Tensor, questions: Sequence[tuple[Sequence[AnyFormat], float | Tensor | None]],
                max_chunk: int) -> tuple[list[Tensor], Tensor]:
    """For a flat bf16, fp16 or fp32 tensor: for each (formats, scale) asked, ``_counts``'s row of |x| * scale (int64
    [3 + 2n]); and the exponent histogram of |x|. One key and one bincount per chunk, whatever the questions."""
    bounds, plan, query_keys = _plan_for(questions, flat.device)
    # Chunks of a 48th of the tensor (four int32 buffers: a twelfth of the fp32 tensor, the bincount's and the small
    # tensors' room below a tenth), from PASS_CHUNK to max_chunk
    step = min(max_chunk, max(PASS_CHUNK, flat.numel() // 48))
    work = torch.empty(4, min(step, flat.numel()), dtype=torch.int32, device=flat.device)
    hist = None
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step]
        bits, *rest = work[:, : chunk.numel()].unbind()
        counts = torch.bincount(plan.key(magnitude_bits(chunk, bits), rest), minlength=plan.bins)
        hist = counts if hist is None else hist.add_(counts)
    if hist is None:
        hist = torch.zeros(plan.bins, dtype=torch.int64, device=flat.device)
    below = torch.nn.functional.pad(hist.cumsum(0), (1, 0))[query_keys]
    k = bounds.shape[1]
    counts = below[k : 2 * k] - below[:k]
    rows, start = [], 0
    for fmts, _ in questions:
        rows.append(counts[start : start + 3 + 2 * len(fmts)])
        start += 3 + 2 * len(fmts)
    return rows, _histogram_from(below[2 * k :])


def in_one_pass(flat: Tensor, formats: Sequence[AnyFormat], scale: float | Tensor | None = None) -> bool:
    """Whether ``single_pass`` measures it: bf16, fp16 or fp32 values, formats with one scale per tensor, one scale
    for all of it (a scale per element is multiplied in chunk by chunk)."""
    return flat.dtype in (torch.float32, torch.bfloat16, torch.float16) and flat.numel() > 0 and \
        all(isinstance(f, NumberFormat) for f in formats) and not (isinstance(scale, Tensor) and scale.numel() != 1)
