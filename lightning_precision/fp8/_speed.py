"""A speed model for a linear layer's formats: the step time each candidate format saves over the high dtype, from the
layer's GEMM shapes and a table of GPUs, and an optional micro-benchmark of the layer's own shapes on a CUDA GPU.

Per training step a linear layer with ``tokens`` rows (M), ``in_features`` (K) and ``out_features`` (N) runs three
GEMMs of ``2*M*N*K`` FLOPs: the output (forward), the input gradient and the weight gradient. The model:

- each GEMM takes ``max(FLOPs / (peak * efficiency), bytes / (bandwidth * MEMORY_EFFICIENCY))`` at the peak of the
  kind it runs in (bf16/fp16, fp8, and on Blackwell mxfp8/nvfp4), the efficiency lower for the low kinds
  (``GEMM_EFFICIENCY`` 0.79, ``FP8_GEMM_EFFICIENCY`` 0.73: an H200's measured rates); ``rowwise_with_gw_hp`` keeps
  the weight-gradient GEMM in the high dtype;
- each cast a format does (input, weight, grad_output; the transposed copies the backward needs; the amax pass of
  dynamic scaling; the scales of per-row and per-block formats) moves ``CAST_COSTS[format]`` bytes per element
  through device memory at the format's fraction of the bandwidth (the input's at ``INPUT_CAST_FACTOR`` times its
  bytes), plus ``KERNEL_SECONDS`` for each of its kernels.

The saving is the high dtype's GEMM seconds minus the format's GEMM and cast seconds: negative where the casts cost more
than the faster GEMMs save (small and medium layers). It is a prediction, fitted so that its sign agrees with every
measurement of ``fp8._speed_data`` (torchao's published H100 and B200 figures, our H200 run; ``calibrated_on`` per
device), not measured on the machine it runs on; what it leaves out (the step's other ops, communication, clocks under
power limits) is said in the docs. ``_timing.time_shapes`` measures it on a CUDA GPU instead.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_precision._mfu import PEAKS, compute_kind, device_peak
from lightning_precision.fp8._plan_types import HIGH, HIGH_LABELS
from lightning_precision.fp8._selection import BACKENDS, TE_NVFP4, TE_RECIPES, TORCHAO_RECIPES
from lightning_precision.fp8._speed_data import calibrated_on

__all__ = [
    "CAST_COSTS",
    "DEVICES",
    "GEMM_EFFICIENCY",
    "KERNEL_SECONDS",
    "MEMORY_EFFICIENCY",
    "PREDICTION_DEVICE",
    "ROWWISE_CAST_EFFICIENCY",
    "FP8_GEMM_EFFICIENCY",
    "INPUT_CAST_FACTOR",
    "MXFP8_CAST_EFFICIENCY",
    "SCALED_GEMM_EFFICIENCY",
    "TENSORWISE_CAST_EFFICIENCY",
    "UNCALIBRATED_CAST_EFFICIENCY",
    "CastCost",
    "GemmDevice",
    "gemm_seconds",
    "planning_device",
    "runs",
    "high_time",
    "predicted_saving",
    "speed_device",
    "supported_candidates",
]

# The kind a plan's high-precision label computes in: "high" (a plan made by hand, dtype unknown) counts as bf16.
_HIGH_KIND = {label: "bf16" if label == HIGH else label for label in HIGH_LABELS}


@dataclass(frozen=True)
class GemmDevice:
    """A GPU as the speed model sees it: dense tensor-core peaks in TFLOP/s per kind ("fp32", "tf32", "bf16", "fp16",
    "fp8", and where the GPU has them "mxfp8", "nvfp4"), device-memory ``bandwidth`` in TB/s, CUDA compute
    ``capability``, the datasheets the figures come from, and what the model's figures for it were checked against
    (``calibrated_on``: measurement sets, or "not calibrated")."""

    name: str
    tflops: Mapping[str, float]
    bandwidth: float
    capability: tuple[int, int]
    source: str
    calibrated_on: str = ""


# What `_mfu.PEAKS` (the dense bf16/fp8 peaks used for MFU, matched by device name) lacks: memory bandwidth, compute
# capability, and Blackwell's block-scaled peaks (MXFP8 runs at the fp8 rate; NVFP4 at twice it). Hopper and Ada have
# no MXFP8/NVFP4 tensor cores, Ampere no fp8 at all. One row per PEAKS entry (a test checks both tables agree).
_MORE: dict[str, tuple[float, str, dict[str, float], str]] = {
    "B200": (8.0, "sm_100", {"mxfp8": 4500.0, "nvfp4": 9000.0},
             "HGX B200 datasheet: HBM3e 8 TB/s per GPU; FP4 18 PFLOPS per GPU with sparsity (9 dense); MXFP8 at the"
             " FP8 rate (Blackwell architecture technical brief)"),
    "H200 NVL": (4.8, "sm_90", {}, "H200 NVL datasheet: HBM3e 4.8 TB/s"),
    "H200 SXM": (4.8, "sm_90", {}, "H200 SXM datasheet: HBM3e 4.8 TB/s"),
    "H100 NVL": (3.9, "sm_90", {}, "H100 NVL datasheet: HBM3 3.9 TB/s"),
    "H100 PCIe": (2.0, "sm_90", {}, "H100 PCIe datasheet: HBM2e 2 TB/s"),
    "H100 SXM": (3.35, "sm_90", {}, "H100 SXM datasheet: HBM3 3.35 TB/s"),
    "A100": (2.039, "sm_80", {}, "A100 datasheet: 80GB SXM HBM2e 2,039 GB/s (the 40GB PCIe card: 1,555 GB/s)"),
    "L40S": (0.864, "sm_89", {}, "L40S datasheet: GDDR6 864 GB/s"),
    "L4": (0.3, "sm_89", {}, "L4 datasheet: GDDR6 300 GB/s"),
}


def _capability(arch: str) -> tuple[int, int]:
    """``"sm_90"`` -> ``(9, 0)``: the table names each GPU's architecture as CUDA does; the capabilities formats
    need are fp8._hardware's."""
    digits = arch.removeprefix("sm_")
    return int(digits[:-1]), int(digits[-1])


