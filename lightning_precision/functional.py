"""The pure functions of the package, in one namespace: what a Fabric loop or plain PyTorch calls without a Trainer,
and what the callbacks are thin layers over.

Defined here: the cast statistics (``underflow_stats`` and the counts beneath it, ``exponent_histogram``,
``recommend_loss_scale``) and Transformer Engine's amax-history arithmetic (``roll_amax_history``, ``delayed_scale``).
Re-exported from the modules that define them: channels-last conversion (``apply_channels_last``,
``to_channels_last``), fp8 layer selection and numerics per layer (``select_fp8_layers``, ``fp8_sensitivity``, from
``lightning_precision.fp8``) and model FLOPs utilisation (``mfu``, ``choose_peak``, ``model_flops_per_step``).

Every count is a tensor on the input's device, so callers can accumulate without synchronising and read only when they
log.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_precision._channels_last import apply_channels_last, to_channels_last
from lightning_precision._mfu import choose_peak, mfu, model_flops_per_step
from lightning_precision.fabric._scaler import MAX_LOG2_SCALE
from lightning_precision.formats import FORMATS, AnyFormat, BlockFormat, NumberFormat, get_format
from lightning_precision.fp8._selection import select_fp8_layers
from lightning_precision.fp8._sensitivity import fp8_sensitivity, torchao_scale

__all__ = [
    # cast statistics
    "CastStats",
    "LossScaleAdvice",
    "UnderflowReport",
    "cast_stats",
    "dynamic_scale_stats",
    "exponent_histogram",
    "gradient_stats",
    "multi_format_stats",
    "multi_scale_stats",
    "recommend_loss_scale",
    "underflow_stats",
    # Transformer Engine's delayed scaling
    "delayed_scale",
    "roll_amax_history",
    # re-exported: channels-last (lightning_precision._channels_last)
    "apply_channels_last",
    "to_channels_last",
    # re-exported: fp8 layer selection and numerics per layer (lightning_precision.fp8)
    "fp8_sensitivity",
    "select_fp8_layers",
    # re-exported: model FLOPs utilisation (lightning_precision._mfu)
    "choose_peak",
    "mfu",
    "model_flops_per_step",
]

TensorsLike = Tensor | Iterable[Tensor] | Mapping[str, Tensor]
FormatLike = str | torch.dtype | NumberFormat | BlockFormat


@dataclass
class CastStats:
    """Counts for one tensor (or a total), as 0-d int64 tensors on the device.

    - ``numel``: elements.
    - ``exact_zero``: zero before any cast (not underflow: e.g. gradients of convolutions on 1x1 maps).
    - ``underflow``: non-zero finite values whose cast (after multiplying by ``scale``) is zero.
    - ``overflow``: finite values whose cast is inf or, for formats without inf (e4m3fn), saturates at ``max``
      with an error beyond rounding (``|x| >= max + ulp(max)/2``).
    - ``nonfinite``: inf or nan already before the cast (counted in nothing else).

    Example:
        >>> s = cast_stats(torch.tensor([0.0, 1e-9, 1.0, 1e5]), "fp16")
        >>> s.exact_zero.item(), s.underflow.item(), s.overflow.item(), s.nonfinite.item()
        (1, 1, 1, 0)
        >>> s.underflow_fraction.item()
        0.25
    """

    numel: Tensor
    exact_zero: Tensor
    underflow: Tensor
    overflow: Tensor
    nonfinite: Tensor

    def __add__(self, other: CastStats) -> CastStats:
        return CastStats(*(a + b for a, b in zip(self._fields(), other._fields(), strict=True)))

    def _fields(self) -> tuple[Tensor, ...]:
        return (self.numel, self.exact_zero, self.underflow, self.overflow, self.nonfinite)

    def _fraction(self, count: Tensor) -> Tensor:
        return count.double() / self.numel.clamp(min=1).double()

    @property
    def underflow_fraction(self) -> Tensor:
        return self._fraction(self.underflow)

    @property
    def overflow_fraction(self) -> Tensor:
        return self._fraction(self.overflow)

    @property
    def exact_zero_fraction(self) -> Tensor:
        return self._fraction(self.exact_zero)


@dataclass
class UnderflowReport:
    """``underflow_stats``'s answer: the format, the scale applied, counts per tensor and in total.

    Example:
        >>> report = underflow_stats({"w": torch.tensor([2.0**-26, 3e-8]), "b": torch.tensor([0.0, 1.0])}, "fp16")
        >>> report.format.name, {name: s.underflow.item() for name, s in report.per_tensor.items()}
        ('fp16', {'w': 1, 'b': 0})
        >>> report.total.underflow.item(), report.total.exact_zero.item()
        (1, 1)
    """

    format: NumberFormat | BlockFormat
    scale: float | Tensor
    per_tensor: dict[str, CastStats] = field(default_factory=dict)
    total: CastStats | None = None


def _named(tensors: TensorsLike) -> dict[str, Tensor]:
    if isinstance(tensors, Tensor):
        return {"0": tensors}
    if isinstance(tensors, Mapping):
        return dict(tensors)
    return {str(i): t for i, t in enumerate(tensors)}


# Elements per pass. Every temporary is a few bytes per element of one chunk (about 20 in all), so the extra memory of a
# measurement stays near 20 MB whatever the size of the tensor, and a chunk stays in cache between the passes.
CHUNK = 2**20
PASS_CHUNK = 2**16  # the single pass's smallest chunk: below it, the cost of an op's call outweighs its work

# Exponent histograms: one bin per power of two, log2|x| in [HIST_MIN, HIST_MAX), covering fp32 subnormals to max.
HIST_MIN, HIST_MAX = -150, 129


def measurable_values(tensor: Tensor) -> Tensor:
    """The real floating-point values a tensor holds, flat and, where the layout allows, without a copy: a sparse
    tensor's stored values, a complex tensor's real and imaginary parts.

    Example:
        >>> measurable_values(torch.tensor([1 + 2j, 3 - 4j])).tolist()
        [1.0, 2.0, 3.0, -4.0]
        >>> measurable_values(torch.eye(3).to_sparse()).tolist()
        [1.0, 1.0, 1.0]
    """
    x = tensor.detach()
    if x.layout != torch.strided:
        x = x.coalesce().values() if x.layout == torch.sparse_coo else x.values()
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_floating_point():
        raise TypeError(f"cast statistics need a floating-point tensor, got {x.dtype}.")
    if not x.is_contiguous():
        # A dense layout in another order (channels-last, a transpose): permute to it for a view; counts ignore order.
        order = sorted(range(x.dim()), key=lambda d: -x.stride()[d])
        permuted = x.permute(order)
        x = permuted if permuted.is_contiguous() else x.contiguous()
    return x.view(-1)


def _chunks(flat: Tensor) -> Iterable[Tensor]:
    for start in range(0, flat.numel(), CHUNK):
        yield flat[start : start + CHUNK]


def _magnitudes(chunk: Tensor) -> Tensor:
    # At least fp32, so that scaling cannot itself round or overflow first.
    return chunk.float().abs() if chunk.element_size() < 4 else chunk.abs()


def _counts(a: Tensor, formats: Sequence[AnyFormat], tensor_amax: Tensor | None = None) -> Tensor:
    """For |x| values ``a``: [zeros, finite, inf, then (at most flush bound, at least overflow bound) per format],
    as one int64 tensor on the device. Each count is one compare-and-count pass (the cheapest on CPU and GPU alike).
    A block format compares each element scaled by its block's multiplier with the element format's bounds (a scaled
    zero stays zero and inf stays inf, so the subtractions in ``_stats_from_counts`` still hold)."""
    count = torch.count_nonzero
    passes = [count(a == 0), count(a <= torch.finfo(a.dtype).max), count(a == math.inf)]
    for f in formats:
        if isinstance(f, BlockFormat):
            m, f = _block_scaled(a, f, tensor_amax), f.element
        else:
            m = a
        passes += [count(m <= f.flush_bound), count(m >= f.overflow_bound)]
    return torch.stack(passes)


def _block_scaled(a: Tensor, f: BlockFormat, tensor_amax: Tensor | None) -> Tensor:
    """|x| values ``a`` (fp32, one chunk: a whole number of blocks but for the tensor's tail) times their blocks'
    multipliers. Blocks are consecutive elements in memory order: for a row-major matrix whose rows are a multiple of
    the block (every layer MX and NVFP4 can run), exactly the row blocks the real casts use. Non-finite values are
    reported apart and set no scale."""
    pad = -a.numel() % f.block_size
    blocks = torch.nn.functional.pad(a, (0, pad)).view(-1, f.block_size)
    amax = torch.where(blocks <= torch.finfo(a.dtype).max, blocks, 0.0).amax(-1)
    return (blocks * f.block_multipliers(amax, tensor_amax)[:, None]).view(-1)[: a.numel()]


def _elementwise(fmt: FormatLike, caller: str) -> NumberFormat:
    f = get_format(fmt)
    if isinstance(f, BlockFormat):
        raise ValueError(f"`{caller}` takes one scale per tensor; {f.name} scales each block of {f.block_size} itself."
                         f" Use `underflow_stats(x, {f.name!r})`.")
    return f


def _tensor_amax(flat: Tensor, formats: Sequence[AnyFormat]) -> Tensor | None:
    """The largest finite magnitude of the tensor, when a format has a per-tensor scale (NVFP4): one more pass."""
    if not any(isinstance(f, BlockFormat) and f.tensor_scale for f in formats):
        return None
    return _finite_amax(flat)


def _finite_amax(flat: Tensor) -> Tensor:
    """The largest finite magnitude of a flat tensor, in chunks (0 for an empty or all-non-finite one)."""
    amax = torch.zeros((), device=flat.device)
    for chunk in _chunks(flat):
        a = _magnitudes(chunk)
        amax = torch.maximum(amax, torch.where(a <= torch.finfo(a.dtype).max, a, 0.0).amax().float())
    return amax


def _stats_from_counts(numel: Tensor, counts: Tensor, n_formats: int) -> list[CastStats]:
    zeros, finite, inf = counts[0], counts[1], counts[2]
    nonfinite = numel - finite
    out = []
    for i in range(n_formats):
        under, over = counts[3 + 2 * i], counts[4 + 2 * i]
        # at most the flush bound: zeros too (subtracted); at least the overflow bound: inf too (subtracted).
        out.append(CastStats(numel=numel, exact_zero=zeros, underflow=under - zeros, overflow=over - inf,
                             nonfinite=nonfinite))
    return out


def _histogram_add(hist: Tensor | None, a: Tensor) -> Tensor:
    """Add the exponent histogram of |x| values ``a`` to ``hist``. frexp's exponent e gives floor(log2) = e - 1 for
    every finite non-zero fp32 value, subnormals included; zero, inf and nan get e = 0 and land in the bin of [0.5, 1),
    from which ``_histogram_finish`` removes them."""
    # fp64 stays fp64: in fp32 its values below 2**-149 would flush to 0 (and land in [0.5, 1)) or overflow to inf.
    _, exponent = torch.frexp(a if a.dtype == torch.float64 else a.float())
    counts = torch.bincount(exponent.add_(-1 - HIST_MIN).clamp_(0, HIST_MAX - HIST_MIN - 1),
                            minlength=HIST_MAX - HIST_MIN)
    return counts if hist is None else hist + counts


def _histogram_finish(hist: Tensor, not_counted: Tensor) -> Tensor:
    hist = hist.clone()
    hist[-1 - HIST_MIN] -= not_counted
    return hist


# ---- One pass per chunk: every count and the exponent histogram from one bincount ----------------------------------
# The int32 bits of a non-negative fp32 value are ordered as the values are, so "how many |x| meet a bound" is "how
# many bit patterns lie below some X". A non-decreasing key of the bits that steps up at every such X (every power of
# two, for the histogram, and every format's bound) turns one bincount into all of them:
# count(bits < X) = cumsum(hist)[key(X)].
# Each bound's X is found by evaluating the very comparison the counts are defined by (``|x| * scale <= bound`` in the
# magnitudes' dtype, the bound a Python float) on the bit patterns around it, so the counts are those comparisons'.

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


def single_pass(flat: Tensor, questions: Sequence[tuple[Sequence[AnyFormat], float | Tensor | None]]
                ) -> tuple[list[Tensor], Tensor]:
    """For a flat bf16, fp16 or fp32 tensor: for each (formats, scale) asked, ``_counts``'s row of |x| * scale (int64
    [3 + 2n]); and the exponent histogram of |x|. One key and one bincount per chunk, whatever the questions."""
    bounds, plan, query_keys = _plan_for(questions, flat.device)
    # Chunks of a fortieth of the tensor (four int32 buffers: a tenth of an fp32 tensor), between PASS_CHUNK and CHUNK
    step = min(CHUNK, max(PASS_CHUNK, flat.numel() // 40))
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


def in_one_pass(flat: Tensor, formats: Sequence[AnyFormat]) -> bool:
    """Whether ``single_pass`` measures it: bf16, fp16 or fp32 values, formats with one scale per tensor."""
    return flat.dtype in (torch.float32, torch.bfloat16, torch.float16) and flat.numel() > 0 and \
        all(isinstance(f, NumberFormat) for f in formats)


def cast_stats(tensor: Tensor, fmt: FormatLike, scale: float | Tensor = 1.0) -> CastStats:
    """Counts for one tensor: what casting ``tensor * scale`` to ``fmt`` flushes to zero or overflows.

    Example:
        fp16 flushes 2**-26 but rounds 3e-8 (above 2**-25) up to 2**-24; a loss scale saves the small value.

        >>> x = torch.tensor([2.0**-26, 3e-8, 0.0, 70000.0])
        >>> s = cast_stats(x, "fp16")
        >>> s.underflow.item(), s.exact_zero.item(), s.overflow.item()
        (1, 1, 1)
        >>> cast_stats(x, "fp16", scale=1024.0).underflow.item()
        0
    """
    f = get_format(fmt)
    return multi_format_stats(tensor, (f,), scale)[f.name]


def multi_format_stats(
    tensor: Tensor, formats: Iterable[FormatLike], scale: float | Tensor = 1.0,
    tensor_amax: Tensor | None = None,
) -> dict[str, CastStats]:
    """``cast_stats`` for several formats at once: one compare-and-count pass per count over each chunk, temporaries
    bounded by the chunk (see ``CHUNK``), nothing read from the device. ``tensor_amax`` sets NVFP4's tensor scale when
    ``tensor`` is a sample of a larger tensor (by default, its own largest finite magnitude).

    Example:
        >>> stats = multi_format_stats(torch.tensor([1e-6, 1e-30, 1e5]), ["fp16", "bf16", "e4m3fn"])
        >>> {name: (s.underflow.item(), s.overflow.item()) for name, s in stats.items()}
        {'fp16': (1, 1), 'bf16': (0, 0), 'e4m3fn': (2, 1)}
    """
    fmts = [get_format(f) for f in formats]
    flat = measurable_values(tensor)
    numel = torch.zeros((), dtype=torch.int64, device=flat.device) + flat.numel()
    if in_one_pass(flat, fmts):
        row = single_pass(flat, [(fmts, scale)])[0][0]
        return {f.name: s for f, s in zip(fmts, _stats_from_counts(numel, row, len(fmts)), strict=True)}
    if tensor_amax is None:
        tensor_amax = _tensor_amax(flat, fmts)
    if tensor_amax is not None and (isinstance(scale, Tensor) or scale != 1.0):
        tensor_amax = tensor_amax * scale
    total = None
    for chunk in _chunks(flat):
        a = _magnitudes(chunk)
        if isinstance(scale, Tensor) or scale != 1.0:
            a = a.mul_(scale)  # a tensor scale stays on the device
        counts = _counts(a, fmts, tensor_amax)
        total = counts if total is None else total + counts
    if total is None:
        total = torch.zeros(3 + 2 * len(fmts), dtype=torch.int64, device=flat.device)
    return {f.name: s for f, s in zip(fmts, _stats_from_counts(numel, total, len(fmts)), strict=True)}


def multi_scale_stats(tensor: Tensor, fmt: FormatLike, scales: Sequence[float | Tensor]) -> list[CastStats]:
    """``cast_stats`` of one tensor at several scales (per-element scale tensors allowed): |x| and the counts of zeros
    and of non-finite values are computed once, then two compare-and-count passes per scale.

    Example:
        (underflow, overflow) at three loss scales; 2**8 saves 2**-30 and 2**16 overflows 1.0.

        >>> x = torch.tensor([2.0**-30, 2.0**-20, 1.0])
        >>> [(s.underflow.item(), s.overflow.item()) for s in multi_scale_stats(x, "fp16", [1.0, 2.0**8, 2.0**16])]
        [(1, 0), (0, 0), (0, 1)]
    """
    f = _elementwise(fmt, "multi_scale_stats")
    flat = measurable_values(tensor)
    shared = per_scale = None
    for start in range(0, flat.numel(), CHUNK):
        a = _magnitudes(flat[start : start + CHUNK])
        count = torch.count_nonzero
        common = _counts(a, ())  # zeros, finite, inf: once per chunk, whatever the number of scales
        rows = []
        for scale in scales:
            if isinstance(scale, Tensor) and scale.numel() == flat.numel():
                scale = scale[start : start + CHUNK]
            m = a * scale
            rows.append(torch.stack([count(m <= f.flush_bound), count(m >= f.overflow_bound)]))
        shared = common if shared is None else shared + common
        per_scale = torch.stack(rows) if per_scale is None else per_scale + torch.stack(rows)
    numel = torch.zeros((), dtype=torch.int64, device=flat.device) + flat.numel()
    if shared is None or per_scale is None:
        shared = torch.zeros(3, dtype=torch.int64, device=flat.device)
        per_scale = torch.zeros(len(scales), 2, dtype=torch.int64, device=flat.device)
    # a scaled zero stays zero and inf stays inf; a finite value scaled to inf counts as overflow, as in _counts.
    return [_stats_from_counts(numel, torch.cat([shared, row]), 1)[0] for row in per_scale]


# How fp8 training scales a tensor before its cast, by the scale's reach: one scale per tensor (torchao tensorwise,
# Transformer Engine's per-tensor recipes), per row of the last dim (torchao rowwise), per block of 32 (MXFP8).
DYNAMIC_SCALINGS = ("tensorwise", "rowwise", "mxfp8")


def dynamic_scale_stats(
    tensor: Tensor, formats: Iterable[FormatLike], scaling: str = "tensorwise", pow2: bool = False
) -> dict[str, CastStats]:
    """What casting ``tensor`` to each fp8 format flushes or overflows when it is first scaled as fp8 training scales
    it: the largest finite magnitude (of the tensor, of each row of its last dim, or of each block of 32 consecutive
    values, by ``scaling``: ``"tensorwise"``, ``"rowwise"`` or ``"mxfp8"``) lands on the format's max. The scale is
    torchao's (fp64 then fp32, rounded down to a power of two when ``pow2``, as its rowwise recipes do); MXFP8's is the
    block's e8m0 scale, rounded up (``"rceil"``). A finite value never overflows at such a scale; what flushes is what
    the real cast loses: small values beside the tensor's (row's, block's) largest. Counted in chunks, as
    ``multi_format_stats``; a tensor that is not dense and real is scaled as a whole for ``"rowwise"``.

    Example:
        Unscaled, e4m3fn flushes both small values; scaled so that 1.0 lands on 448, it keeps 1e-4 and still flushes
        1e-6 (below 2**-10 even times 448: past e4m3fn's range under the largest value).

        >>> x = torch.tensor([1e-6, 1e-4, 1.0])
        >>> multi_format_stats(x, ["e4m3fn"])["e4m3fn"].underflow.item()
        2
        >>> dynamic_scale_stats(x, ["e4m3fn"])["e4m3fn"].underflow.item()
        1
    """
    fmts = [_elementwise(f, "dynamic_scale_stats") for f in formats]
    if scaling not in DYNAMIC_SCALINGS:
        raise ValueError(f"`dynamic_scale_stats(scaling={scaling!r})`: one of {DYNAMIC_SCALINGS}.")
    if scaling == "mxfp8":
        blocks = [BlockFormat(f.name, f, 32, "e8m0", "rceil") for f in fmts]
        return multi_format_stats(tensor, blocks)
    x = tensor.detach()
    if scaling == "rowwise" and x.layout == torch.strided and not x.is_complex() and x.dim() > 1 and x.shape[-1]:
        rows = x.reshape(-1, x.shape[-1])
        step = max(1, CHUNK // rows.shape[1])  # whole rows per pass, each with its own scale
        chunks: Iterable[Tensor] = (rows[i : i + step] for i in range(0, rows.shape[0], step))
        amax, n = None, rows.numel()
    else:
        flat = measurable_values(x)
        chunks, amax, n = _chunks(flat), _finite_amax(flat), flat.numel()  # one scale for the tensor: its amax first
    total = None
    for chunk in chunks:
        a = _magnitudes(chunk)
        if chunk.dim() > 1:  # rowwise
            amax = torch.where(a <= torch.finfo(a.dtype).max, a, 0.0).amax(dim=-1, keepdim=True)
        # zeros, finite and inf once (a scaled zero stays zero, inf stays inf), then each format at its own scale
        assert amax is not None  # the tensor's, or this chunk's rows'
        parts = [_counts(a, ())] + [_counts((a * torchao_scale(amax, f.max, pow2)).view(-1), (f,))[3:] for f in fmts]
        total = torch.cat(parts) if total is None else total + torch.cat(parts)
    numel = torch.zeros((), dtype=torch.int64, device=x.device) + n
    if total is None:  # an empty tensor
        total = torch.zeros(3 + 2 * len(fmts), dtype=torch.int64, device=x.device)
    return {f.name: st for f, st in zip(fmts, _stats_from_counts(numel, total, len(fmts)), strict=True)}


def gradient_stats(
    tensor: Tensor, formats: Sequence[FormatLike], scale: float | Tensor | None = None
) -> tuple[dict[str, CastStats], CastStats | None, Tensor]:
    """Everything the monitor measures on one gradient, in one sweep of its chunks: the unscaled counts per format, the
    fp16 counts of ``tensor * scale`` when a scale is given, and the exponent histogram of the unscaled values.

    Example:
        >>> g = torch.tensor([2.0**-26, 2.0**-10, 1.0])
        >>> per_format, scaled, hist = gradient_stats(g, ["fp16", "bf16"], scale=1024.0)
        >>> {name: s.underflow.item() for name, s in per_format.items()}, scaled.underflow.item()
        ({'fp16': 1, 'bf16': 0}, 0)
        >>> (hist.nonzero().flatten() + HIST_MIN).tolist()  # floor(log2|g|) of each value
        [-26, -10, 0]
    """
    fmts = [get_format(f) for f in formats]
    flat = measurable_values(tensor)
    device = flat.device
    numel = torch.zeros((), dtype=torch.int64, device=device) + flat.numel()
    if in_one_pass(flat, fmts):
        fp16 = FORMATS["fp16"]
        questions: list[tuple[Sequence[AnyFormat], float | Tensor | None]] = [(fmts, None)]
        rows, histogram = single_pass(flat, questions + ([([fp16], scale)] if scale is not None else []))
        per_format = {f.name: s for f, s in zip(fmts, _stats_from_counts(numel, rows[0], len(fmts)), strict=True)}
        return per_format, _stats_from_counts(numel, rows[1], 1)[0] if scale is not None else None, histogram
    tensor_amax = _tensor_amax(flat, fmts)
    total = scaled_total = hist = None
    for chunk in _chunks(flat):
        a = _magnitudes(chunk)
        counts = _counts(a, fmts, tensor_amax)
        total = counts if total is None else total + counts
        hist = _histogram_add(hist, a)
        if scale is not None:
            scaled = _counts(a.mul_(scale), (FORMATS["fp16"],))
            scaled_total = scaled if scaled_total is None else scaled_total + scaled
    if total is None or hist is None:  # an empty tensor
        total = torch.zeros(3 + 2 * len(fmts), dtype=torch.int64, device=device)
        hist = torch.zeros(HIST_MAX - HIST_MIN, dtype=torch.int64, device=device)
    per_format = {f.name: s for f, s in zip(fmts, _stats_from_counts(numel, total, len(fmts)), strict=True)}
    scaled_stats = _stats_from_counts(numel, scaled_total, 1)[0] if scaled_total is not None else None
    first = next(iter(per_format.values()))
    return per_format, scaled_stats, _histogram_finish(hist, first.exact_zero + first.nonfinite)


def underflow_stats(tensors: TensorsLike, fmt: FormatLike, scale: float | Tensor = 1.0) -> UnderflowReport:
    """Per tensor and in total: how many values of ``tensors * scale`` the cast to ``fmt`` flushes to zero or overflows.

    Underflow is decided by the real cast (``(x != 0) & (cast(x * scale) == 0)``), not a ``|x| < 2**-24`` threshold,
    which double-counts: fp16 rounds (2**-25, 2**-24) up to 2**-24. Exact zeros are reported apart.

    Args:
        tensors: a tensor, an iterable of tensors, or a mapping name -> tensor (e.g. parameter gradients).
        fmt: ``"fp16"``, ``"bf16"``, ``"e4m3fn"``, ``"e5m2"``, ``"tf32"``, ``"fp32"``, a dtype or a ``NumberFormat``;
            or a block-scaled format (``"mxfp8"``, ``"mxfp8_floor"``, ``"nvfp4"``), each block of consecutive elements
            cast at its own scale (NVFP4's tensor scale from the tensor's own largest finite magnitude).
        scale: multiplied in before the cast, e.g. the loss scale, to ask "would ``g * S`` flush?".

    Returns:
        An ``UnderflowReport``; counts are tensors on the device (read them when you log).

    Example:
        e4m3fn keeps 1e-3 (and saturates 1000); MXFP8 scales each block of 32 by its largest value, so the 31
        small values beside the outlier flush while the next block, all 1e-3, keeps them.

        >>> x = torch.full((64,), 1e-3)
        >>> x[0] = 1000.0
        >>> report = underflow_stats(x, "e4m3fn")
        >>> report.total.underflow.item(), report.total.overflow.item()
        (0, 1)
        >>> underflow_stats(x, "mxfp8").total.underflow.item()
        31
    """
    if not isinstance(scale, Tensor) and not scale > 0:
        raise ValueError(f"`underflow_stats(scale={scale!r})`: the scale must be > 0 (a loss scale, 1.0 for none).")
    f = get_format(fmt)
    report = UnderflowReport(format=f, scale=scale)
    for name, tensor in _named(tensors).items():
        stats = cast_stats(tensor, f, scale)
        report.per_tensor[name] = stats
        report.total = stats if report.total is None else report.total + stats
    if report.total is None:
        zero = torch.zeros((), dtype=torch.int64)
        report.total = CastStats(zero, zero, zero, zero, zero)
    return report


def exponent_histogram(tensors: TensorsLike, scale: float | Tensor = 1.0) -> Tensor:
    """Counts of non-zero finite values by ``floor(log2|x * scale|)``, bins ``HIST_MIN .. HIST_MAX - 1`` (on device),
    computed chunk by chunk (bounded memory, no host read).

    Example:
        The bin of 2**e holds [2**e, 2**(e+1)); zeros are not counted.

        >>> hist = exponent_histogram(torch.tensor([0.0, 0.75, 1.0, 3.0, 2.0**-30]))
        >>> {e: n for e, n in zip(range(HIST_MIN, HIST_MAX), hist.tolist()) if n}
        {-30: 1, -1: 1, 0: 1, 1: 1}
    """
    hist = not_counted = None
    for tensor in _named(tensors).values():
        flat = measurable_values(tensor)
        if not isinstance(scale, Tensor) and scale == 1.0 and in_one_pass(flat, ()):
            h = single_pass(flat, [((), None)])[1]
            hist = h if hist is None else hist + h
            zero = torch.zeros((), dtype=torch.int64, device=flat.device)
            not_counted = zero if not_counted is None else not_counted
            continue
        for chunk in _chunks(flat):
            a = _magnitudes(chunk)  # as gradient_stats sees them: fp64 stays fp64
            if isinstance(scale, Tensor) or scale != 1.0:
                a = a.mul_(scale)
            hist = _histogram_add(hist, a)
            skip = torch.count_nonzero(a == 0) + a.numel() - torch.count_nonzero(a <= torch.finfo(a.dtype).max)
            not_counted = skip if not_counted is None else not_counted + skip
    if hist is None or not_counted is None:
        return torch.zeros(HIST_MAX - HIST_MIN, dtype=torch.int64)
    return _histogram_finish(hist, not_counted)


class LossScaleAdvice(NamedTuple):
    """What ``recommend_loss_scale`` advises; a tuple, so ``scale, underflow, overflow = ...`` still works.

    - ``scale``: the loss scale to use, a power of two (1.0 when the histogram is empty).
    - ``underflow``: the fraction of the histogrammed values that still flush to zero in the format at ``scale``.
    - ``overflow``: the fraction that overflows at ``scale``; always 0 (no scale is advised that overflows a value
      seen).

    Example:
        >>> scale, underflow, overflow = recommend_loss_scale(exponent_histogram(torch.tensor([2.0**-40, 2.0**-10])))
        >>> scale, underflow, overflow
        (32768.0, 0.0, 0.0)
    """

    scale: float
    underflow: float
    overflow: float


def recommend_loss_scale(
    histogram: Tensor, target_underflow: float = 1e-3, fmt: FormatLike = "fp16", max_log2_scale: int = 24
) -> LossScaleAdvice:
    """The smallest power-of-two loss scale under which at most ``target_underflow`` of the histogrammed (unscaled)
    values flush in ``fmt`` and none can overflow.

    A bin ``[2**e, 2**(e+1))`` scaled by ``2**k`` is certainly below ``max`` only if ``e + k < max_exponent`` (the bin
    ``e + k = max_exponent`` reaches ``2**(max_exponent + 1)``, beyond ``max``), so scales are tried from
    ``2**-max_log2_scale`` up to the largest safe one. Returns a ``LossScaleAdvice(scale, underflow, overflow)``; the
    overflow is always 0. If no scale in the window reaches the target, the largest safe one (least underflow); if even
    ``2**-max_log2_scale`` could overflow, the largest safe scale below it: a scale is never recommended that overflows
    what was seen. ``target_underflow`` is a fraction in [0, 1]; ``max_log2_scale`` an int in [0, 126] (the loss
    scaler's bounds; above 24, pass the scaler a larger ``max_scale`` to use the advice).

    Example:
        2**15 lifts 2**-40 into fp16's range; with 2**14 also seen, no scale above 1 is safe.

        >>> recommend_loss_scale(exponent_histogram(torch.tensor([2.0**-40, 2.0**-10])))
        LossScaleAdvice(scale=32768.0, underflow=0.0, overflow=0.0)
        >>> recommend_loss_scale(exponent_histogram(torch.tensor([2.0**-40, 2.0**14])))
        LossScaleAdvice(scale=1.0, underflow=0.5, overflow=0.0)
    """
    f = _elementwise(fmt, "recommend_loss_scale")
    if isinstance(target_underflow, bool) or not isinstance(target_underflow, (int, float)) \
            or not 0 <= target_underflow <= 1:
        raise ValueError(f"`recommend_loss_scale(target_underflow={target_underflow!r})`: the fraction of values"
                         " allowed to flush, a number in [0, 1], e.g. 1e-3 (the default).")
    if isinstance(max_log2_scale, bool) or not isinstance(max_log2_scale, int) \
            or not 0 <= max_log2_scale <= MAX_LOG2_SCALE:
        raise ValueError(f"`recommend_loss_scale(max_log2_scale={max_log2_scale!r})`: scales from 2**-k to 2**k are"
                         f" tried, and the loss scaler accepts scales within 2**-{MAX_LOG2_SCALE} .."
                         f" 2**{MAX_LOG2_SCALE}: pass an int k in [0, {MAX_LOG2_SCALE}], e.g. 24 (the default, the"
                         " scaler's default bounds).")
    hist = histogram.detach().double().cpu()
    total = hist.sum().item()
    if total == 0:
        return LossScaleAdvice(1.0, 0.0, 0.0)
    exponents = torch.arange(HIST_MIN, HIST_MAX, dtype=torch.float64)
    top = int(exponents[hist > 0].max().item())
    safe = f.max_exponent - 1 - top
    candidates = range(-max_log2_scale, min(max_log2_scale, safe) + 1) if safe >= -max_log2_scale else [safe]
    under = 1.0
    for k in candidates:
        # Round-to-nearest flushes only below half the smallest subnormal: the bin [2**(m-1), 2**m) rounds up to
        # 2**m (all but its lower edge), so bins e < m - 1 flush.
        under = hist[exponents + k < f.min_exponent - 1].sum().item() / total
        if under <= target_underflow:
            return LossScaleAdvice(2.0**k, under, 0.0)
    return LossScaleAdvice(2.0 ** candidates[-1], under, 0.0)


def roll_amax_history(history: Tensor, algo: str = "max") -> tuple[Tensor, Tensor]:
    """Transformer Engine's delayed-scaling update: the amax to scale with, then the history rolled for the next step.

    ``history[0]`` holds the step just finished. The amax is the max over the window (``"max"``) or that row alone
    (``"most_recent"``); then the history rolls up by one and row 0 is cleared for the next step, so the window always
    holds the last ``len(history)`` steps. Works on any trailing shape; stays on the device. The history needs at least
    one row.

    Example:
        >>> history = torch.tensor([[3.0], [5.0], [2.0]])
        >>> rolled, amax = roll_amax_history(history)
        >>> amax.tolist(), rolled.flatten().tolist()
        ([5.0], [0.0, 2.0, 3.0])
        >>> roll_amax_history(history, "most_recent")[1].tolist()
        [3.0]
    """
    if history.dim() == 0 or history.shape[0] == 0:
        raise ValueError(f"`roll_amax_history(history of shape {tuple(history.shape)})`: the history needs at least one"
                         " row (dim 0 is the window of steps, amax_history_len >= 1), e.g. torch.zeros(16, n).")
    if algo == "max":
        amax = history.amax(dim=0)
    elif algo == "most_recent":
        amax = history[0].clone()
    else:
        raise ValueError(f"`amax_compute_algo={algo!r}`: use 'max' or 'most_recent' (Transformer Engine's names).")
    rolled = history.roll(-1, dims=0)
    rolled[0] = 0
    return rolled, amax


def delayed_scale(amax: Tensor, fp8_max: float | Tensor, margin: int = 0, previous: Tensor | None = None) -> Tensor:
    """``(fp8_max / amax) / 2**margin``, as Transformer Engine computes it; where amax is 0 (nothing seen, or all
    zeros) or the scale would not be finite, the previous scale is kept (1.0 if none). Five small ops, no host read.
    ``margin`` is a finite number >= 0 (a negative one would scale past ``fp8_max`` and saturate the amax itself).

    Example:
        >>> delayed_scale(torch.tensor([448.0, 14.0, 0.0]), 448.0).tolist()
        [1.0, 32.0, 1.0]
        >>> delayed_scale(torch.tensor([14.0, 0.0]), 448.0, margin=1, previous=torch.tensor([4.0, 4.0])).tolist()
        [16.0, 4.0]
    """
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < math.inf:
        raise ValueError(f"`delayed_scale(margin={margin!r})`: the headroom below fp8_max in powers of two, a finite"
                         " number >= 0 (Transformer Engine's `margin`), e.g. 0 (the default).")
    scale = (fp8_max / 2.0**margin) / amax
    keep = previous if previous is not None else torch.ones_like(scale)
    return torch.where((amax > 0) & torch.isfinite(scale), scale, keep)
