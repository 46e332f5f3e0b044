"""The speed model (lightning_precision/fp8/_speed.py) against numbers: torchao's published H100 speedups (runs
anywhere), or this CUDA GPU's own timings (``--measure``).

``--published`` (the default): for each (M, K, N) of torchao's rowwise table and the README's tensorwise examples, the
published speedup of LayerNorm -> Linear -> Sigmoid forward + backward over bf16, the model's speedup of the linear
layer alone, and of the three ops (the LayerNorm over M x K and the Sigmoid over M x N counted as 10 bytes per element
each at the tuned bandwidth, 4 kernels: the same in both, which pulls the speedup towards 1), and whether the saving's
sign agrees.

``--measure``: on a CUDA GPU, for a grid of shapes and each torchao format the GPU runs, ``predicted_saving`` beside
``benchmark_saving`` (eager, no torch.compile: unfused casts, so the measured saving is below a compiled run's) and
their ratio.

    python benchmarks/gemm_speed.py                  # predicted vs torchao's published (CPU is fine)
    python benchmarks/gemm_speed.py --measure        # predicted vs measured, on a CUDA GPU
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from lightning_precision.fp8._speed import (
    KERNEL_SECONDS,
    MEMORY_EFFICIENCY,
    TORCHAO_H100_ROWWISE,
    TORCHAO_H100_TENSORWISE,
    benchmark_saving,
    high_time,
    predicted_saving,
    speed_device,
    supported_candidates,
)


def published() -> None:
    device = speed_device("H100 SXM")[0]

    def others(m: int, k: int, n: int) -> float:
        return 10 * (m * k + m * n) / (device.bandwidth * 1e12 * MEMORY_EFFICIENCY) + 4 * KERNEL_SECONDS

    print("recipe      M      K      N  published  model linear  model LN+linear+sigmoid  sign")
    agree = total = 0
    log_errors = []
    for recipe, table in (("tensorwise", TORCHAO_H100_TENSORWISE), ("rowwise", TORCHAO_H100_ROWWISE)):
        for (m, k, n), speedup in table.items():
            high, saving = high_time(m, k, n, device), predicted_saving(recipe, m, k, n, device)
            linear, e2e = high / (high - saving), (high + others(m, k, n)) / (high + others(m, k, n) - saving)
            same = (saving > 0) == (speedup > 1)
            agree, total = agree + same, total + 1
            if recipe == "rowwise":
                log_errors.append(math.log(e2e / speedup) ** 2)
            print(f"{recipe:<10} {m:>6} {k:>6} {n:>6} {speedup:>9.2f} {linear:>13.2f} {e2e:>24.2f}  "
                  f"{'agrees' if same else 'DIFFERS'}")
    print(f"signs agree: {agree} of {total}; rowwise, model LN+linear+sigmoid vs published: RMS log error"
          f" {math.sqrt(sum(log_errors) / len(log_errors)):.3f}")


def measure(steps: int) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--measure needs a CUDA GPU; run without it for the published comparison.")
    device, predicted = speed_device()
    candidates = supported_candidates(device, "torchao")
    print(f"{torch.cuda.get_device_name()} as {device.name}{' (not in the table: predicted)' if predicted else ''}")
    print("format                  M      K      N  predicted ms  measured ms  measured/predicted")
    for m, k, n in ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096),
                    (16384, 8192, 8192), (16384, 16384, 16384)):
        layer = nn.Linear(k, n, bias=False)
        for candidate in candidates:
            guess = predicted_saving(candidate, m, k, n, device)
            got = benchmark_saving(layer, candidate, m, steps=steps)
            print(f"{candidate:<20} {m:>6} {k:>6} {n:>6} {guess * 1e3:>13.3f} {got * 1e3:>12.3f}"
                  f" {got / guess if guess else math.nan:>19.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="time the formats on this CUDA GPU")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layer and format (--measure)")
    args = parser.parse_args()
    measure(args.steps) if args.measure else published()
