"""The compare-and-count passes beneath ``functional``'s cast statistics: a tensor's magnitudes chunk by chunk, their
counts against each format's bounds, the largest finite magnitude, and the exponent histogram. Every count is a tensor
on the input's device: nothing is read from it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_precision._blocks import block_scaled
from lightning_precision._single_pass import HIST_MAX, HIST_MIN
from lightning_precision.formats import AnyFormat, BlockFormat

__all__ = ["CHUNK", "bound_counts", "chunks_of", "finite_amax", "histogram_add", "histogram_finish", "magnitudes",
           "tensor_scale_amax"]

# Elements per pass. Every temporary is a few bytes per element of one chunk (about 20 in all), so the extra memory of a
# measurement stays near 20 MB whatever the size of the tensor, and a chunk stays in cache between the passes.
CHUNK = 2**20


def chunks_of(flat: Tensor) -> Iterable[Tensor]:
    """A flat tensor's consecutive pieces of ``CHUNK`` elements (views)."""
    for start in range(0, flat.numel(), CHUNK):
        yield flat[start : start + CHUNK]


def magnitudes(chunk: Tensor) -> Tensor:
    # At least fp32, so that scaling cannot itself round or overflow first.
    return chunk.float().abs() if chunk.element_size() < 4 else chunk.abs()


def bound_counts(a: Tensor, formats: Sequence[AnyFormat], tensor_amax: Tensor | None = None) -> Tensor:
    """For |x| values ``a``: [zeros, finite, inf, then (at most flush bound, at least overflow bound) per format],
    as one int64 tensor on the device. Each count is one compare-and-count pass (the cheapest on CPU and GPU alike).
    A block format compares each element scaled by its block's multiplier with the element format's bounds (a scaled
    zero stays zero and inf stays inf, so the subtractions of ``functional``'s statistics still hold)."""
    count = torch.count_nonzero
    passes = [count(a == 0), count(a <= torch.finfo(a.dtype).max), count(a == math.inf)]
    for f in formats:
        if isinstance(f, BlockFormat):
            m, f = block_scaled(a, f, tensor_amax), f.element
        else:
            m = a
        passes += [count(m <= f.flush_bound), count(m >= f.overflow_bound)]
    return torch.stack(passes)


def tensor_scale_amax(flat: Tensor, formats: Sequence[AnyFormat]) -> Tensor | None:
    """The largest finite magnitude of the tensor, when a format has a per-tensor scale (NVFP4): one more pass."""
    if not any(isinstance(f, BlockFormat) and f.tensor_scale for f in formats):
        return None
    return finite_amax(flat)


def finite_amax(flat: Tensor) -> Tensor:
    """The largest finite magnitude of a flat tensor, in chunks (0 for an empty or all-non-finite one)."""
    amax = torch.zeros((), device=flat.device)
    for chunk in chunks_of(flat):
        a = magnitudes(chunk)
        amax = torch.maximum(amax, torch.where(a <= torch.finfo(a.dtype).max, a, 0.0).amax().float())
    return amax


def histogram_add(hist: Tensor | None, a: Tensor) -> Tensor:
    """Add the exponent histogram of |x| values ``a`` to ``hist``. frexp's exponent e gives floor(log2) = e - 1 for
    every finite non-zero fp32 value, subnormals included; zero, inf and nan get e = 0 and land in the bin of [0.5, 1),
    from which ``histogram_finish`` removes them."""
    # fp64 stays fp64: in fp32 its values below 2**-149 would flush to 0 (and land in [0.5, 1)) or overflow to inf.
    _, exponent = torch.frexp(a if a.dtype == torch.float64 else a.float())
    counts = torch.bincount(exponent.add_(-1 - HIST_MIN).clamp_(0, HIST_MAX - HIST_MIN - 1),
                            minlength=HIST_MAX - HIST_MIN)
    return counts if hist is None else hist + counts


def histogram_finish(hist: Tensor, not_counted: Tensor) -> Tensor:
    """The histogram without the zeros, infs and nans that ``histogram_add`` put in the bin of [0.5, 1)."""
    hist = hist.clone()
    hist[-1 - HIST_MIN] -= not_counted
    return hist
