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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_precision._cast_counts import (
    CHUNK,
    bound_counts,
    chunks_of,
    finite_amax,
    histogram_add,
    histogram_finish,
    magnitudes,
    tensor_scale_amax,
)
from lightning_precision._channels_last import apply_channels_last, to_channels_last
from lightning_precision._core.scaling.loss_scale import MAX_LOG2_SCALE
from lightning_precision._mfu import choose_peak, mfu, model_flops_per_step
from lightning_precision._single_pass import HIST_MAX, HIST_MIN, in_one_pass, single_pass
from lightning_precision.formats import FORMATS, AnyFormat, BlockFormat, NumberFormat, get_format
from lightning_precision.fp8._selection import select_fp8_layers
from lightning_precision.fp8._sensitivity import fp8_sensitivity, measure_candidates, torchao_scale

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
    "measure_candidates",
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


def _elementwise(fmt: FormatLike, caller: str) -> NumberFormat:
    f = get_format(fmt)
    if isinstance(f, BlockFormat):
        raise ValueError(f"`{caller}` takes one scale per tensor; {f.name} scales each block of {f.block_size} itself."
                         f" Use `underflow_stats(x, {f.name!r})`.")
    return f


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
    if in_one_pass(flat, fmts, scale):
        row = single_pass(flat, [(fmts, scale)], CHUNK)[0][0]
        return {f.name: s for f, s in zip(fmts, _stats_from_counts(numel, row, len(fmts)), strict=True)}
    if tensor_amax is None:
        tensor_amax = tensor_scale_amax(flat, fmts)
    if tensor_amax is not None and (isinstance(scale, Tensor) or scale != 1.0):
        tensor_amax = tensor_amax * scale
    total = None
    for chunk in chunks_of(flat):
        a = magnitudes(chunk)
        if isinstance(scale, Tensor) or scale != 1.0:
            a = a.mul_(scale)  # a tensor scale stays on the device
        counts = bound_counts(a, fmts, tensor_amax)
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
        a = magnitudes(flat[start : start + CHUNK])
        count = torch.count_nonzero
        common = bound_counts(a, ())  # zeros, finite, inf: once per chunk, whatever the number of scales
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
    # a scaled zero stays zero and inf stays inf; a finite value scaled to inf counts as overflow, as in bound_counts.
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
        chunks, amax, n = chunks_of(flat), finite_amax(flat), flat.numel()  # one scale for the tensor: its amax first
    total = None
    for chunk in chunks:
        a = magnitudes(chunk)
        if chunk.dim() > 1:  # rowwise
            amax = torch.where(a <= torch.finfo(a.dtype).max, a, 0.0).amax(dim=-1, keepdim=True)
        # zeros, finite and inf once (a scaled zero stays zero, inf stays inf), then each format at its own scale
        assert amax is not None  # the tensor's, or this chunk's rows'
        parts = [bound_counts(a, ())] + [bound_counts((a * torchao_scale(amax, f.max, pow2)).view(-1), (f,))[3:]
                                          for f in fmts]
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
    if in_one_pass(flat, fmts, scale):
        fp16 = FORMATS["fp16"]
        questions: list[tuple[Sequence[AnyFormat], float | Tensor | None]] = [(fmts, None)]
        rows, histogram = single_pass(flat, questions + ([([fp16], scale)] if scale is not None else []), CHUNK)
        per_format = {f.name: s for f, s in zip(fmts, _stats_from_counts(numel, rows[0], len(fmts)), strict=True)}
        return per_format, _stats_from_counts(numel, rows[1], 1)[0] if scale is not None else None, histogram
    tensor_amax = tensor_scale_amax(flat, fmts)
    total = scaled_total = hist = None
    for chunk in chunks_of(flat):
        a = magnitudes(chunk)
        counts = bound_counts(a, fmts, tensor_amax)
        total = counts if total is None else total + counts
        hist = histogram_add(hist, a)
        if scale is not None:
            scaled = bound_counts(a.mul_(scale), (FORMATS["fp16"],))
            scaled_total = scaled if scaled_total is None else scaled_total + scaled
    if total is None or hist is None:  # an empty tensor
        total = torch.zeros(3 + 2 * len(fmts), dtype=torch.int64, device=device)
        hist = torch.zeros(HIST_MAX - HIST_MIN, dtype=torch.int64, device=device)
    per_format = {f.name: s for f, s in zip(fmts, _stats_from_counts(numel, total, len(fmts)), strict=True)}
    scaled_stats = _stats_from_counts(numel, scaled_total, 1)[0] if scaled_total is not None else None
    first = next(iter(per_format.values()))
    return per_format, scaled_stats, histogram_finish(hist, first.exact_zero + first.nonfinite)


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
            h = single_pass(flat, [((), None)], CHUNK)[1]
            hist = h if hist is None else hist + h
            zero = torch.zeros((), dtype=torch.int64, device=flat.device)
            not_counted = zero if not_counted is None else not_counted
            continue
        for chunk in chunks_of(flat):
            a = magnitudes(chunk)  # as gradient_stats sees them: fp64 stays fp64
            if isinstance(scale, Tensor) or scale != 1.0:
                a = a.mul_(scale)
            hist = histogram_add(hist, a)
            skip = torch.count_nonzero(a == 0) + a.numel() - torch.count_nonzero(a <= torch.finfo(a.dtype).max)
            not_counted = skip if not_counted is None else not_counted + skip
    if hist is None or not_counted is None:
        return torch.zeros(HIST_MAX - HIST_MIN, dtype=torch.int64)
    return histogram_finish(hist, not_counted)


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
