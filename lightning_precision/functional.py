"""Pure functions behind the callbacks: usable from a Trainer, a Fabric loop or plain PyTorch.

Every count is a tensor on the input's device, so callers can accumulate without synchronising and read only when they
log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import Tensor

from lightning_precision.formats import NumberFormat, get_format

TensorsLike = Union[Tensor, Iterable[Tensor], Mapping[str, Tensor]]
FormatLike = Union[str, torch.dtype, NumberFormat]


@dataclass
class CastStats:
    """Counts for one tensor (or a total), as 0-d int64 tensors on the device.

    - ``numel``: elements.
    - ``exact_zero``: zero before any cast (not underflow: e.g. gradients of convolutions on 1x1 maps).
    - ``underflow``: non-zero finite values whose cast (after multiplying by ``scale``) is zero.
    - ``overflow``: finite values whose cast is inf or, for formats without inf (e4m3fn), saturates at ``max``
      with an error beyond rounding (``|x| >= max + ulp(max)/2``).
    - ``nonfinite``: inf or nan already before the cast (counted in nothing else).
    """

    numel: Tensor
    exact_zero: Tensor
    underflow: Tensor
    overflow: Tensor
    nonfinite: Tensor

    def __add__(self, other: CastStats) -> CastStats:
        return CastStats(*(a + b for a, b in zip(self._fields(), other._fields())))

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
    """``underflow_stats``'s answer: the format, the scale applied, counts per tensor and in total."""

    format: NumberFormat
    scale: Union[float, Tensor]
    per_tensor: dict[str, CastStats] = field(default_factory=dict)
    total: CastStats | None = None


def _named(tensors: TensorsLike) -> dict[str, Tensor]:
    if isinstance(tensors, Tensor):
        return {"0": tensors}
    if isinstance(tensors, Mapping):
        return dict(tensors)
    return {str(i): t for i, t in enumerate(tensors)}


def cast_stats(tensor: Tensor, fmt: FormatLike, scale: Union[float, Tensor] = 1.0) -> CastStats:
    """Counts for one tensor: what casting ``tensor * scale`` to ``fmt`` flushes to zero or overflows."""
    f = get_format(fmt)
    return multi_format_stats(tensor, (f,), scale)[f.name]


def multi_format_stats(
    tensor: Tensor, formats: Iterable[FormatLike], scale: Union[float, Tensor] = 1.0
) -> dict[str, CastStats]:
    """``cast_stats`` for several formats at once: the masks shared by all formats are computed once."""
    x = tensor.detach()
    if not x.is_floating_point():
        raise TypeError(f"cast_stats needs a floating-point tensor, got {x.dtype}.")
    x = x.float() if x.element_size() < 4 else x  # the scaled value must not itself round or overflow first
    finite = torch.isfinite(x)
    finite_nonzero = finite & (x != 0)
    scaled = x * scale if isinstance(scale, Tensor) or scale != 1.0 else x  # a tensor scale stays on the device
    numel = torch.zeros((), dtype=torch.int64, device=x.device) + x.numel()
    nonfinite = numel - finite.sum()
    exact_zero = numel - nonfinite - finite_nonzero.sum()
    magnitude = scaled.abs()
    out = {}
    for fmt in formats:
        f = get_format(fmt)
        # The cast's own rounding boundaries (``NumberFormat.flush_bound``/``overflow_bound``): the same answer as
        # comparing ``cast(x)`` with 0 and inf, element for element (tested against the real cast at every boundary),
        # in three passes instead of nine, so the monitor's measuring step stays cheap.
        underflow = (finite_nonzero & (magnitude <= f.flush_bound)).sum()
        overflow = (finite & (magnitude >= f.overflow_bound)).sum()
        out[f.name] = CastStats(numel=numel, exact_zero=exact_zero, underflow=underflow, overflow=overflow, nonfinite=nonfinite)
    return out


