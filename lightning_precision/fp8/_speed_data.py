"""The measurements the speed model (``fp8._speed``) is checked against, kept as data: each one a device, where the
number comes from and what it timed, the linear layers' forward (M, K, N) that ran in the format, the format, and the
measured speedup over bf16. A single-layer measurement has one shape; a whole-model one lists every converted layer
(the model's saving summed over them must have the measured sign). tests/fp8/test_speed_signs.py checks every row;
``python benchmarks/gemm_speed.py`` prints the model beside each.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = [
    "GPU_MD_H200_VIT_H",
    "MEASUREMENTS",
    "MEASUREMENT_SETS",
    "TORCHAO_B200_LLAMA3_8B",
    "TORCHAO_H100_LLAMA3_8B",
    "TORCHAO_H100_ROWWISE",
    "TORCHAO_H100_TENSORWISE",
    "SpeedMeasurement",
    "calibrated_on",
]


@dataclass(frozen=True)
class SpeedMeasurement:
    """One measured speedup of ``recipe`` over bf16 on ``device`` (a speed-table name), for the linear layers
    ``layers`` ((M, K, N) each: tokens, in_features, out_features) that ran in the format. ``speedup`` exactly 1.0
    is break-even (either sign of the predicted saving agrees)."""

    device: str
    source: str
    recipe: str
    layers: tuple[tuple[int, int, int], ...]
    speedup: float


_TORCHAO_MICRO = ("LayerNorm -> Linear -> Sigmoid forward + backward, torch.compile, H100 SXM; the LayerNorm and"
                  " Sigmoid run in bf16 on both sides (they pull the speedup towards 1, never across it)")

# pytorch/ao docs/static/fp8-rowwise-perf.png ("dynamic row-wise scaling, PyTorch 2.8.0a0"), linked from
# torchao/float8/README.md "Performance" (commit fdddb2cfa); M and K over 1024..32768 (rows), N over the same.
_SWEEP = (1024, 2048, 4096, 8192, 16384, 32768)
# Two lines per M (1024 first): the speedups at K = 1024, 2048, 4096, then 8192, 16384, 32768, each over N (six).
_ROWWISE_SPEEDUPS = (
    "0.42 0.42 0.50 0.51 0.56 0.56  0.40 0.38 0.42 0.50 0.50 0.56  0.48 0.43 0.46 0.53 0.57 0.60",
    "0.45 0.48 0.54 0.62 0.60 0.62  0.46 0.48 0.54 0.60 0.60 0.61  0.45 0.50 0.55 0.60 0.62 0.65",
    "0.43 0.43 0.48 0.55 0.62 0.65  0.38 0.45 0.58 0.65 0.72 0.75  0.43 0.50 0.68 0.78 0.81 0.82",
    "0.46 0.58 0.73 0.82 0.87 0.89  0.48 0.62 0.75 0.83 0.84 0.85  0.50 0.64 0.75 0.84 0.83 0.99",
    "0.45 0.47 0.57 0.66 0.72 0.76  0.43 0.53 0.70 0.83 0.90 0.91  0.44 0.64 0.84 1.01 1.01 1.04",
    "0.53 0.72 0.91 1.01 1.07 1.13  0.53 0.74 0.92 1.05 1.10 1.18  0.54 0.75 0.93 1.02 1.17 1.18",
    "0.48 0.52 0.65 0.77 0.83 0.84  0.45 0.64 0.82 1.01 1.03 1.06  0.52 0.76 1.00 1.13 1.17 1.19",
    "0.59 0.85 1.05 1.20 1.31 1.41  0.58 0.82 1.03 1.22 1.37 1.40  0.59 0.82 1.04 1.30 1.36 1.46",
    "0.48 0.58 0.73 0.86 0.85 0.89  0.51 0.70 0.90 1.05 1.07 1.15  0.57 0.79 1.02 1.20 1.26 1.40",
    "0.61 0.87 1.08 1.33 1.39 1.49  0.59 0.83 1.07 1.34 1.42 1.55  0.60 0.85 1.16 1.35 1.48 1.72",
    "0.51 0.62 0.77 0.87 0.88 0.94  0.54 0.73 0.91 1.08 1.14 1.27  0.59 0.81 1.04 1.28 1.35 1.49",
    "0.63 0.87 1.11 1.41 1.50 1.62  0.60 0.83 1.16 1.39 1.49 1.73  0.63 0.93 1.16 1.48 1.70 1.52",
)
TORCHAO_H100_ROWWISE: tuple[SpeedMeasurement, ...] = tuple(
    SpeedMeasurement("H100 SXM", f"torchao docs/static/fp8-rowwise-perf.png: {_TORCHAO_MICRO}", "rowwise", (shape,),
                     float(value))
    for shape, value in zip(itertools.product(_SWEEP, _SWEEP, _SWEEP),
                            (v for line in _ROWWISE_SPEEDUPS for v in line.split()), strict=True))
# The README's two worked examples from its tensorwise table (torchao/float8/README.md "Performance", commits
# e2dad4a66..4b119edb6; the table itself is an image outside the repository).
TORCHAO_H100_TENSORWISE: tuple[SpeedMeasurement, ...] = tuple(
    SpeedMeasurement("H100 SXM", f"torchao/float8/README.md worked example: {_TORCHAO_MICRO}", "tensorwise",
                     (shape,), value)
    for shape, value in (((1024, 2048, 1024), 0.80), ((4096, 8192, 16384), 1.39)))


def _llama3_8b(tokens: int = 8192) -> tuple[tuple[int, int, int], ...]:
    """Llama3-8B's 224 block linear layers (wq, wk, wv, wo, w1, w3, w2; d 4096, 8 KV heads of 128, ffn 14336) at
    ``tokens`` per GPU; torchtitan keeps the output head in bf16 (it would save too: the sign does not hang on it)."""
    d, kv, ffn = 4096, 1024, 14336
    block = ((tokens, d, d), (tokens, d, kv), (tokens, d, kv), (tokens, d, d), (tokens, d, ffn), (tokens, d, ffn),
             (tokens, ffn, d))
    return block * 32


_TITAN = ("Llama3-8B torchtitan tokens/s, 8 GPUs, batch 1, sequence 8192, torch.compile, FSDP2, per-op SAC (whole"
          " model: attention, norms and communication included)")
# torchao docs/source/workflows/training.md (was torchao/float8/README.md, commit 4b119edb6), "NVIDIA H100":
# bf16 6150, tensorwise with float8 all-gather 7689.5 (+25.03%), rowwise with bf16 all-gather 6768 (+10.05%).
TORCHAO_H100_LLAMA3_8B: tuple[SpeedMeasurement, ...] = tuple(
    SpeedMeasurement("H100 SXM", f"torchao docs/source/workflows/training.md: {_TITAN}", recipe, _llama3_8b(), value)
    for recipe, value in (("tensorwise", 7689.5 / 6150), ("rowwise", 6768 / 6150)))
# torchao docs/source/workflows/training.md "Training e2e benchmarks on NVIDIA B200" (was
# torchao/prototype/mx_formats/README.md, commit 49cb18a66), power-limited B200s: bf16 8307.5, tensorwise 10417.0
# (+25.4%), mxfp8_cublas 9969.0 (+20.0%), rowwise 8640.5 (+4.0%).
TORCHAO_B200_LLAMA3_8B: tuple[SpeedMeasurement, ...] = tuple(
    SpeedMeasurement("B200", f"torchao docs/source/workflows/training.md: {_TITAN}", recipe, _llama3_8b(), value)
    for recipe, value in (("tensorwise", 10417.0 / 8307.5), ("mxfp8", 9969.0 / 8307.5), ("rowwise", 8640.5 / 8307.5)))

# ../shared/GPU.md "fp8, compiled": a ViT-H-sized stack (4 pre-norm blocks, d 1280, 16 heads, mlp 5120, 197 tokens,
# batch 64: M = 12,608), a compiled LightningModule, AdamW; FP8Precision(recipe="tensorwise") 18.5 ms a step against
# BF16MixedPrecision() 17.0 ms. The default selection converted 15 layers: every block's qkv, proj, fc1 and fc2 but
# blocks.0.qkv (the first layer), the head (1280x1000: not divisible by 16) kept high.
_VIT_M = 64 * 197
GPU_MD_H200_VIT_H: tuple[SpeedMeasurement, ...] = (
    SpeedMeasurement(
        "H200 SXM", "../shared/GPU.md (2026-11-28): ViT-H-sized stack, torch.compile, Lightning fit, H200 SXM, torch"
        " 2.11, torchao 0.18 (whole model)", "tensorwise",
        ((_VIT_M, 1280, 3840),) * 3 + ((_VIT_M, 1280, 1280), (_VIT_M, 1280, 5120), (_VIT_M, 5120, 1280)) * 4,
        17.0 / 18.5),
)

# Each set by the name the benchmark prints it under, and all of them.
MEASUREMENT_SETS: dict[str, tuple[SpeedMeasurement, ...]] = {
    "torchao H100 rowwise": TORCHAO_H100_ROWWISE, "torchao H100 tensorwise": TORCHAO_H100_TENSORWISE,
    "torchao Llama3-8B H100": TORCHAO_H100_LLAMA3_8B, "torchao Llama3-8B B200": TORCHAO_B200_LLAMA3_8B,
    "GPU.md ViT-H H200": GPU_MD_H200_VIT_H,
}
MEASUREMENTS: tuple[SpeedMeasurement, ...] = tuple(row for rows in MEASUREMENT_SETS.values() for row in rows)
# What, beyond the rows above, each device's figures rest on (the H200's raw GEMM rates set the GEMM efficiencies).
_EXTRA = {"H200 SXM": "its raw GEMMs (8192^3: bf16 783, fp8 1453 TFLOP/s; ../shared/GPU.md)"}


def calibrated_on(device: str) -> str:
    """What the speed model's figures for ``device`` (a speed-table name) were checked against: the measurement sets
    on that device, or that there are none (its datasheet peaks and bandwidth, with the efficiencies fitted on the
    H100 and H200).

    Example:
        >>> calibrated_on("H200 SXM").split("; ")[0]
        'H200 SXM: a ViT-H-sized stack compiled (tensorwise, whole model)'
        >>> calibrated_on("L4")
        'L4: not calibrated: datasheet peaks and bandwidth only, with the efficiencies fitted on the H100 and H200'
    """
    sets = [(TORCHAO_H100_ROWWISE, "torchao's rowwise table (216 shapes)"),
            (TORCHAO_H100_TENSORWISE, "torchao's tensorwise examples (2 shapes)"),
            (TORCHAO_H100_LLAMA3_8B, "torchao's Llama3-8B runs (tensorwise, rowwise; whole model)"),
            (TORCHAO_B200_LLAMA3_8B, "torchao's Llama3-8B runs (tensorwise, mxfp8, rowwise; whole model)"),
            (GPU_MD_H200_VIT_H, "a ViT-H-sized stack compiled (tensorwise, whole model)")]
    found = [label for rows, label in sets if rows[0].device == device]
    if device in _EXTRA:
        found.append(_EXTRA[device])
    if not found:
        return (f"{device}: not calibrated: datasheet peaks and bandwidth only, with the efficiencies fitted on the"
                " H100 and H200")
    return f"{device}: {'; '.join(found)}"
