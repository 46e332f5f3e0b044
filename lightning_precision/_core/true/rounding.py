"""How a value computed in fp32 lands in a 16-bit tensor: plainly (nearest), stochastically, or with a remainder that
keeps what rounding dropped.

Pure functions on plain tensors (a sharded weight's local part), used by the true-precision optimizer step for weights
and for 16-bit optimizer states.

- **nearest**: ``x.to(dtype)``. An update under half an ulp of the weight returns the weight unchanged: at 1.0, bf16's
  ulp is 2**-7, so an AdamW step of 1e-4 never lands (Lightning's ``bf16-true`` stalls).
- **stochastic**: rounds up with probability equal to the distance from the lower neighbour over the gap, so the
  rounded value equals the fp32 value on average and small updates land in proportion. bf16 is the upper half of fp32:
  16 random bits added to the fp32 bit pattern, then truncated (one integer add). fp16 likewise with 13 bits, its
  subnormal range shifted into the binade above it, where fp16's spacing is the same.
- **compensated**: the 16-bit weight plus a 16-bit remainder. bf16: the remainder is the low half of the fp32 bit
  pattern, signed, so weight and remainder give back the fp32 value exactly (the weight is its nearest bf16). fp16: the
  remainder ``x - fp16(x)`` kept in bf16 (fp32's range: fp16 would flush the remainder of a weight under 2**-3 or so),
  about 19 bits of the value instead of fp32's 24.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["UPDATES", "join_remainder", "random_halves", "split_remainder", "stochastic_round"]

UPDATES = ("stochastic", "compensated", "nearest")
_LOW_HALF = 1 << 16
_FP16_DROPPED = 1 << 13  # fp32's mantissa bits below fp16's
_FP16_NORMAL = 2.0**-14  # fp16's smallest normal value


def random_halves(count: int, device: torch.device, generator: torch.Generator) -> Tensor:
    """``count`` uniformly random 16-bit integers (int16): 64-bit draws cut in four, a quarter of the draws (and about a
    quarter of the time) of one draw per element."""
    words = torch.randint(-(2**63), 2**63 - 1, ((count + 3) // 4,), dtype=torch.int64, device=device,
                          generator=generator)
    return words.view(torch.int16)[:count]


def stochastic_round(value: Tensor, dtype: torch.dtype, generator: torch.Generator,
                     out: Tensor | None = None) -> Tensor:
    """``value`` (fp32) rounded to ``dtype`` (bf16 or fp16) stochastically: unbiased, with random bits from
    ``generator`` (into ``out`` when given: one copy fewer). Non-finite values stay non-finite, except a NaN whose
    payload is all ones (CUDA's), which the added bits can carry into the sign: callers keep non-finite values out."""
    if dtype == torch.bfloat16:
        # 16 random bits added below the bf16 part, then cut off: a signed draw s in [-2**15, 2**15), plus 2**15,
        # is uniform in [0, 2**16).
        # (widened first: an int32 + int16 add is not vectorised, and took a fifth of the step)
        bits = random_halves(value.numel(), value.device, generator).view(value.shape).to(torch.int32)
        bits.add_(value.view(torch.int32)).add_(_LOW_HALF >> 1)
        truncated = bits.bitwise_and_(-_LOW_HALF).view(torch.float32)
        return truncated.to(torch.bfloat16) if out is None else out.copy_(truncated)
    # fp16 keeps 10 of fp32's 23 mantissa bits: 13 random bits added, then cut off, as for bf16. Below fp16's smallest
    # normal (2**-14) its spacing is fixed (2**-24): such a value is shifted by 2**-14 (its sign), into [2**-14,
    # 2**-13), whose fp16 spacing is that 2**-24, rounded there and shifted back (both exact). The shift rounds a value
    # under 2**-37 to 2**-14 itself, and so the value to 0: a bias under 2**-37, against fp16's 2**-24.
    shift = value.sign().mul_(value.abs() < _FP16_NORMAL).mul_(_FP16_NORMAL)
    bits = random_halves(value.numel(), value.device, generator).view(value.shape).to(torch.int32)
    bits.bitwise_and_(_FP16_DROPPED - 1).add_((value + shift).view(torch.int32))
    truncated = bits.bitwise_and_(-_FP16_DROPPED).view(torch.float32).sub_(shift)
    return truncated.to(dtype) if out is None else out.copy_(truncated)


def split_remainder(value: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``value`` (fp32) as its nearest ``dtype`` and a 16-bit remainder (int16) such that
    ``join_remainder(weight, remainder)`` gives ``value`` back: exactly for bf16, to about 19 bits for fp16."""
    if dtype == torch.bfloat16:
        bits = value.view(torch.int32)
        # Rounding in bit space: the upper half, rounded half up, so that the signed remainder fits 16 bits.
        high = (bits + (_LOW_HALF >> 1)).bitwise_right_shift_(16)
        low = bits - high.bitwise_left_shift(16)
        return high.to(torch.int16).view(torch.bfloat16), low.to(torch.int16)
    weight = value.to(dtype)
    return weight, (value - weight.float()).to(torch.bfloat16).view(torch.int16)


def join_remainder(weight: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 value a 16-bit ``weight`` and its ``remainder`` (from ``split_remainder``) stand for."""
    if weight.dtype == torch.bfloat16:
        high = weight.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
        return high.add_(remainder.to(torch.int32)).view(torch.float32)
    return weight.float() + remainder.view(torch.bfloat16).float()
