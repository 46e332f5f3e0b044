"""Cost of GradientUnderflowMonitor's measuring step on a ~100M-parameter set of gradients: time per element and the
extra peak memory over the gradients themselves.

    python benchmarks/monitor_cost.py [--params 100] [--rounds 3]

The gradients have the shapes of a 100M-parameter transformer (the largest, a 32000x2048 embedding, is 256 MB) with
values spread over fp16's whole range and beyond, so every counting branch is exercised. Each round runs in a fresh
process: peak resident memory is reset (``/proc/self/clear_refs``) after the gradients exist, so the figure is what the
measurement itself adds. Prints ns per element, the extra peak in MB, and that peak as a multiple of the largest
gradient.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _shapes(millions: int) -> list[tuple[int, ...]]:
    """A transformer's gradient shapes adding up to about ``millions`` x 1e6 elements."""
    import math

    shapes: list[tuple[int, ...]] = [(32000, 2048)]  # embedding: 65.5M elements, 256 MB
    while sum(math.prod(s) for s in shapes) < millions * 1e6:
        shapes += [(2048, 2048), (2048, 2048), (8192, 2048), (2048, 8192), (2048,), (2048,)]
    return shapes


def _round(millions: int) -> dict:
    import torch

    from lightning_precision.callbacks import GradientUnderflowMonitor

    torch.manual_seed(0)
    grads = {}
    for i, shape in enumerate(_shapes(millions)):
        # log-uniform magnitudes from 2**-40 to 2**20, random signs, a few exact zeros
        g = torch.empty(shape).uniform_(-40, 20).exp2_() * torch.randint(0, 2, shape).mul_(2).sub_(1)
        g[..., :3] = 0.0
        grads[f"layer{i}.weight"] = g
    numel = sum(g.numel() for g in grads.values())
    largest = max(g.numel() * g.element_size() for g in grads.values())
    monitor = GradientUnderflowMonitor(warn_threshold=1.0)
    scale = torch.tensor(2.0**16)
    monitor.measure_gradients({"warmup": torch.randn(1000)}, loss_scale=scale)
    monitor.compute()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size to the current one
    base = _vm("VmRSS:")
    t0 = time.perf_counter()
    monitor.measure_gradients(grads, loss_scale=scale)
    metrics = monitor.compute()
    float(metrics["precision/underflow/fp16"])  # the counts are device tensors: read one so all work is done
    seconds = time.perf_counter() - t0
    peak = _vm("VmHWM:") - base
    return {"numel": numel, "seconds": seconds, "peak_bytes": peak, "largest_bytes": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100, help="millions of gradient elements (default 100)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(_round(args.params)))
        return
    results = []
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, __file__, "--_child", "--params", str(args.params)], check=True,
                             capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    numel, largest = results[0]["numel"], results[0]["largest_bytes"]
    ns = statistics.median(r["seconds"] for r in results) * 1e9 / numel
    peak = statistics.median(r["peak_bytes"] for r in results)
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {numel / 1e6:.1f}M gradient elements,"
          f" largest gradient {largest / 2**20:.0f} MB, {args.rounds} rounds (medians)")
    print(f"measuring step: {statistics.median(r['seconds'] for r in results):.2f} s = {ns:.1f} ns/element")
    print(f"extra peak memory: {peak / 2**20:.0f} MB = {peak / largest:.2f} x the largest gradient")


if __name__ == "__main__":
    main()
