"""Model FLOPs utilisation: the model's FLOPs per step, and the device's dense tensor-core peak for the compute dtype.

Peaks are the vendors' datasheet figures without sparsity (a datasheet's larger "with sparsity" figure is twice these),
in TFLOP/s, per GPU. Lightning's own table (``lightning.fabric.utilities.throughput.get_available_flops``) matches
device names by substrings in an order that gives an "NVIDIA L40S" the L4's peak (a third of its own: MFU 3x too high)
and finds none for an "NVIDIA H200"; the names here are matched most specific first, and tested.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "DevicePeak",
    "KINDS",
    "PEAKS",
    "PeakChoice",
    "choose_peak",
    "compute_kind",
    "device_peak",
    "mfu",
    "model_flops_per_step",
    "parse_peak_override",
    "peak_device_name",
    "plugin_compute_dtype",
]

# The compute kinds a peak is given for: matmul inputs in fp32 (no tensor cores), tf32, bf16, fp16, fp8.
KINDS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class DevicePeak:
    """A GPU's dense peak TFLOP/s per compute kind, matched by ``patterns`` (all lower-case substrings must appear in
    the device name) and ``excludes`` (none may)."""

    name: str
    tflops: Mapping[str, float]
    patterns: tuple[str, ...]
    excludes: tuple[str, ...] = ()
    source: str = ""

    def matches(self, device_name: str) -> bool:
        name = device_name.lower()
        return all(p in name for p in self.patterns) and not any(e in name for e in self.excludes)


def _peak(name: str, fp32: float, tf32: float, half: float, fp8: float | None, patterns: tuple[str, ...],
          excludes: tuple[str, ...] = (), source: str = "") -> DevicePeak:
    tflops = {"fp32": fp32, "tf32": tf32, "bf16": half, "fp16": half}
    if fp8 is not None:
        tflops["fp8"] = fp8
    return DevicePeak(name, tflops, patterns, excludes, source)


# Most specific first: the first match wins.
PEAKS: tuple[DevicePeak, ...] = (
    _peak("B200", 75.0, 1100.0, 2250.0, 4500.0, ("b200",), source="NVIDIA HGX B200 datasheet, per GPU, dense"),
    _peak("H200 NVL", 60.0, 417.5, 835.5, 1670.5, ("h200", "nvl"), source="NVIDIA H200 NVL datasheet, dense"),
    _peak("H200 SXM", 67.0, 494.5, 989.5, 1979.0, ("h200",), source="NVIDIA H200 SXM datasheet, dense"),
    _peak("H100 NVL", 60.0, 417.5, 835.5, 1670.5, ("h100", "nvl"), source="NVIDIA H100 NVL datasheet, dense"),
    _peak("H100 PCIe", 51.0, 378.0, 756.5, 1513.0, ("h100", "pcie"), source="NVIDIA H100 PCIe datasheet, dense"),
    _peak("H100 SXM", 67.0, 494.5, 989.5, 1979.0, ("h100",), source="NVIDIA H100 SXM datasheet, dense"),
    _peak("A100", 19.5, 156.0, 312.0, None, ("a100",), source="NVIDIA A100 datasheet, dense (no fp8)"),
    _peak("L40S", 91.6, 183.0, 362.05, 733.0, ("l40s",), source="NVIDIA L40S datasheet, dense"),
    _peak("L4", 30.3, 60.0, 121.0, 242.5, ("l4",), excludes=("l40",), source="NVIDIA L4 datasheet, dense"),
)


def device_peak(device_name: str) -> DevicePeak | None:
    """The table's entry for a device name (``torch.cuda.get_device_name()``), or None."""
    return next((p for p in PEAKS if p.matches(device_name)), None)


_KIND_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "int8": "fp8"}


def compute_kind(dtype: torch.dtype | str) -> str:
    """The peak a run's matmuls count against, from the dtype its precision plugin names for it (``peak_flops_dtype``
    of this package's plugins: an fp8 plugin names Lightning's fp8 key ``torch.int8`` only when its layers really run
    in fp8, not emulated; fp32 for no plugin). fp32 counts as tf32 when torch lets matmuls use it."""
    name = str(dtype).removeprefix("torch.")
    if name in _KIND_OF_DTYPE:
        return _KIND_OF_DTYPE[name]
    if name != "float32":
        raise ValueError(f"compute_kind: no peak kind for {dtype!r}")
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


@dataclass(frozen=True)
class PeakChoice:
    """The peak a run is measured against, or why there is none."""

    tflops: float | None
    source: str
    kind: str = ""
    overrides: Mapping[str, float] = field(default_factory=dict)


