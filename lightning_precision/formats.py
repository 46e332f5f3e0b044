"""The number formats mixed precision reasons about, in one table, and the block-scaled formats built on them.

Values come from ``torch.finfo`` where torch has the dtype; tf32 (a tensor-core compute mode, not a storage dtype) and
e2m1 (fp4, which torch stores only packed two to a byte) are derived from their bit layouts. Used by the callbacks, the
docs and the command line.

A block-scaled format (``BLOCK_FORMATS``: MXFP8, NVFP4) casts each block of consecutive elements at its own scale, so
what it flushes or saturates depends on the block's largest value, not on one scale for the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BLOCK_FORMATS", "BlockFormat", "FORMATS", "NumberFormat", "format_table", "get_format"]


@dataclass(frozen=True)
class _Format:
    """What every format has: the ``name`` ``get_format`` finds it by. ``NumberFormat`` adds the bit layout of one
    element, ``BlockFormat`` the element format and the scale its blocks share."""

    name: str


@dataclass(frozen=True)
class NumberFormat(_Format):
    """One floating-point format. ``dtype`` is None for tf32, which only exists inside matmuls.

    Example:
        >>> fp16 = get_format("fp16")
        >>> fp16.bits, fp16.max, fp16.min_exponent, fp16.max_exponent
        (16, 65504.0, -24, 15)
    """

    dtype: torch.dtype | None
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    # fp8 e4m3fn has no inf: values past `max` saturate (torch's cast clamps them to +-max), counted as overflow.
    has_inf: bool = True

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def min_exponent(self) -> int:
        """log2 of the smallest subnormal: below about this, values flush to zero."""
        return round(math.log2(self.smallest_subnormal))  # a power of two (rounded for a format of the user's own)

    @property
    def max_exponent(self) -> int:
        """floor(log2(max)): values at 2**(max_exponent + 1) and above overflow."""
        return math.frexp(self.max)[1] - 1  # max = m * 2**e with m in [0.5, 1): floor(log2(max)) = e - 1, exactly

    @property
    def flush_bound(self) -> float:
        """Round-to-nearest-even sends ``0 < |x| <= flush_bound`` to zero: half the smallest subnormal (the tie at
        exactly half goes to the even neighbour, zero) and nothing above it (fp16 rounds (2**-25, 2**-24) up).

        Example:
            >>> get_format("fp16").flush_bound == 2.0**-25
            True
            >>> (torch.tensor([2.0**-25, 3e-8]).half() == 0).tolist()
            [True, False]
        """
        return self.smallest_subnormal / 2

    @property
    def overflow_bound(self) -> float:
        """``|x| >= overflow_bound`` overflows: ``max`` plus half its ulp. Below it the cast rounds to at most ``max``
        (plain rounding); from it on, an IEEE format rounds to inf (the tie goes away from ``max``, whose mantissa is
        odd) and e4m3fn, which has no inf, saturates at ``max`` with an error beyond rounding.

        Example:
            >>> get_format("fp16").overflow_bound, get_format("e4m3fn").overflow_bound
            (65520.0, 464.0)
            >>> torch.tensor([65519.0, 65520.0]).half().isinf().tolist()
            [False, True]
        """
        return self.max + 2.0 ** (self.max_exponent - self.mantissa_bits) / 2

    def cast(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to this format and back to ``x.dtype`` (the real cast; tf32 is rounded in place).

        Example:
            fp16 flushes 2**-26, rounds 3e-8 up to 2**-24 and overflows; e4m3fn saturates; e2m1 ties to even.

            >>> get_format("fp16").cast(torch.tensor([2.0**-26, 3e-8, 1e5])).tolist()
            [0.0, 5.960464477539063e-08, inf]
            >>> get_format("e4m3fn").cast(torch.tensor([500.0, -1e4])).tolist()
            [448.0, -448.0]
            >>> get_format("e2m1").cast(torch.tensor([0.2, 0.3, 2.5, 5.0, 7.0])).tolist()
            [0.0, 0.5, 2.0, 4.0, 6.0]
        """
        if self.dtype is not None:
            if not self.has_inf:  # saturate: torch's eager cast did not before 2.12 (nan instead), torchao clamps too
                x = x.clamp(-self.max, self.max)
            return x.to(self.dtype).to(x.dtype)
        if self.name != "tf32":
            return _round_saturating(x, self)
        # tf32 keeps fp32's exponent and 10 of its 23 mantissa bits: round to nearest even on the 13 dropped bits.
        bits = x.float().view(torch.int32)
        rounded = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF
        finite = torch.isfinite(x.float())
        return torch.where(finite, rounded.view(torch.float32), x.float()).to(x.dtype)