_HOPPER = _capability("sm_90")  # Transformer Engine's block scaling (Float8BlockScaling) needs Hopper or later

DEVICES: tuple[GemmDevice, ...] = tuple(
    GemmDevice(p.name, {**p.tflops, **_MORE[p.name][2]}, _MORE[p.name][0], _capability(_MORE[p.name][1]),
               f"{p.source}; {_MORE[p.name][3]}", calibrated_on(p.name))
    for p in PEAKS
)
_BY_NAME = {d.name: d for d in DEVICES}
# What a plan made on a CPU predicts for: the GPU torchao's published tables (the calibration) were measured on.
PREDICTION_DEVICE = "H100 SXM"


def _current_device() -> GemmDevice | None:
    """The table's entry for this process's CUDA device, None without CUDA or for a GPU not in the table."""
    if not torch.cuda.is_available():
        return None
    peak = device_peak(torch.cuda.get_device_name())
    return _BY_NAME[peak.name] if peak is not None else None


def speed_device(name: str | None = None) -> tuple[GemmDevice, bool]:
    """The table's entry for ``name`` (a table name such as ``"H100 SXM"``, or a CUDA device name such as
    ``"NVIDIA H100 80GB HBM3"``), else for this process's CUDA device, else (no CUDA, or a GPU not in the table) the
    H100 SXM's. The bool is True when the entry is a prediction for a device this process is not running on.

    Example:
        >>> device, predicted = speed_device("NVIDIA L40S")
        >>> device.name, device.bandwidth, "mxfp8" in device.tflops
        ('L40S', 0.864, False)
    """
    current = _current_device()
    if name is None:
        return (current, False) if current is not None else (_BY_NAME[PREDICTION_DEVICE], True)
    if not isinstance(name, str):
        raise TypeError(f"speed_device(name={name!r}): give a GPU's name as a string, e.g. 'H100 SXM'.")
    found = next((d for d in DEVICES if d.name.lower() == name.strip().lower()), None)
    if found is None:
        peak = device_peak(name)
        found = _BY_NAME[peak.name] if peak is not None else None
    if found is None:
        raise ValueError(f"speed_device(name={name!r}): no such GPU in the speed table; known:"
                         f" {', '.join(d.name for d in DEVICES)} (or a CUDA device name that contains one).")
    return found, found is not current


def runs(device: GemmDevice, candidate: str, backend: str | None = None) -> bool:
    """Whether ``device`` runs ``candidate`` (``backend``: whose format it is; None: the backend that has a format of
    that name, torchao for ``"mxfp8"``)."""
    if backend is None:
        backend = next((b for b in BACKENDS if candidate in _formats(b)), "torchao")
    return candidate in supported_candidates(device, backend)


