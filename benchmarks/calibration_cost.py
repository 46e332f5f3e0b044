"""What a ``FP8Precision(layers="auto")`` calibration step costs against a bf16 step: time and peak memory.

    python benchmarks/calibration_cost.py [--device cpu] [--threads 1] [--rounds 15] [--width 1024] [--depth 6]
                                          [--batch 256] [--recipe tensorwise]

Two Fabric loops in this process on the same MLP (``--depth`` linear layers of ``--width``, GELU between, seed 0) and
the same batches: one under ``BF16MixedPrecision``, one under ``FP8Precision(layers="auto")`` with the shape rules off
and more calibration batches than the run has, so every one of its steps is a calibration step (each linear layer
measured: its casts' numerics, its fp8 output and input gradient against the reference). A step is forward, backward,
optimizer step, ``zero_grad``. The two alternate step by step; each round's ratio is the calibration step's time over
the bf16 step's next to it (CPU time of this process on a CPU: other processes on a shared machine disturb it less;
wall time with a device synchronize on a GPU); median and IQR over the rounds. Goal: <= 2.

Peak memory, two ways. Tensors: the largest sum of the live tensor storages during one step (a ``TorchDispatchMode``
that watches every storage an operator returns, by weak reference), plus what lives across steps (parameters,
optimizer states, the probe's sums), for each loop; the ratio of the two. Goal: <= 1.15. Temporaries made inside a
tensor subclass's own dispatch (torchao's emulated fp8 matmul upcasts its operands) are not seen by the mode: on a
GPU, ``torch.cuda.max_memory_allocated`` is printed beside it and sees everything. Process (CPU): each loop alone in
a child process of its own, 5 steps: the peak resident set (``VmHWM``, reset before the first step) above the
resident set before the first step, which also holds what the allocator keeps of freed temporaries.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
import warnings
import weakref
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from lightning_precision.fabric import BF16MixedPrecision, FP8Precision


class PeakStorage(TorchDispatchMode):
    """The peak of the summed bytes of the tensor storages that operators return while it is on: a storage counts from
    the operator that made it until its last reference goes."""

    def __init__(self) -> None:
        super().__init__()
        self.live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.refs: list[weakref.ref] = []
        self.now = 0
        self.peak = 0

    def _free(self, nbytes: int, _ref: Any) -> None:
        self.now -= nbytes

    def _seen(self, t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):  # a subclass: its inner tensors were seen
            return
        storage = t.untyped_storage()
        if storage in self.live:
            return
        nbytes = storage.nbytes()
        self.live[storage] = nbytes
        self.refs.append(weakref.ref(storage, functools.partial(self._free, nbytes)))
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._seen, out)
        return out


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, plugin: Any) -> int:
    """What lives across steps: parameters, optimizer states, and the calibration probe's sums."""
    tensors = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()
                                          if isinstance(v, torch.Tensor)]
    calibration = getattr(plugin, "_calibration", None)
    if calibration is not None:
        state = calibration.probe.state
        tensors += [state[name] for name in ("sums", "staged", "finite") if name in state]
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(width, width)] + ([nn.GELU()] if i < depth - 1 else [])
    return nn.Sequential(*layers)


