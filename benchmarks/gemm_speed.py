"""The speed model (lightning_precision/fp8/_speed.py) against every measurement kept beside it
(lightning_precision/fp8/_speed_data.py): torchao's published H100 rowwise table and tensorwise examples, torchao's
Llama3-8B runs on H100 and B200, and the ViT-H-sized stack measured on an H200 (../shared/GPU.md). Runs anywhere.

For each row: the device, the format, the shape (or the number of layers of a whole-model measurement), the measured
speedup over bf16, the model's speedup and whether the sign of the predicted saving agrees (a measured 1.00x is
break-even: either sign agrees). For torchao's single-layer rows the model's speedup counts the benchmark's LayerNorm
(over M x K) and Sigmoid (over M x N) as 10 bytes per element each at the tuned bandwidth plus 4 kernels, the same in
both, as the benchmark runs them; for a whole-model row it is the converted layers' GEMMs alone (the rest of the step
is not modelled), so only its sign compares. Then the count of agreements per set and the RMS of the log-speedup error
over torchao's single-layer rows.

``--fit``: the constants the model was fitted with, searched again on a grid (per-tensor and per-row cast
efficiencies, the input's cast factor): each combination's agreements and RMS, best first.

``--measure``: on a CUDA GPU with fp8, for a grid of shapes and each torchao format the GPU runs, the model's predicted
saving beside the one timed there the way ``FP8Precision`` times a layer (``fp8._timing``: forward and backward, the
one-layer module compiled; ``--eager`` without torch.compile), through its cache.

    python benchmarks/gemm_speed.py            # every row, predicted beside measured
    python benchmarks/gemm_speed.py --fit      # the grid the cast constants were chosen on
    python benchmarks/gemm_speed.py --measure  # predicted beside timed, on a CUDA GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_precision.fp8 import _speed
from lightning_precision.fp8._speed import KERNEL_SECONDS, MEMORY_EFFICIENCY, high_time, predicted_saving, speed_device
from lightning_precision.fp8._speed_data import MEASUREMENT_SETS as SETS
from lightning_precision.fp8._speed_data import SpeedMeasurement


def predict(row: SpeedMeasurement) -> tuple[float, float, bool]:
    """The model's speedup, saving (seconds) and whether its sign agrees with the measurement."""
    device = speed_device(row.device)[0]
    saving = sum(predicted_saving(row.recipe, *shape, device) for shape in row.layers)
    high = sum(high_time(*shape, device) for shape in row.layers)
    if len(row.layers) == 1:  # torchao's LayerNorm -> Linear -> Sigmoid: the same bf16 ops on both sides
        m, k, n = row.layers[0]
        high += 10 * (m * k + m * n) / (device.bandwidth * 1e12 * MEMORY_EFFICIENCY) + 4 * KERNEL_SECONDS
    agrees = row.speedup == 1.0 or (saving > 0) == (row.speedup > 1)
    return high / (high - saving), saving, agrees


def summary() -> tuple[int, int, float]:
    """Agreements, rows, and the RMS log error over torchao's single-layer rows."""
    rows = [row for rows in SETS.values() for row in rows]
    results = [predict(row) for row in rows]
    errors = [math.log(r[0] / row.speedup) ** 2 for row, r in zip(rows, results, strict=True) if len(row.layers) == 1]
    return sum(r[2] for r in results), len(rows), math.sqrt(sum(errors) / len(errors))


def show() -> None:
    print("set                      device     format       M      K      N  measured  model  saving ms  sign")
    for name, rows in SETS.items():
        agree = 0
        for row in rows:
            speedup, saving, agrees = predict(row)
            agree += agrees
            one = len(row.layers) == 1
            shape = " ".join(f"{d:>6}" for d in row.layers[0]) if one else f"{len(row.layers):>13} layers"
            print(f"{name:<24} {row.device:<10} {row.recipe:<10} {shape} {row.speedup:>8.2f} {speedup:>6.2f}"
                  f" {saving * 1e3:>10.3f}  {'agrees' if agrees else 'DIFFERS'}")
        print(f"{name}: signs agree on {agree} of {len(rows)}")
    agree, total, rms = summary()
    print(f"all: signs agree on {agree} of {total}; torchao's single-layer rows: RMS log-speedup error {rms:.3f}")


@contextmanager
def constants(tensorwise: float, rowwise: float, input_factor: float) -> Iterator[None]:
    """The model with other cast constants, restored after."""
    saved = dict(_speed.CAST_COSTS), _speed.INPUT_CAST_FACTOR
    for name, efficiency in (("tensorwise", tensorwise), ("rowwise", rowwise), ("rowwise_with_gw_hp", rowwise)):
        _speed.CAST_COSTS[name] = dataclasses.replace(_speed.CAST_COSTS[name], memory_efficiency=efficiency)
    _speed.INPUT_CAST_FACTOR = input_factor
    try:
        yield
    finally:
        _speed.CAST_COSTS.update(saved[0])
        _speed.INPUT_CAST_FACTOR = saved[1]


def fit() -> None:
    results = []
    for tensorwise, rowwise, factor in itertools.product((0.3, 0.33, 0.36, 0.4, 0.5, 0.6), (0.4, 0.425, 0.45, 0.5),
                                                         (1.0, 1.2, 1.4, 1.6)):
        with constants(tensorwise, rowwise, factor):
            agree, total, rms = summary()
        results.append((-agree, rms, tensorwise, rowwise, factor))
    print("tensorwise  rowwise  input factor  agree  RMS")
    for minus_agree, rms, tensorwise, rowwise, factor in sorted(results)[:15]:
        print(f"{tensorwise:>10.3f} {rowwise:>8.3f} {factor:>13.1f} {-minus_agree:>6} {rms:>5.3f}")


def measure(compiled: bool) -> None:
    from lightning_precision.fp8._speed import supported_candidates
    from lightning_precision.fp8._timing import LayerShape, cuda_timer, time_shapes

    timer = cuda_timer(emulate=False)
    if timer is None:
        raise SystemExit("--measure needs a CUDA GPU; run without it for the published comparison.")
    device, predicted = speed_device()
    print(f"{timer.device} as {device.name}{' (not in the table: predicted as it)' if predicted else ''};"
          f" {'compiled' if compiled else 'eager'}")
    print("format                  M      K      N  predicted ms  measured ms")
    shapes = {f"{m}x{k}x{n}": LayerShape(m, k, n, False) for m, k, n in (
        (1024, 1024, 1024), (4096, 4096, 4096), (12608, 1280, 5120), (8192, 4096, 14336), (8192, 14336, 4096),
        (16384, 8192, 8192))}
    formats = supported_candidates(device, "torchao")
    timed = time_shapes(shapes, formats, "bf16", compiled, timer)
    for fmt in formats:
        for name, (m, k, n, _) in shapes.items():
            print(f"{fmt:<20} {m:>6} {k:>6} {n:>6} {predicted_saving(fmt, m, k, n, device) * 1e3:>13.3f}"
                  f" {timed.saving(fmt, name) * 1e3:>12.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="search the cast constants again on a grid")
    parser.add_argument("--measure", action="store_true", help="time the formats on this CUDA GPU")
    parser.add_argument("--eager", action="store_true", help="with --measure: time without torch.compile")
    args = parser.parse_args()
    fit() if args.fit else measure(not args.eager) if args.measure else show()