def _round_saturating(x: torch.Tensor, f: NumberFormat) -> torch.Tensor:
    """Round to nearest even on ``f``'s grid (subnormals included) and saturate at ``f.max``, as casts to formats
    without inf do (torchao clamps before its fp4 cast); nan stays nan."""
    a = x.float().abs().clamp(max=2 * f.max)  # inf saturates like any value past max
    exponent = torch.floor(torch.log2(a)).clamp(min=f.min_exponent + f.mantissa_bits)  # below: the subnormal grid
    ulp = torch.exp2(exponent - f.mantissa_bits)
    rounded = (torch.round(a / ulp) * ulp).clamp(max=f.max)  # torch.round: half to even
    return torch.where(torch.isnan(x), x.float(), torch.copysign(rounded, x.float())).to(x.dtype)


def _from_bits(name: str, exponent_bits: int, mantissa_bits: int, has_inf: bool = True) -> NumberFormat:
    """A format torch has no dtype for, from its bit layout: an IEEE-style exponent bias; with ``has_inf`` the top
    exponent is reserved for inf and nan (tf32), else every code is a finite value (e2m1).

    Example:
        >>> tf32 = _from_bits("tf32", 8, 10)
        >>> tf32.max == (2 - 2.0**-10) * 2.0**127, tf32.smallest_subnormal == 2.0**-136
        (True, True)
        >>> _from_bits("e2m1", 2, 1, has_inf=False).max
        6.0
    """
    bias = 2 ** (exponent_bits - 1) - 1
    top = 2**exponent_bits - (2 if has_inf else 1) - bias  # the largest finite value's exponent
    return NumberFormat(
        name=name,
        dtype=None,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        max=(2 - 2.0**-mantissa_bits) * 2.0**top,
        smallest_normal=2.0 ** (1 - bias),
        smallest_subnormal=2.0 ** (1 - bias - mantissa_bits),
        eps=2.0**-mantissa_bits,
        has_inf=has_inf,
    )


def _from_finfo(name: str, dtype: torch.dtype, exponent_bits: int, mantissa_bits: int,
                has_inf: bool = True) -> NumberFormat:
    info = torch.finfo(dtype)
    return NumberFormat(
        name=name,
        dtype=dtype,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        max=float(info.max),
        smallest_normal=float(info.smallest_normal),
        smallest_subnormal=float(info.smallest_normal) * 2.0**-mantissa_bits,
        eps=float(info.eps),
        has_inf=has_inf,
    )


FORMATS: dict[str, NumberFormat] = {
    "fp32": _from_finfo("fp32", torch.float32, 8, 23),
    "tf32": _from_bits("tf32", 8, 10),
    "bf16": _from_finfo("bf16", torch.bfloat16, 8, 7),
    "fp16": _from_finfo("fp16", torch.float16, 5, 10),
    "e4m3fn": _from_finfo("e4m3fn", torch.float8_e4m3fn, 4, 3, has_inf=False),
    "e5m2": _from_finfo("e5m2", torch.float8_e5m2, 5, 2),
    # fp4: 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf or nan, saturating. Only meaningful with a block scale (NVFP4).
    "e2m1": _from_bits("e2m1", 2, 1, has_inf=False),
}

_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8_e4m3": "e4m3fn",
    "e4m3": "e4m3fn",
    "float8_e4m3fn": "e4m3fn",
    "fp8_e5m2": "e5m2",
    "float8_e5m2": "e5m2",
    "fp4": "e2m1",
    "fp4_e2m1": "e2m1",
}


