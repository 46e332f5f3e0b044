"""The number formats mixed precision reasons about, in one table.

Values come from ``torch.finfo`` where torch has the dtype; tf32 (a tensor-core compute mode, not a storage dtype) is
derived from its bit layout. Used by the callbacks, the docs and the command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass(frozen=True)
class NumberFormat:
    """One floating-point format. ``dtype`` is None for tf32, which only exists inside matmuls."""

    name: str
    dtype: Optional[torch.dtype]
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
        return round(torch.log2(torch.tensor(self.smallest_subnormal, dtype=torch.float64)).item())

    @property
    def max_exponent(self) -> int:
        """floor(log2(max)): values at 2**(max_exponent + 1) and above overflow."""
        return int(torch.floor(torch.log2(torch.tensor(self.max, dtype=torch.float64))).item())

    @property
    def flush_bound(self) -> float:
        """Round-to-nearest-even sends ``0 < |x| <= flush_bound`` to zero: half the smallest subnormal (the tie at
        exactly half goes to the even neighbour, zero) and nothing above it (fp16 rounds (2**-25, 2**-24) up)."""
        return self.smallest_subnormal / 2

    @property
    def overflow_bound(self) -> float:
        """``|x| >= overflow_bound`` overflows: ``max`` plus half its ulp. Below it the cast rounds to at most ``max``
        (plain rounding); from it on, an IEEE format rounds to inf (the tie goes away from ``max``, whose mantissa is
        odd) and e4m3fn, which has no inf, saturates at ``max`` with an error beyond rounding."""
        return self.max + 2.0 ** (self.max_exponent - self.mantissa_bits) / 2

    def cast(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to this format and back to ``x.dtype`` (the real cast; tf32 is rounded in place)."""
        if self.dtype is not None:
            return x.to(self.dtype).to(x.dtype)
        # tf32 keeps fp32's exponent and 10 of its 23 mantissa bits: round to nearest even on the 13 dropped bits.
        bits = x.float().view(torch.int32)
        rounded = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF
        finite = torch.isfinite(x.float())
        return torch.where(finite, rounded.view(torch.float32), x.float()).to(x.dtype)


def _from_finfo(name: str, dtype: torch.dtype, exponent_bits: int, mantissa_bits: int, has_inf: bool = True) -> NumberFormat:
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
    "tf32": NumberFormat(
        name="tf32",
        dtype=None,
        exponent_bits=8,
        mantissa_bits=10,
        max=(2 - 2.0**-10) * 2.0**127,
        smallest_normal=2.0**-126,
        smallest_subnormal=2.0**-136,
        eps=2.0**-10,
    ),
    "bf16": _from_finfo("bf16", torch.bfloat16, 8, 7),
    "fp16": _from_finfo("fp16", torch.float16, 5, 10),
    "e4m3fn": _from_finfo("e4m3fn", torch.float8_e4m3fn, 4, 3, has_inf=False),
    "e5m2": _from_finfo("e5m2", torch.float8_e5m2, 5, 2),
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
}


def get_format(fmt: Union[str, torch.dtype, NumberFormat]) -> NumberFormat:
    """Look a format up by name (``"fp16"``, ``"e4m3fn"``, aliases such as ``"half"``), dtype, or pass one through."""
    if isinstance(fmt, NumberFormat):
        return fmt
    if isinstance(fmt, torch.dtype):
        for candidate in FORMATS.values():
            if candidate.dtype == fmt:
                return candidate
        raise ValueError(f"No number format for dtype {fmt}. Known dtypes: {[f.dtype for f in FORMATS.values() if f.dtype]}.")
    name = _ALIASES.get(str(fmt).lower(), str(fmt).lower())
    if name not in FORMATS:
        raise ValueError(f"Unknown number format {fmt!r}. Use one of {list(FORMATS)} (or an alias: {list(_ALIASES)}).")
    return FORMATS[name]


def format_table() -> str:
    """The table as Markdown, for the docs and the command line."""
    rows = ["| format | bits | exp | mantissa | max | smallest normal | smallest subnormal | eps |", "|---" * 8 + "|"]
    for f in FORMATS.values():
        rows.append(
            f"| {f.name} | {f.bits} | {f.exponent_bits} | {f.mantissa_bits} | {f.max:.6g} | {f.smallest_normal:.6g}"
            f" (2^{f.min_exponent + f.mantissa_bits}) | {f.smallest_subnormal:.6g} (2^{f.min_exponent}) | {f.eps:.6g} |"
        )
    return "\n".join(rows)