def parse_peak_override(text: str, option: str | None = "--peak-tflops") -> dict[str, float]:
    """``--peak-tflops``: one number for every kind (``"989"``) or ``kind=number`` pairs (``"bf16=989,fp8=1979"``).
    ``option``: what the errors start with (the command line's flag); ``None`` for a caller that names the argument
    its user passed itself (``MFUMonitor(peak_tflops=...)``)."""
    prefix = f"{option} {text.strip()!r}: " if option else ""
    text = text.strip()
    try:
        if "=" not in text:
            value = float(text)
            pairs = dict.fromkeys(KINDS, value)
        else:
            pairs = {}
            for part in text.split(","):
                kind, _, number = part.partition("=")
                kind = kind.strip()
                if kind not in KINDS:
                    raise ValueError(f"unknown kind {kind!r}: choose from {', '.join(KINDS)}")
                pairs[kind] = float(number)
    except ValueError as err:
        device = device_peak(text) is not None  # a GPU's name ("H100"): the table is looked up by the device itself
        hint = " (a device's name is not a peak: leave it out, and the device's own is looked up in the table)" \
            if device else ""
        raise ValueError(f"{prefix}{err}; give one number or kind=number pairs, e.g. bf16=989,fp8=1979{hint}") from None
    bad = [k for k, v in pairs.items() if not v > 0 or v == float("inf")]
    if bad:
        raise ValueError(f"{prefix}peaks must be positive and finite")
    return pairs


def choose_peak(device: str, kind: str, overrides: Mapping[str, float] | None = None,
                option: str = "--peak-tflops") -> PeakChoice:
    """The peak for ``kind`` on ``device`` ("cpu" or a CUDA device name): the override, else the table, else None with
    why. ``option`` is how the caller's user gives an override (the command line's flag, a callback's argument)."""
    if overrides and kind in overrides:
        return PeakChoice(overrides[kind], option, kind)
    # What the user can do about a missing peak: give one, or (overrides without this kind) give this kind too.
    hint = (f"{option} names no {kind} peak (only {', '.join(overrides)})" if overrides
            else f"pass {option} to set one")
    if device == "cpu":
        return PeakChoice(None, f"n/a on a CPU: no table of CPU peaks (vector units, clocks and cores vary too much);"
                                f" {hint}", kind)
    peak = device_peak(device)
    if peak is None:
        return PeakChoice(None, f"n/a: {device!r} is not in the table; {hint}", kind)
    if kind not in peak.tflops:
        return PeakChoice(None, f"n/a: the {peak.name} has no {kind} tensor cores", kind)
    return PeakChoice(peak.tflops[kind], f"{peak.name} {kind} ({peak.source})", kind)


def peak_device_name(device: torch.device) -> str:
    """The name ``choose_peak`` looks a device up by: the CUDA device's name, "cpu" for the CPU, else the device type
    (no table: MFU is n/a there without an override)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


# Lightning's own plugins name no `peak_flops_dtype`: their precision string says what their matmuls run in.
_DTYPE_OF_PRECISION = (("bf16", torch.bfloat16), ("16", torch.float16), ("transformer-engine", torch.int8),
                       ("64", torch.float64))


def plugin_compute_dtype(plugin: Any) -> torch.dtype:
    """The dtype a precision plugin's matmuls count against: this package's plugins say it (``peak_flops_dtype``, which
    an fp8 plugin changes once ``layers="auto"`` has chosen); for others, from Lightning's precision string
    ("bf16-mixed"/"bf16-true": bf16, "16-mixed"/"16-true": fp16, "transformer-engine*": Lightning's fp8 key
    ``torch.int8``, "64-true": fp64), else fp32."""
    dtype = getattr(plugin, "peak_flops_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    precision = str(getattr(plugin, "precision", ""))
    return next((d for prefix, d in _DTYPE_OF_PRECISION if precision.startswith(prefix)), torch.float32)


def mfu(flops_per_step: float, seconds_per_step: float, peak_tflops: float | None) -> tuple[float, float | None]:
    """``(achieved TFLOP/s, MFU)`` of a step of ``flops_per_step`` FLOPs taking ``seconds_per_step``: MFU is the
    fraction of ``peak_tflops`` achieved, None without a peak. Per device: pass one device's FLOPs, time and peak."""
    for name, value in (("flops_per_step", flops_per_step), ("seconds_per_step", seconds_per_step)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
            raise ValueError(f"mfu: {name} must be a positive, finite number, not {value!r}")
    if peak_tflops is not None and (isinstance(peak_tflops, bool) or not isinstance(peak_tflops, numbers.Real)
                                    or not 0 < peak_tflops < math.inf):
        raise ValueError(f"mfu: peak_tflops must be a positive, finite number or None, not {peak_tflops!r}")
    achieved = flops_per_step / seconds_per_step / 1e12
    return achieved, (achieved / peak_tflops if peak_tflops is not None else None)


def model_flops_per_step(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> int:
    """Forward and backward FLOPs of one training step on ``batch`` (``torch.utils.flop_counter``: matmuls,
    convolutions and attention; the optimizer's elementwise work is not counted), in fp32 on the model's device. The
    model's ``.grad`` is left as it was."""
    from torch.utils.flop_counter import FlopCounterMode

    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            loss = loss_fn(model, batch)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        del grads
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return int(counter.get_total_flops())