@dataclass(frozen=True)
class BlockFormat(_Format):
    """A block-scaled format: each ``block_size`` consecutive elements share one scale (stored in ``scale_format``),
    chosen from the block's largest finite magnitude so that it lands near ``element.max``; NVFP4 adds one fp32 scale
    per tensor (``tensor_scale``) that brings the block scales into e4m3's range.

    ``scale_rounding`` is how the block scale is rounded: ``"rceil"`` (MXFP8 in Transformer Engine and torchao's
    training recipes: the power of two at or above ``amax / element.max``, so nothing saturates), ``"floor"`` (the OCP
    MX v1.0 rule, ``2**(floor(log2 amax) - floor(log2 element.max))``: a block's largest values can exceed
    ``element.max`` and saturate) or ``"nearest"`` (an e4m3 scale, NVFP4).

    Example:
        >>> mx = get_format("mxfp8")
        >>> mx.element.name, mx.block_size, mx.scale_format, mx.bits
        ('e4m3fn', 32, 'e8m0', 8.25)
    """

    element: NumberFormat
    block_size: int
    scale_format: str
    scale_rounding: str
    tensor_scale: bool = False

    def block_multipliers(self, block_amax: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> torch.Tensor:
        """What each block's elements are multiplied by before the element cast (saturating at ``element.max``), from
        the blocks' largest finite magnitudes (fp32). The operations are torchao's reference casts', in their order
        (``to_mx`` and ``nvfp4_quantize``), so the products round identically; tested against them.

        Example:
            rceil brings 1000 to 250 (at most 448); floor brings it to 500, which then saturates.

            >>> get_format("mxfp8").block_multipliers(torch.tensor([1000.0, 1e-3])).tolist()
            [0.25, 262144.0]
            >>> get_format("mxfp8_floor").block_multipliers(torch.tensor([1000.0, 1e-3])).tolist()
            [0.5, 262144.0]
        """
        amax = block_amax.float()
        if self.scale_rounding == "rceil":
            exponent = torch.ceil(torch.log2(amax / self.element.max)).clamp(-127, 127)
            # e8m0's smallest code (2**-127) multiplies by 1, as torchao's and Transformer Engine's casts do.
            return torch.where(exponent == -127, 1.0, torch.exp2(-exponent))
        if self.scale_rounding == "floor":
            _, e = torch.frexp(amax)  # amax = m * 2**e with m in [0.5, 1): floor(log2 amax) = e - 1
            exponent = (e - 1 - self.element.max_exponent).clamp(-127, 128).float()
            return 1.0 / torch.exp2(exponent).clamp(min=torch.finfo(torch.float32).tiny)
        tensor = torch.ones((), device=amax.device) if tensor_amax is None else \
            _tensor_scale(tensor_amax.float(), self.element.max)
        block = (amax / self.element.max / tensor).clamp(_E4M3_TINY, FORMATS["e4m3fn"].max)
        return (1.0 / tensor) / block.to(torch.float8_e4m3fn).float()

    def cast(self, x: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` cast to this format and back (blocks along the last dimension, which ``block_size`` must divide): the
        real rounding and saturation of each element at its block's scale. For tests and the docs; the statistics count
        the same without building it.

        Example:
            MXFP8 flushes the 31 small values in the outlier's block; the next block keeps 1e-3 (to 3 mantissa bits).

            >>> x = torch.full((64,), 1e-3)
            >>> x[0] = 1000.0
            >>> y = get_format("mxfp8").cast(x)
            >>> (y == 0).sum().item(), y[0].item(), y[32:].unique().tolist()
            (31, 1024.0, [0.0009765625])
        """
        if x.shape[-1] % self.block_size:
            raise ValueError(f"{self.name}: the last dimension ({x.shape[-1]}) must be a multiple of {self.block_size}")
        blocks = x.float().reshape(-1, self.block_size)
        magnitudes = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0)
        if self.tensor_scale and tensor_amax is None:
            tensor_amax = magnitudes.amax()
        m = self.block_multipliers(magnitudes.amax(-1), tensor_amax if self.tensor_scale else None)[:, None]
        return (self.element.cast(blocks * m) / m).reshape(x.shape).to(x.dtype)

    @property
    def bits(self) -> float:
        """Storage bits per element, the block scale shared out (the per-tensor scale is negligible)."""
        return self.element.bits + 8 / self.block_size


_E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)  # the smallest e4m3 block scale torchao lets NVFP4 use


def _tensor_scale(tensor_amax: torch.Tensor, element_max: float) -> torch.Tensor:
    """NVFP4's fp32 tensor scale ``amax / (448 * 6)``: the block scales then span e4m3's range. An all-zero tensor
    gets 1 (any scale leaves zeros zero, and 0 would make the multipliers nan)."""
    scale = tensor_amax / (FORMATS["e4m3fn"].max * element_max)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


BLOCK_FORMATS: dict[str, BlockFormat] = {
    "mxfp8": BlockFormat("mxfp8", FORMATS["e4m3fn"], 32, "e8m0", "rceil"),
    "mxfp8_floor": BlockFormat("mxfp8_floor", FORMATS["e4m3fn"], 32, "e8m0", "floor"),
    "nvfp4": BlockFormat("nvfp4", FORMATS["e2m1"], 16, "e4m3fn", "nearest", tensor_scale=True),
}

AnyFormat = NumberFormat | BlockFormat


def get_format(fmt: str | torch.dtype | NumberFormat | BlockFormat) -> AnyFormat:
    """Look a format up by name (``"fp16"``, ``"e4m3fn"``, ``"mxfp8"``, ``"nvfp4"``, aliases such as ``"half"``),
    dtype, or pass one through.

    Example:
        >>> get_format("half").name, get_format(torch.bfloat16).name, get_format("mxfp8").block_size
        ('fp16', 'bf16', 32)
        >>> get_format("fp6")
        Traceback (most recent call last):
            ...
        ValueError: Unknown number format 'fp6'. Use one of ['fp32', 'tf32', ...] (or an alias: ['float32', ...]).
    """
    if isinstance(fmt, _Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for candidate in FORMATS.values():
            if candidate.dtype == fmt:
                return candidate
        known = [f.dtype for f in FORMATS.values() if f.dtype]
        raise ValueError(f"No number format for dtype {fmt}. Known dtypes: {known}.")
    name = _ALIASES.get(str(fmt).lower(), str(fmt).lower())
    if name in BLOCK_FORMATS:
        return BLOCK_FORMATS[name]
    if name not in FORMATS:
        raise ValueError(f"Unknown number format {fmt!r}. Use one of {list(FORMATS) + list(BLOCK_FORMATS)} (or an"
                         f" alias: {list(_ALIASES)}).")
    return FORMATS[name]


def format_table() -> str:
    """The table as Markdown, for the docs and the command line.

    Example:
        >>> print(format_table().splitlines()[5])
        | fp16 | 16 | 5 | 10 | 65504 | 6.10352e-05 (2^-14) | 5.96046e-08 (2^-24) | 0.000976562 |
    """
    rows = ["| format | bits | exp | mantissa | max | smallest normal | smallest subnormal | eps |", "|---" * 8 + "|"]
    for f in FORMATS.values():
        rows.append(
            f"| {f.name} | {f.bits} | {f.exponent_bits} | {f.mantissa_bits} | {f.max:.6g} | {f.smallest_normal:.6g}"
            f" (2^{f.min_exponent + f.mantissa_bits}) | {f.smallest_subnormal:.6g} (2^{f.min_exponent}) | {f.eps:.6g} |"
        )
    rows += ["", "| block format | element | block | scale | scale rounding | tensor scale | bits per element |",
             "|---" * 7 + "|"]
    for b in BLOCK_FORMATS.values():
        rows.append(f"| {b.name} | {b.element.name} | {b.block_size} | {b.scale_format} | {b.scale_rounding} |"
                    f" {'fp32' if b.tensor_scale else 'none'} | {b.bits:g} |")
    return "\n".join(rows)