def underflow_stats(tensors: TensorsLike, fmt: FormatLike, scale: Union[float, Tensor] = 1.0) -> UnderflowReport:
    """Per tensor and in total: how many values of ``tensors * scale`` the cast to ``fmt`` flushes to zero or overflows.

    Underflow is decided by the real cast (``(x != 0) & (cast(x * scale) == 0)``), not a ``|x| < 2**-24`` threshold,
    which double-counts: fp16 rounds (2**-25, 2**-24) up to 2**-24. Exact zeros are reported apart.

    Args:
        tensors: a tensor, an iterable of tensors, or a mapping name -> tensor (e.g. parameter gradients).
        fmt: ``"fp16"``, ``"bf16"``, ``"e4m3fn"``, ``"e5m2"``, ``"tf32"``, ``"fp32"``, a dtype or a ``NumberFormat``.
        scale: multiplied in before the cast, e.g. the loss scale, to ask "would ``g * S`` flush?".

    Returns:
        An ``UnderflowReport``; counts are tensors on the device (read them when you log).
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


# Exponent histograms: one bin per power of two, log2|x| in [HIST_MIN, HIST_MAX), covering fp32 subnormals to max.
HIST_MIN, HIST_MAX = -150, 129


def exponent_histogram(tensors: TensorsLike, scale: Union[float, Tensor] = 1.0) -> Tensor:
    """Counts of non-zero finite values by ``floor(log2|x * scale|)``, bins ``HIST_MIN .. HIST_MAX - 1`` (on device)."""
    bins = HIST_MAX - HIST_MIN
    hist = None
    for tensor in _named(tensors).values():
        x = tensor.detach().float().flatten()
        x = x * scale if isinstance(scale, Tensor) or scale != 1.0 else x
        # Read fp32 bits instead of taking logs: the exponent field is floor(log2|x|) + 127 for normal values. An fp32
        # subnormal (field 0) is mantissa * 2**-149, and its mantissa, exact as a float, gives floor(log2) the same
        # way. Zeros, inf and nan go to a dump bin. No compaction and no host read: it stays on the device.
        bits = x.view(torch.int32)
        field = (bits >> 23) & 0xFF
        mantissa_field = ((bits & 0x7FFFFF).float().view(torch.int32) >> 23) & 0xFF
        # bin index = exponent - HIST_MIN, with exponent = field - 127 (normal) or mantissa_field - 276 (subnormal)
        index = torch.where(field == 0, mantissa_field - (276 + HIST_MIN), field - (127 + HIST_MIN)).clamp_(0, bins - 1)
        index = index.masked_fill_((field == 0xFF) | (x == 0), bins)
        counts = torch.bincount(index, minlength=bins + 1)[:bins]
        hist = counts if hist is None else hist + counts
    return hist if hist is not None else torch.zeros(bins, dtype=torch.int64)


def recommend_loss_scale(
    histogram: Tensor, target_underflow: float = 1e-3, fmt: FormatLike = "fp16", max_log2_scale: int = 24
) -> tuple[float, float, float]:
    """The smallest power-of-two loss scale under which at most ``target_underflow`` of the histogrammed (unscaled)
    values flush in ``fmt``, with none overflowing.

    Returns ``(scale, underflow_fraction, overflow_fraction)`` at that scale; if no scale reaches the target without
    overflow, the one with the least underflow among those without overflow (or 1.0).
    """
    f = get_format(fmt)
    hist = histogram.detach().double().cpu()
    total = hist.sum().item()
    exponents = torch.arange(HIST_MIN, HIST_MAX, dtype=torch.float64)
    best = None
    for k in range(-max_log2_scale, max_log2_scale + 1):
        scaled = exponents + k
        # Round-to-nearest flushes only below half the smallest subnormal: the bin [2**(m-1), 2**m) rounds up to
        # 2**m (all but its lower edge), so bins e < m - 1 flush. Bins e > max_exponent overflow.
        under = hist[scaled < f.min_exponent - 1].sum().item() / max(total, 1)
        over = hist[scaled > f.max_exponent].sum().item() / max(total, 1)
        if over > 0:
            continue
        if under <= target_underflow:
            return 2.0**k, under, over
        if best is None or under < best[1]:
            best = (2.0**k, under, over)
    return best if best is not None else (1.0, 0.0, 0.0)


def roll_amax_history(history: Tensor, algo: str = "max") -> tuple[Tensor, Tensor]:
    """Transformer Engine's delayed-scaling update: the amax to scale with, then the history rolled for the next step.

    ``history[0]`` holds the step just finished. The amax is the max over the window (``"max"``) or that row alone
    (``"most_recent"``); then the history rolls up by one and row 0 is cleared for the next step, so the window always
    holds the last ``len(history)`` steps. Works on any trailing shape; stays on the device.
    """
    if algo == "max":
        amax = history.amax(dim=0)
    elif algo == "most_recent":
        amax = history[0].clone()
    else:
        raise ValueError(f"`amax_compute_algo={algo!r}`: use 'max' or 'most_recent' (Transformer Engine's names).")
    rolled = history.roll(-1, dims=0)
    rolled[0] = 0
    return rolled, amax


def delayed_scale(amax: Tensor, fp8_max: Union[float, Tensor], margin: int = 0, previous: Optional[Tensor] = None) -> Tensor:
    """``(fp8_max / amax) / 2**margin``, as Transformer Engine computes it; where amax is 0 (nothing seen, or all
    zeros) the previous scale is kept (1.0 if none)."""
    scale = (fp8_max / amax) / 2.0**margin
    keep = previous if previous is not None else torch.ones_like(scale)
    return torch.where((amax > 0) & torch.isfinite(scale), scale, keep)