class Loop:
    def __init__(self, plugin: Any, args: argparse.Namespace) -> None:
        self.plugin = plugin
        self.fabric = L.Fabric(accelerator=args.device, devices=1, plugins=[plugin])
        model = mlp(args.width, args.depth).to(args.device)
        self.model, self.optimizer = self.fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        self.raw = model

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.mse_loss(self.model(x).float(), y)
        self.fabric.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def plugin(name: str, args: argparse.Namespace) -> Any:
    if name == "bf16":
        return BF16MixedPrecision()
    return FP8Precision(layers="auto", recipe=args.recipe, calibration_batches=10**9, emulate=True,
                        skip_small_layers=False, skip_first_last=False)


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def rss_above_start(name: str) -> int:
    """Peak resident bytes above those before the first step, of ``name``'s loop alone in a child process."""
    out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", name], capture_output=True, text=True,
                         check=True).stdout
    return int(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--child", choices=["bf16", "auto"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.batch, args.width, generator=g).to(device),
                torch.randn(args.batch, args.width, generator=g).to(device)) for _ in range(4)]
    if args.child:
        loop = Loop(plugin(args.child, args), args)
        with open("/proc/self/clear_refs", "w") as f:  # the peak resident set starts again from here
            f.write("5")
        before = status_kib("VmRSS")
        for i in range(5):
            loop.step(*batches[i % len(batches)])
        print((status_kib("VmHWM") - before) * 1024)
        return
    bf16 = Loop(plugin("bf16", args), args)
    auto = Loop(plugin("auto", args), args)

    def timed(loop: Loop, i: int) -> float:
        if cuda:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        else:
            t0 = time.process_time()
        loop.step(*batches[i % len(batches)])
        if cuda:
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        return time.process_time() - t0

    for i in range(3):  # warm-up: allocator, thread pool, the optimizer's states
        timed(bf16, i)
        timed(auto, i)
    ratios, t_bf16, t_auto = [], [], []
    for i in range(args.rounds):
        if i % 2 == 0:  # alternated: neither always runs second
            a = timed(bf16, i)
            b = timed(auto, i)
        else:
            b = timed(auto, i)
            a = timed(bf16, i)
        t_bf16.append(a)
        t_auto.append(b)
        ratios.append(b / a)

    peaks: dict[str, int] = {}
    device_peaks: dict[str, int] = {}
    for name, loop in (("bf16", bf16), ("auto", auto)):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with PeakStorage() as mode:
            loop.step(*batches[0])
        base = persistent_bytes(loop.raw, loop.optimizer, loop.plugin)
        peaks[name] = base + mode.peak
        if cuda:
            device_peaks[name] = torch.cuda.max_memory_allocated()

    def q(xs: list[float]) -> str:
        qs = statistics.quantiles(xs, n=4)
        return f"{statistics.median(xs):.3f} [{qs[0]:.3f}-{qs[2]:.3f}]"

    params = sum(p.numel() * 4 for p in bf16.raw.parameters())
    print(f"MLP {args.depth}x{args.width} ({params / 2**20:.1f} MiB fp32), batch {args.batch}, recipe"
          f" {args.recipe}, {args.device}, {torch.get_num_threads()} thread(s), {args.rounds} paired rounds")
    print(f"bf16 step (s)            {q(t_bf16)}")
    print(f"calibration step (s)     {q(t_auto)}")
    print(f"calibration / bf16 step  {q(ratios)}   goal <= 2")
    mib = {k: v / 2**20 for k, v in peaks.items()}
    print(f"peak tensor memory (MiB) bf16 {mib['bf16']:.1f}, calibration {mib['auto']:.1f}:"
          f" {mib['auto'] / mib['bf16']:.3f}x (+{mib['auto'] - mib['bf16']:.1f} MiB)   goal <= 1.15")
    if device.type == "cpu" and sys.platform == "linux":
        rss = {name: rss_above_start(name) / 2**20 for name in ("bf16", "auto")}
        print(f"peak RSS above start (MiB) bf16 {rss['bf16']:.1f}, calibration {rss['auto']:.1f}:"
              f" {rss['auto'] / rss['bf16']:.3f}x (+{rss['auto'] - rss['bf16']:.1f} MiB)")
    if cuda:
        dev = {k: v / 2**20 for k, v in device_peaks.items()}
        print(f"cuda max_memory_allocated (MiB) bf16 {dev['bf16']:.1f}, calibration {dev['auto']:.1f}:"
              f" {dev['auto'] / dev['bf16']:.3f}x")


if __name__ == "__main__":
    main()
