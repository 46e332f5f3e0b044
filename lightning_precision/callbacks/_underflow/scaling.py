"""GradientUnderflowMonitor's ``fp8_scaling``: the scalings it takes, the one an fp8 plugin uses, and which formats'
figures are taken at that dynamic scale (keyed ``<fmt>/dynamic``) in place of their unscaled ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_precision.formats import NumberFormat, get_format

__all__ = ["DYNAMIC", "FP8_SCALINGS", "Scaling", "check_fp8_scaling", "fixed_scaling", "fp8_formats", "label",
           "plugin_scaling"]

# `fp8_scaling=`: a plugin's `scaling_family` (FP8Precision.scaling_family), and how its casts are scaled: per row for
# torchao's rowwise recipes (rounded to powers of two, as they are), per block of 32 for MXFP8, per tensor otherwise
# (torchao tensorwise; Transformer Engine's delayed and current scaling, measured at the current amax; NVFP4's plugin,
# whose casts are not fp8: a what-if at a per-tensor scale).
FP8_SCALINGS = ("tensorwise", "rowwise", "mxfp8", "delayed", "current", "block", "custom", "nvfp4")
_DYNAMIC = {"rowwise": ("rowwise", True), "mxfp8": ("mxfp8", False)}
DYNAMIC = "dynamic"  # the key segment of a figure taken at the dynamic scale: precision/underflow/e4m3fn/dynamic

Scaling = tuple[str, bool]  # (scaling, pow2), as `dynamic_scale_stats` takes them; None where unscaled


def check_fp8_scaling(fp8_scaling: str | None) -> None:
    if fp8_scaling not in (None, "auto", *FP8_SCALINGS):
        raise ValueError(f"`GradientUnderflowMonitor(fp8_scaling={fp8_scaling!r})`: 'auto' (the Trainer's fp8 plugin's"
                         f" scaling), None (unscaled), or a plugin's `scaling_family`: one of {FP8_SCALINGS}.")


def fixed_scaling(fp8_scaling: str | None) -> Scaling | None:
    """The scaling a ``fp8_scaling`` names; None for unscaled and for ``"auto"`` (resolved at the Trainer's setup)."""
    return None if fp8_scaling in (None, "auto") else _DYNAMIC.get(fp8_scaling, ("tensorwise", False))


def plugin_scaling(plugin: Any) -> Scaling | None:
    """How the fp8 plugin scales what it casts to fp8, as ``(scaling, pow2)`` for ``dynamic_scale_stats``; None for a
    plugin that casts nothing to fp8."""
    family = getattr(plugin, "scaling_family", None)  # lightning_precision's FP8Precision
    if family is None:  # Lightning's own TransformerEnginePrecision: delayed scaling, per tensor
        return ("tensorwise", False) if str(getattr(plugin, "precision", "")).startswith("transformer-engine") else None
    if getattr(plugin, "backend", None) == "torchao" and family in ("tensorwise", "rowwise"):
        from lightning_precision.fp8._sensitivity import cast_specs

        spec = cast_specs(plugin.recipe)["grad_output"]  # the recipe's own gradient cast, whatever its name
        return ("rowwise" if spec.axiswise else "tensorwise", spec.pow2)
    return _DYNAMIC.get(family, ("tensorwise", False))


def fp8_formats(formats: Sequence[str], dynamic: Scaling | None) -> list[str]:
    """The fp8 formats measured at the dynamic scale; none when unscaled. A block format (``"mxfp8"``) scales each
    block itself already."""
    if dynamic is None:
        return []
    return [name for name in formats if isinstance(get_format(name), NumberFormat) and get_format(name).bits == 8]


def label(fmt: str, formats: Sequence[str], dynamic: Scaling | None) -> str:
    """How a format's figures are keyed: ``e4m3fn/dynamic`` when measured at the dynamic scale."""
    return f"{fmt}/{DYNAMIC}" if fmt in fp8_formats(formats, dynamic) else fmt