def planning_device(name: str | None, candidates: Iterable[str], backend: str | None = None) -> tuple[GemmDevice, bool]:
    """The GPU a plan's savings are for: ``speed_device(name)``; but where that is a prediction for a GPU this process
    does not run on and it runs not every candidate (an H100 and MXFP8), the first GPU of the table that runs them all
    (a B200), so that a plan made on a CPU weighs every format it was asked to."""
    device, prediction = speed_device(name)
    wanted = list(candidates)
    if name is None and prediction and not all(runs(device, c, backend) for c in wanted):
        device = next((d for d in DEVICES if all(runs(d, c, backend) for c in wanted)), device)
    return device, prediction


def supported_candidates(device: GemmDevice, backend: str) -> tuple[str, ...]:
    """The formats ``backend`` runs on ``device``: none without fp8 tensor cores (Ampere); torchao's tensorwise, rowwise
    and rowwise_with_gw_hp from Ada (rowwise on Ada through PyTorch's sm89 rowwise GEMM) and MXFP8 on Blackwell;
    Transformer Engine's delayed and current scaling from Ada, block scaling from Hopper, MXFP8 and NVFP4 on Blackwell
    (Transformer Engine's support matrix).

    Example:
        >>> supported_candidates(speed_device("H100 SXM")[0], "torchao")
        ('tensorwise', 'rowwise', 'rowwise_with_gw_hp')
        >>> supported_candidates(speed_device("A100")[0], "transformer_engine")
        ()
    """
    if backend not in BACKENDS:
        raise ValueError(f"supported_candidates(backend={backend!r}): choose one of {', '.join(BACKENDS)}.")
    if "fp8" not in device.tflops:
        return ()
    block = {"mxfp8": "mxfp8" in device.tflops, TE_NVFP4: TE_NVFP4 in device.tflops,
             "block": device.capability >= _HOPPER}
    return tuple(n for n in _formats(backend) if block.get(n, True))


@dataclass(frozen=True)
class CastCost:
    """What a format costs per training step besides its GEMMs' FLOPs: the kind each GEMM runs in (forward, input
    gradient, weight gradient; "high": the high dtype's), the fraction of a per-tensor scaled GEMM's speed its GEMMs
    reach (``gemm_efficiency``), the bytes read and written per element of each cast tensor (a 2-byte source), the
    fraction of the bandwidth its casts reach (``memory_efficiency``), and the cast kernels it launches."""

    kinds: tuple[str, str, str]
    gemm_efficiency: float
    input: float
    weight: float
    grad_output: float
    memory_efficiency: float
    kernels: int


