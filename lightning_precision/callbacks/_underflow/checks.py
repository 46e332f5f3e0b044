"""GradientUnderflowMonitor's constructor arguments, checked: each error repeats the call and says the fix (the cadence
ones go through ``_cadence.set_cadence``, ``fp8_scaling`` through ``_underflow_scaling.check_fp8_scaling``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lightning_precision.formats import NumberFormat, get_format

__all__ = ["FormatsLike", "check_options", "format_names"]

_OWNER = "GradientUnderflowMonitor"

FormatsLike = str | torch.dtype | NumberFormat | Sequence[str | torch.dtype | NumberFormat]


def format_names(formats: FormatsLike) -> tuple[str, ...]:
    """The names of ``formats``: one format or several, at least one."""
    if isinstance(formats, (str, torch.dtype, NumberFormat)):
        formats = (formats,)  # one format, not the letters of its name
    if not isinstance(formats, Iterable) or not list(formats):
        raise ValueError(f"`{_OWNER}(formats={formats!r})`: name at least one format, e.g. ('fp16',) or 'fp16'.")
    return tuple(get_format(f).name for f in formats)


def check_options(top_k: int, warn_threshold: float, target_underflow: float, probe_factor: float | None) -> None:
    """The numeric arguments, in the constructor's order."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"`{_OWNER}(top_k={top_k!r})`: a whole number of modules, 0 (no per-layer keys) or more.")
    _check_fraction("warn_threshold", warn_threshold)
    _check_fraction("target_underflow", target_underflow)
    if probe_factor is not None and (
        isinstance(probe_factor, bool) or not isinstance(probe_factor, numbers.Real) or not probe_factor > 1
        or not math.isfinite(probe_factor) or math.log2(probe_factor) % 1
    ):
        raise ValueError(f"`{_OWNER}(probe_factor={probe_factor!r})`: a power of two > 1 (e.g. 2.0**16), or None for"
                         " no probe.")


def _check_fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) <= 1:
        raise ValueError(f"`{_OWNER}({name}={value!r})`: a fraction, in [0, 1], e.g. 0.01.")
