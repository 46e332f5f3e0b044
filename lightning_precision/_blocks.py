"""Magnitudes of a block-scaled cast (MXFP8, NVFP4): each block of |x| times the multiplier its cast applies. One
place for ``functional``'s cast statistics and the amax logger's pooled what-if."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_precision.formats import BlockFormat

__all__ = ["block_scaled"]


def block_scaled(a: Tensor, f: BlockFormat, tensor_amax: Tensor | None) -> Tensor:
    """|x| values ``a`` (fp32, one chunk: a whole number of blocks but for the tensor's tail) times their blocks'
    multipliers. Blocks are consecutive elements in memory order: for a row-major matrix whose rows are a multiple of
    the block (every layer MX and NVFP4 can run), exactly the row blocks the real casts use. Non-finite values are
    reported apart and set no scale."""
    pad = -a.numel() % f.block_size
    blocks = torch.nn.functional.pad(a, (0, pad)).view(-1, f.block_size)
    amax = torch.where(blocks <= torch.finfo(a.dtype).max, blocks, 0.0).amax(-1)
    return (blocks * f.block_multipliers(amax, tensor_amax)[:, None]).view(-1)[: a.numel()]