# A tuned elementwise kernel reaches 92% of the bandwidth: torchao's roofline (torchao/testing/training/
# roofline_utils.py, H100 "pct_achievable_mem_bw"); it bounds every GEMM's memory time, high and low.
MEMORY_EFFICIENCY = 0.92
# A large GEMM's fraction of its dense peak, measured on an H200 (../shared/GPU.md: 8192^3, bf16 783 of 989.5 TFLOP/s,
# fp8 `torch._scaled_mm` 1453 of 1979): fp8 GEMMs reach less of their peak than bf16 ones, so the fp8 GEMM time is
# 0.54x of bf16's, not 0.5x (torchao's roofline assumes 0.78 for both). The H100 has the same SMs and clocks; other
# GPUs take the same fractions (uncalibrated). mxfp8 and nvfp4 GEMMs take the fp8 figure.
GEMM_EFFICIENCY = 0.79
FP8_GEMM_EFFICIENCY = 0.73
# What each kernel costs on top of its bytes (launch and tail): torchao's roofline measured 2 us for a one-element
# triton kernel on an H100; 3 us fits torchao's published small shapes better.
KERNEL_SECONDS = 3e-6
# Fitted so that the sign of the saving agrees with the measurements of
# fp8._speed_data; `python benchmarks/gemm_speed.py` prints each beside the model:
# - the casts torch.compile generates reach 36% of the bandwidth for per-tensor scaling and 45% for per-row scaling
#   (whose casts transpose a bf16 copy, counted in its bytes). Per-tensor casts were fitted at 60% to torchao's two
#   tensorwise examples alone; at 60% the ViT-H-sized stack of GPU.md (H200, compiled, 0.92x of bf16: 1.5 ms a step
#   lost) is predicted to save 0.74 ms a step, at 45% to break even, at 36% to lose 0.73 ms. torchao's examples then
#   come out at 0.46x and 1.14x (published 0.80x and 1.39x): the right side of 1, pessimistic;
# - an input costs INPUT_CAST_FACTOR times its bytes and grad_output's first read is fused with the op before it
#   (torchao's roofline `fuse_with_prev`): torchao's rowwise table is faster at a small in_features than at a small
#   out_features, (32768, 2048, 32768) at 1.27x but (32768, 32768, 2048) at 0.93x, which a model that costs both
#   alike cannot show (it predicts about 1.02x for both);
# - a per-row scaled GEMM runs as fast as a per-tensor one (the fit leaves no room for a slower one).
# Agreement: 222 of 224 measurements; the 2 others are rowwise shapes published at 1.01x, (4096, 4096, 8192) and
# (8192, 2048, 8192), predicted at 0.99x and 0.97x (break-even within the table's noise: their neighbours
# (4096, 4096, 4096) and (8192, 2048, 4096) are published at 0.84x and 0.82x). The log speedup (the LayerNorm and
# Sigmoid counted as the benchmark runs them) is off by 0.14 RMS over torchao's 218 shapes (0.17 before the refit).
# `python benchmarks/gemm_speed.py --fit` searches the cast constants again.
TENSORWISE_CAST_EFFICIENCY = 0.36
ROWWISE_CAST_EFFICIENCY = 0.45
SCALED_GEMM_EFFICIENCY = 1.0
INPUT_CAST_FACTOR = 1.4
# Formats no measurement covers keep the figure the model gave casts before it had any (Transformer Engine's casts are
# fused CUDA kernels, not inductor's); torchao's MXFP8 casts are triton/CUDA kernels measured at 5.4-6.5 TB/s of a
# B200's 8 (torchao docs/source/workflows/training.md, "quantization kernel microbenchmarks": 0.68-0.81), 0.7 here.
UNCALIBRATED_CAST_EFFICIENCY = 0.6
MXFP8_CAST_EFFICIENCY = 0.7

_F8 = ("fp8", "fp8", "fp8")
_TW, _RW, _TE = TENSORWISE_CAST_EFFICIENCY, ROWWISE_CAST_EFFICIENCY, UNCALIBRATED_CAST_EFFICIENCY
# Bytes per element of each cast (2-byte reads; fp8 writes 1, fp4 0.5; scales: e8m0 per 32-block of MXFP8, e4m3 per
# 16-block of NVFP4, fp32 per 128-block; fp32 per row is under 0.1% of the traffic and left out). torchao's
# grad_output casts read it fused with the op before them (2 bytes fewer).
CAST_COSTS: dict[str, CastCost] = {
    # torchao dynamic per-tensor: an amax pass (read 2) then a cast writing the row-major and the transposed copy
    # (read 2, write 1 + 1) for input and grad_output (its amax fused: 4); the weight is cast twice (forward, and
    # transposed for the input gradient: read 2 write 1 each) after its amax pass. 7 kernels.
    "tensorwise": CastCost(_F8, 1.0, input=6, weight=8, grad_output=4, memory_efficiency=_TW, kernels=7),
    # torchao per-row: a row-scaled copy plus a transposed bf16 copy (read 2, write 1 + 2), then the transposed copy
    # row-scaled (read 2, write 1) for input and grad_output (its first read fused: 6); the weight cast (3),
    # transposed (read 2, write 2) and cast again (3). 7 kernels.
    "rowwise": CastCost(_F8, SCALED_GEMM_EFFICIENCY, input=8, weight=10, grad_output=6, memory_efficiency=_RW,
                        kernels=7),
    # torchao per-row with the weight gradient in high precision: input and grad_output cast once, row-scaled (3;
    # grad_output's read fused: 1); the weight row-scaled for the forward and per-tensor transposed for the input
    # gradient (3 + 3). 4 kernels.
    "rowwise_with_gw_hp": CastCost(("fp8", "fp8", "high"), SCALED_GEMM_EFFICIENCY, input=3, weight=6, grad_output=1,
                                   memory_efficiency=_RW, kernels=4),
    # torchao MXFP8: every tensor cast along both of its dims in two kernels (read 2, write 1 + 1/32 each;
    # grad_output's first read fused). 6 kernels.
    "mxfp8": CastCost(("mxfp8",) * 3, 1.0, input=6 + 1 / 16, weight=6 + 1 / 16, grad_output=4 + 1 / 16,
                      memory_efficiency=MXFP8_CAST_EFFICIENCY, kernels=6),
    # Transformer Engine per-tensor delayed scaling: no amax pass (the scale comes from the amax history); one fused
    # cast-transpose per tensor (read 2, write 1 + 1), plus the history update. 4 kernels.
    "delayed": CastCost(_F8, 1.0, input=4, weight=4, grad_output=4, memory_efficiency=_TE, kernels=4),
    # Transformer Engine per-tensor current scaling: an amax pass (2) before each fused cast-transpose (4). 6 kernels.
    "current": CastCost(_F8, 1.0, input=6, weight=6, grad_output=6, memory_efficiency=_TE, kernels=6),
    # Transformer Engine 1x128 / 128x128 block scaling (Hopper): one fused cast-transpose per tensor with fp32 scales
    # per 128 (read 2, write 1 + 1 + 8/128); block-scaled GEMMs at the per-row GEMMs' speed. 3 kernels.
    "block": CastCost(_F8, SCALED_GEMM_EFFICIENCY, input=4 + 1 / 16, weight=4 + 1 / 16, grad_output=4 + 1 / 16,
                      memory_efficiency=_TE, kernels=3),
    # Transformer Engine MXFP8: one fused kernel writes both directions (read 2, write 2 * (1 + 1/32)). 3 kernels.
    "mxfp8_te": CastCost(("mxfp8",) * 3, 1.0, input=4 + 1 / 16, weight=4 + 1 / 16, grad_output=4 + 1 / 16,
                         memory_efficiency=_TE, kernels=3),
    # Transformer Engine NVFP4: an amax pass for the per-tensor second-level scale (2), then both directions in fp4
    # with an e4m3 scale per 16 (read 2, write 2 * (0.5 + 1/16)). 6 kernels. The random Hadamard transform and
    # stochastic rounding of the recipe's gradient casts are left out.
    TE_NVFP4: CastCost(("nvfp4",) * 3, 1.0, input=5.125, weight=5.125, grad_output=5.125, memory_efficiency=_TE,
                       kernels=6),
}

