"""Cost of GradientUnderflowMonitor's measuring step against one read of the same gradients, and its extra peak memory.

    python benchmarks/monitor_cost.py [--numel 1e6,1e7,1e8] [--rounds 7] [--threads 1] [--device cpu]

For each size, a set of gradients shaped like a transformer's (an embedding of a quarter of the elements, six matrices
of an eighth; values log-uniform over 2**-40 .. 2**20 with random signs and a few exact zeros, so every count and most
histogram bins are hit) is measured by the monitor's measuring step (``measure_gradients`` with a loss scale, then
``compute``, which reads the counts: every format's counts, the scaled fp16 counts and the exponent histogram), and read
once: ``torch.aminmax(g)`` of each gradient (max |g|), the least any measurement of |g| must do (each element read
once, one reduction, no temporary), in the same process, alternated, in paired rounds. CPU time per variant
(``time.process_time``; the wall clock on a GPU, synchronised); the ratio is taken per round, printed as median [IQR].

Extra peak memory: in a fresh process per size, the peak over the gradients themselves while one measuring step runs
(resident set on the CPU, reset through ``/proc/self/clear_refs`` once the gradients exist; ``max_memory_allocated``
on a GPU), as a multiple of the largest gradient.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _gradients(numel: int, device: str) -> dict:
    import torch

    torch.manual_seed(0)
    shapes = [(numel // 4,)] + [(numel // 8,)] * 6
    grads = {}
    for i, shape in enumerate(shapes):
        g = torch.empty(shape, device=device).uniform_(-40, 20).exp2_()
        g *= torch.randint(0, 2, shape, device=device).mul_(2).sub_(1)
        g[:3] = 0.0
        grads[f"layer{i}.weight"] = g
    return grads


def _monitor():
    from lightning_precision.callbacks import GradientUnderflowMonitor

    return GradientUnderflowMonitor(warn_threshold=1.0)


def _measure(monitor, grads: dict, scale) -> None:
    monitor.measure_gradients(grads, loss_scale=scale)
    metrics = monitor.compute()
    float(metrics["precision/underflow/fp16"])  # the counts are device tensors: read one so all work is done


def _read(grads: dict) -> None:
    import torch

    # max |g| of every gradient, each in one pass with no temporary: ``aminmax`` (``g.abs().amax()`` and
    # ``_foreach_norm`` write |g| out first, and on a 100 MB gradient those page faults cost ten times the read)
    top = torch.stack([torch.stack(torch.aminmax(g)).abs().amax() for g in grads.values()]).amax()
    float(top)


def _timed(fn, device: str) -> float:
    import torch

    if device == "cpu":
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_round(numel: int, rounds: int, device: str) -> dict:
    import torch

    grads = _gradients(numel, device)
    monitor = _monitor()
    scale = torch.tensor(2.0**16, device=device)
    _measure(monitor, grads, scale)  # warm-up: caches, first allocations
    _read(grads)
    reads, measures = [], []
    for i in range(rounds):
        pair = [("read", lambda: _read(grads)), ("measure", lambda: _measure(monitor, grads, scale))]
        for name, fn in pair if i % 2 == 0 else pair[::-1]:
            (reads if name == "read" else measures).append(_timed(fn, device))
    return {"read": reads, "measure": measures, "numel": sum(g.numel() for g in grads.values())}


def memory_round(numel: int, device: str) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import process_bytes  # in the child: the parent imports no torch

    grads = _gradients(numel, device)
    monitor = _monitor()
    scale = torch.tensor(2.0**16, device=device)
    _measure(monitor, {"warmup": torch.randn(1000, device=device)}, scale)
    largest = max(g.numel() * g.element_size() for g in grads.values())
    if device == "cpu":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident size to the current one
        base = process_bytes("VmRSS:")
        _measure(monitor, grads, scale)
        peak = process_bytes("VmHWM:") - base
    else:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _measure(monitor, grads, scale)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    return {"peak": peak, "largest": largest}


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", default="1e6,1e7,1e8", help="gradient elements per set, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU")
    parser.add_argument("--_child", choices=("time", "memory"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(float(n)) for n in args.numel.split(",")]
    if args._child:
        out = time_round(sizes[0], args.rounds, args.device) if args._child == "time" else \
            memory_round(sizes[0], args.device)
        print(json.dumps(out))
        return
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads() if not args.threads else args.threads}"
          f" threads, {args.rounds} paired rounds, load average {os.getloadavg()[0]:.1f}")
    print("| gradient elements | one read (ns/element) | measuring step (ns/element) | ratio, median [IQR] |"
          " extra peak memory | x the largest gradient |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        def child(kind: str, n: int = n) -> dict:
            cmd = [sys.executable, __file__, "--_child", kind, "--numel", str(n), "--rounds", str(args.rounds),
                   "--device", args.device] + (["--threads", str(args.threads)] if args.threads else [])
            return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])

        t, m = child("time"), child("memory")
        ratios = [b / a for a, b in zip(t["read"], t["measure"], strict=True)]
        lo, mid, hi = _quartiles(ratios)
        read_ns = statistics.median(t["read"]) * 1e9 / t["numel"]
        measure_ns = statistics.median(t["measure"]) * 1e9 / t["numel"]
        print(f"| {n:.0e} | {read_ns:.2f} | {measure_ns:.2f} | {mid:.1f}x [{lo:.1f}, {hi:.1f}] |"
              f" {m['peak'] / 2**20:.1f} MB | {m['peak'] / m['largest']:.2f}x |")


if __name__ == "__main__":
    main()
