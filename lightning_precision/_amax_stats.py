"""The what-if statistics of AmaxHistoryLogger over all layers at once: one sample per tensor kind, shared among the
layers in proportion to their sizes, measured in one pass (every layer at its own scale, each block-scaled format's
blocks within a layer); ``what_if`` gives the logged fractions."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_precision._blocks import block_scaled
from lightning_precision.formats import BlockFormat, NumberFormat, get_format
from lightning_precision.fp8._selection import HYBRID_FORMAT, TENSORS
from lightning_precision.functional import CastStats, measurable_values, multi_format_stats, multi_scale_stats

__all__ = ["CHUNK", "RUN", "block_sample", "pooled_stats", "shared_sample", "what_if"]

# A multiple of every block format's block size (MXFP8 32, NVFP4 16): runs of the sample start on block boundaries and
# each layer's part of the pooled sample is padded to it, so no block spans two layers.
RUN = 32


def block_sample(t: Tensor, limit: int | None, block: int = 1024) -> Tensor:
    """At most ``limit`` elements of ``t``: evenly spaced contiguous runs of ``block`` elements, copied into one
    contiguous tensor (deterministic). Whole runs keep cache lines and vector units full: an element-wise strided view
    of the same size was 45x slower to measure on a CPU."""
    flat = measurable_values(t)
    n = flat.numel()
    if limit is None or n <= limit:
        return flat
    block = max(1, min(block, limit))
    count = max(1, limit // block)
    step = max(block, (n - block) // max(count - 1, 1))
    step -= step % RUN  # runs start on MXFP8/NVFP4 block boundaries, so the block what-if sees real blocks
    return flat.unfold(0, block, step)[:count].reshape(-1)


def shared_sample(tensors: Sequence[Tensor], numels: Sequence[int], limit: int | None) -> list[Tensor]:
    """Flat samples of several tensors (one tensor kind of every layer), at most about ``limit`` elements together:
    every element when they all fit, else each tensor's share in proportion to its size ``numels`` (a whole number of
    runs of ``RUN``, at least one), taken as evenly spaced runs (``block_sample``). Deterministic: no random draw.
    ``numels`` are the tensors' real sizes (a tensor may already be a sample of a larger one)."""
    flats = [measurable_values(t) for t in tensors]
    total = sum(numels)
    if limit is None or total <= limit:
        return flats
    return [block_sample(flat, max(RUN, limit * n // total // RUN * RUN), block=RUN)
            for flat, n in zip(flats, numels, strict=True)]


def _block_counts(a: Tensor, f: BlockFormat, tensor_amax: Tensor | None) -> list[Tensor]:
    """[at most the flush bound, at least the overflow bound] of |x| values ``a`` (a whole number of blocks) times
    their blocks' multipliers; ``tensor_amax`` per block (NVFP4's tensor scale of the layer the block belongs to)."""
    m = block_scaled(a, f, tensor_amax)
    return [torch.count_nonzero(m <= f.element.flush_bound), torch.count_nonzero(m >= f.element.overflow_bound)]


# Elements measured at a time: bounds the temporaries when every element is measured (``what_if_sample=None``).
CHUNK = 2**20  # a multiple of RUN


def pooled_stats(parts: Sequence[Tensor], fmt: str, scales: Sequence[Tensor], block_formats: Sequence[BlockFormat],
                 tensor_amax: Tensor) -> dict[str, CastStats] | None:
    """Cast statistics of the flat ``parts`` (one per layer) together: in ``fmt`` at each of ``scales`` (one value per
    part: every part at its layer's scale), keyed ``"0"``, ``"1"``, ...; and in each block format (each part's blocks
    at their own scales, NVFP4's tensor scale from the part's ``tensor_amax``), keyed by its name. The counts equal
    the sums of the per-part ``multi_scale_stats`` and ``multi_format_stats``: |x|, zeros and non-finite values are
    counted once for all. None where one pass cannot hold them (float64 parts, whose casts the pooled fp32 pass would
    round differently): measure per part then."""
    if any(p.dtype == torch.float64 for p in parts):
        return None
    f = get_format(fmt)
    assert isinstance(f, NumberFormat), fmt  # one scale per element: e4m3fn or e5m2
    align = RUN if block_formats else 1
    sizes = [p.numel() + (-p.numel() % align) for p in parts]
    pad = sum(sizes) - sum(p.numel() for p in parts)
    pool = torch.zeros(sum(sizes), dtype=torch.float32, device=parts[0].device)
    offset = 0
    for p, size in zip(parts, sizes, strict=True):
        pool[offset : offset + p.numel()] = p  # bf16 / fp16 widen to fp32 exactly, as the per-layer measures do
        offset += size
    # one host-to-device copy per logging step (a logging step reads the device anyway)
    lengths = torch.tensor(sizes, device=pool.device)
    per_element = [s.float().repeat_interleave(lengths, output_size=pool.numel()) for s in scales]
    per_block = {b.name: tensor_amax.float().repeat_interleave(torch.div(lengths, b.block_size, rounding_mode="floor"),
                                                               output_size=pool.numel() // b.block_size)
                 for b in block_formats if b.tensor_scale}
    count = torch.count_nonzero
    total: Tensor | None = None
    for start in range(0, pool.numel(), CHUNK):
        end = min(start + CHUNK, pool.numel())
        a = pool[start:end].abs()
        passes = [count(a == 0), count(a <= torch.finfo(a.dtype).max), count(a == math.inf)]
        for s in per_element:
            m = a * s[start:end]
            passes += [count(m <= f.flush_bound), count(m >= f.overflow_bound)]
        for b in block_formats:
            tamax = per_block[b.name][start // b.block_size : end // b.block_size] if b.name in per_block else None
            passes += _block_counts(a, b, tamax)
        counts = torch.stack(passes)
        total = counts if total is None else total + counts
    assert total is not None  # a pool holds at least one run
    numel = torch.zeros((), dtype=torch.int64, device=pool.device) + pool.numel()
    zeros, finite, inf = total[0], total[1], total[2]
    out = {}
    for j, name in enumerate([str(j) for j in range(len(scales))] + [b.name for b in block_formats]):
        under, over = total[3 + 2 * j], total[4 + 2 * j]
        # at most the flush bound: zeros too (subtracted); at least the overflow bound: inf too (subtracted). The
        # padding counts only as elements and zeros: it cancels out of the underflow and non-finite counts.
        out[name] = CastStats(numel - pad, zeros - pad, under - zeros, over - inf, numel - finite)
    return out


def what_if(capture: Sequence[dict[str, tuple[Tensor, int]]], current: Tensor, delayed: Tensor, jit: Tensor,
            block_formats: Sequence[str], limit: int | None) -> dict[str, Tensor]:
    """Underflow/overflow fractions of a step's ``capture``d tensors (per layer and tensor kind: the tensor or its
    sample, and its real number of elements) cast with the ``delayed`` scale vs the current one ``jit`` (from the
    step's amax ``current``; each [layers, 3]), and in each of ``block_formats``, keyed
    ``precision/fp8_whatif/<tensor>/<delayed|current|format>/<underflow|overflow>``. Per tensor kind, one sample shared
    by all layers (``shared_sample``: every element when they fit in ``limit``), measured in one pass, each element
    at its layer's scale."""
    blocks = [b for b in (get_format(f) for f in block_formats) if isinstance(b, BlockFormat)]
    out = {}
    for k, tensor in enumerate(TENSORS):
        captured = [(i, c[tensor]) for i, c in enumerate(capture) if tensor in c]
        if not captured:
            continue
        rows = [i for i, _ in captured]
        parts = shared_sample([t for _, (t, _) in captured], [n for _, (_, n) in captured], limit)
        index = torch.tensor(rows, device=current.device)
        pooled = pooled_stats(parts, HYBRID_FORMAT[tensor], [delayed[index, k], jit[index, k]], blocks,
                              current[index, k])
        if pooled is None:  # float64 tensors: per layer
            per_layer = [dict(zip(("delayed", "current"), multi_scale_stats(
                part.float(), HYBRID_FORMAT[tensor], [delayed[i, k], jit[i, k]]), strict=True)) |
                multi_format_stats(part, block_formats, tensor_amax=current[i, k])
                for i, part in zip(rows, parts, strict=True)]
            per_kind = {kind: _sum(layer[kind] for layer in per_layer) for kind in per_layer[0]}
        else:
            per_kind = {"delayed": pooled["0"], "current": pooled["1"]}
            per_kind.update({f: pooled[f] for f in block_formats})
        for kind, stats in per_kind.items():
            out[f"precision/fp8_whatif/{tensor}/{kind}/underflow"] = stats.underflow_fraction
            out[f"precision/fp8_whatif/{tensor}/{kind}/overflow"] = stats.overflow_fraction
    return out


def _sum(stats: Iterable[CastStats]) -> CastStats:
    total, *rest = stats
    for s in rest:
        total = total + s
    return total