# Transformer Engine's MXFP8 is named "mxfp8" as torchao's is: `predicted_saving(..., backend="transformer_engine")`.
_TE_COST = {"mxfp8": "mxfp8_te"}
_HIGH_KINDS = ("bf16", "fp16", "fp32", "tf32")
_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "tf32": 4.0, "fp8": 1.0, "mxfp8": 1.0 + 1 / 32, "nvfp4": 0.5 + 1 / 16}


def _check_shape(owner: str, tokens: Any, in_features: Any, out_features: Any) -> None:
    for arg, value in (("tokens", tokens), ("in_features", in_features), ("out_features", out_features)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < math.inf:
            raise ValueError(f"{owner}({arg}={value!r}): a layer's {arg} must be a finite number >= 0.")


def _high_kind(owner: str, high: str) -> str:
    if high not in _HIGH_KIND:
        raise ValueError(f"{owner}(high={high!r}): the high precision is one of {', '.join(_HIGH_KIND)}.")
    kind = _HIGH_KIND[high]
    # fp32 matmuls run on tf32 tensor cores where torch allows it (as MFU counts them).
    return compute_kind(torch.float32) if kind == "fp32" else kind


def _peak(owner: str, device: GemmDevice, kind: str) -> float:
    if kind not in device.tflops:
        raise ValueError(f"{owner}: the {device.name} has no {kind} tensor cores (its kinds:"
                         f" {', '.join(device.tflops)}); choose among supported_candidates(device, backend).")
    return device.tflops[kind] * 1e12


def gemm_seconds(m: float, k: float, n: float, kind: str, device: GemmDevice, efficiency: float = 1.0,
                 out_kind: str = "bf16") -> float:
    """One ``(m, k) @ (k, n)`` GEMM in ``kind``: compute-bound at ``GEMM_EFFICIENCY`` (high kinds) or
    ``FP8_GEMM_EFFICIENCY`` (fp8, mxfp8, nvfp4) times ``efficiency`` of the peak, or
    memory-bound (operands in ``kind``, output in ``out_kind``), whichever is slower, and never under one kernel."""
    if not m or not k or not n:
        return 0.0
    reached = GEMM_EFFICIENCY if kind in _HIGH_KINDS else FP8_GEMM_EFFICIENCY
    compute = 2 * m * k * n / (_peak("gemm_seconds", device, kind) * reached * efficiency)
    traffic = (m * k + k * n) * _BYTES[kind] + m * n * _BYTES[out_kind]
    return max(compute, traffic / (device.bandwidth * 1e12 * MEMORY_EFFICIENCY), KERNEL_SECONDS)


def high_time(tokens: float, in_features: float, out_features: float, device: GemmDevice, high: str = "bf16") -> float:
    """The layer's three GEMMs per training step in the high dtype, in seconds (to show a saving as a fraction).

    Example:
        >>> device = speed_device("H100 SXM")[0]
        >>> round(high_time(8192, 4096, 4096, device) * 1e3, 3)  # ms: 3 x 2*8192*4096*4096 FLOPs at 0.79 * 989.5
        1.055
    """
    _check_shape("high_time", tokens, in_features, out_features)
    kind = _high_kind("high_time", high)
    m, k, n = tokens, in_features, out_features
    return (gemm_seconds(m, k, n, kind, device, out_kind=kind) + gemm_seconds(m, n, k, kind, device, out_kind=kind)
            + gemm_seconds(k, m, n, kind, device, out_kind=kind))


def _formats(backend: str) -> tuple[str, ...]:
    return TORCHAO_RECIPES if backend == "torchao" else (*TE_RECIPES, TE_NVFP4)


def _cost(owner: str, candidate: str, backend: str | None) -> CastCost:
    """The costs of ``candidate`` under ``backend``; without one, the backend whose format it is (torchao's for
    "mxfp8", the name both have)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{owner}(backend={backend!r}): choose one of {', '.join(BACKENDS)} (or None: the backend"
                         " whose format the candidate is).")
    if backend is None:
        backend = next((b for b in BACKENDS if candidate in _formats(b)), "torchao")
    if candidate not in _formats(backend):
        raise ValueError(f"{owner}(candidate={candidate!r}): not a {backend} format; choose one of"
                         f" {', '.join(_formats(backend))} (or a high label: {', '.join(_HIGH_KIND)}).")
    return CAST_COSTS[_TE_COST.get(candidate, candidate) if backend != "torchao" else candidate]


def predicted_saving(candidate: str, tokens: float, in_features: float, out_features: float, device: GemmDevice,
                     high: str = "bf16", backend: str | None = None) -> float:
    """Seconds per training step saved by running the layer (``tokens`` rows, ``in_features``, ``out_features``) in
    ``candidate`` instead of ``high``: the three GEMMs' time in the high dtype minus theirs in the format and the
    format's casts. Negative where the format is slower; 0.0 for a high label (``"bf16"``, ``"fp16"``, ``"fp32"``,
    ``"high"``) and for a layer that saw no tokens. ``backend``: whose format ``candidate`` is; None: the backend
    that has a format of that name (torchao for ``"mxfp8"``, which both have). A prediction, not a measurement.

    Example:
        >>> device = speed_device("H100 SXM")[0]
        >>> big, small = (16384, 8192, 8192), (1024, 1024, 1024)
        >>> predicted_saving("tensorwise", *big, device) > predicted_saving("rowwise", *big, device) > 0
        True
        >>> predicted_saving("tensorwise", *small, device) < 0
        True
    """
    _check_shape("predicted_saving", tokens, in_features, out_features)
    if candidate in _HIGH_KIND:
        return 0.0
    cost = _cost("predicted_saving", candidate, backend)
    base = _high_kind("predicted_saving", high)
    kinds = [base if kind == "high" else kind for kind in cost.kinds]
    for kind in kinds:
        _peak(f"predicted_saving({candidate!r})", device, kind)
    m, k, n = tokens, in_features, out_features
    if not m or not k or not n:
        return 0.0
    # forward (m, k) @ (k, n), input gradient (m, n) @ (n, k), weight gradient (k, m) @ (m, n); fp8 GEMMs write bf16.
    shapes = ((m, k, n), (m, n, k), (k, m, n))
    low = sum(gemm_seconds(*shape, kind, device, 1.0 if kind == base else cost.gemm_efficiency,
                           base if kind == base else "bf16")
              for shape, kind in zip(shapes, kinds, strict=True))
    cast_bytes = m * k * cost.input * INPUT_CAST_FACTOR + n * k * cost.weight + m * n * cost.grad_output
    casts = cast_bytes / (device.bandwidth * 1e12 * cost.memory_efficiency) + cost.kernels * KERNEL_SECONDS
    return high_time(m, k, n, device, high) - low - casts

