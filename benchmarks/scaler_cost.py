"""Host time of FP16MixedPrecision's loss scaler against torch's ``torch.amp.GradScaler``, side by side in one process.

Two measurements, each in paired rounds (every round runs each variant once, in an order rotated from round to round,
so drift in machine load hits all alike; one round's ratio is one paired sample; printed: median [IQR] of the per-step
time per variant and of the paired ratios against the peer):

- ``cycle``: a full scaler cycle on a tiny model (Linear 16-16-16, batch 4), where the scaler's host work dominates:
  fp16 autocast forward, scale the loss, backward, unscale and check, optimizer step, update. Ours is driven through
  the Fabric plugin's own methods (``forward_context``, ``backward``, ``optimizer_step``; the update happens at the
  next backward), torch's as its documentation writes the loop (``scaler.scale(loss).backward()``,
  ``scaler.step(opt)``, ``scaler.update()``). The peer is torch's scaler on the same model: the goal is <= 1.05.
  Beside them: the plugin's scaler alone (``plugin.scaler``) driven by torch's loop, which tells the scaler's own cost
  from the plugin's (autocast context, backward scope); and a plain fp32 loop (no autocast, no scaler), so that the
  share of autocast and scaler in the step can be read off.
- ``fabric``: a training loop with ``Fabric(plugins=[FP16MixedPrecision()])`` against the same loop written by hand
  with ``torch.autocast("cpu", torch.float16)`` and ``torch.amp.GradScaler("cpu")``, on a small MLP (widths
  ``--width``, 5 layers, batch 32), in CPU time. Fabric with Lightning's own ``MixedPrecision("16-mixed")`` runs beside
  them, so that what Fabric's wrappers cost (not the scaler's) can be told apart. The goal is <= 1.05.

CPU time (``time.process_time``: this process, its threads together) is the clock, as the machine is shared: the wall
time of a step includes the time it waited for a core. ``--device cuda`` runs the same code on a GPU (the clock is then
wall time, with a synchronisation at the end of each block of steps).

    python benchmarks/scaler_cost.py [--mode cycle|fabric|both] [--rounds 100] [--steps 20] [--width 128]
                                     [--device cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable

import lightning as L
import torch
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn

from lightning_precision import fabric as lp_fabric

Loop = Callable[[int], None]


def _tiny(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).to(device)


def _mlp(width: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).to(device)


def _data(batch: int, features: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, features, generator=g).to(device), torch.randint(0, 10, (batch,), generator=g).to(device)


def _sgd(net: nn.Module) -> torch.optim.Optimizer:
    # foreach=False: the same per-parameter loop on both sides, and the least optimizer time around the scaler's.
    return torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9, foreach=False)


def _torch_loop(net: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                data: tuple[torch.Tensor, torch.Tensor], device: str) -> Loop:
    """The loop torch's documentation writes for a GradScaler."""
    x, y = data

    def run(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast(device, torch.float16):
                loss = nn.functional.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    return run


# -- cycle: the scaler's full cycle on a tiny model ------------------------------------------------------------------


def cycle_torch(device: str, ours: bool = False) -> Loop:
    net = _tiny(device)
    opt = _sgd(net)
    # ours=True: the plugin's scaler (``plugin.scaler``, a GradScaler subclass) in torch's own loop, without the plugin.
    scaler = lp_fabric.FP16MixedPrecision(device=device).scaler if ours else torch.amp.GradScaler(device)
    assert scaler is not None
    return _torch_loop(net, opt, scaler, _data(4, 16, device), device)


def cycle_ours(device: str) -> Loop:
    net = _tiny(device)
    opt = _sgd(net)
    plugin = lp_fabric.FP16MixedPrecision(device=device)
    net = plugin.convert_module(net)  # as Fabric's setup does: the plugin learns where the model lives
    x, y = _data(4, 16, device)

    def run(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            with plugin.forward_context():
                loss = nn.functional.cross_entropy(net(x), y)
            plugin.backward(loss, net)  # applies the last step's update first
            plugin.optimizer_step(opt)

    return run


def cycle_plain(device: str) -> Loop:
    net = _tiny(device)
    opt = _sgd(net)
    x, y = _data(4, 16, device)

    def run(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

    return run


# -- fabric: Fabric's loop against a hand loop -----------------------------------------------------------------------


def hand_loop(device: str, width: int) -> Loop:
    net = _mlp(width, device)
    opt = _sgd(net)
    scaler = torch.amp.GradScaler(device)
    return _torch_loop(net, opt, scaler, _data(32, width, device), device)


def fabric_loop(plugin_factory: Callable[[], object], device: str, width: int) -> Loop:
    fabric = L.Fabric(accelerator=device, devices=1, plugins=[plugin_factory()])
    net = _mlp(width, device)
    model, opt = fabric.setup(net, _sgd(net))
    x, y = _data(32, width, device)
    x, y = fabric.to_device((x, y))

    def run(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            opt.step()

    return run


# -- the rounds ------------------------------------------------------------------------------------------------------


def _clock(device: str) -> Callable[[], float]:
    if device == "cpu":
        return time.process_time

    def synced() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return synced


def _iqr(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def compare(title: str, variants: dict[str, Loop], peer: str, rounds: int, steps: int, device: str) -> None:
    clock = _clock(device)
    for run in variants.values():  # warm-up: allocator, autocast caches, lazy state
        run(50)
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = clock()
            variants[name](steps)
            per_step[name].append((clock() - t0) / steps)
    print(f"\n{title} ({rounds} rounds of {steps} steps; per step, median [IQR]; ratio to {peer}: paired per round)")
    print(f"{'variant':<46}{'µs/step':>22}{'ratio':>18}")
    for name in names:
        times = per_step[name]
        lo, hi = _iqr(times)
        line = f"{name:<46}{statistics.median(times) * 1e6:>9.1f} [{lo * 1e6:.1f}-{hi * 1e6:.1f}]"
        if name != peer:
            ratios = [a / b for a, b in zip(times, per_step[peer], strict=True)]
            rlo, rhi = _iqr(ratios)
            line += f"{statistics.median(ratios):>18.3f} [{rlo:.3f}-{rhi:.3f}]"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["cycle", "fabric", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--width", type=int, default=128, help="the fabric mode's MLP width")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU (same code)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    with contextlib.suppress(Exception):
        import logging

        logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    load = " ".join(f"{v:.2f}" for v in __import__("os").getloadavg())
    print(f"torch {torch.__version__}, lightning {L.__version__}, device {args.device}, {torch.get_num_threads()}"
          f" threads, load average {load}, clock {'CPU time' if args.device == 'cpu' else 'wall (synced)'}")
    if args.mode in ("cycle", "both"):
        compare("Scaler cycle, tiny model (Linear 16-16-16, batch 4)", {
            "torch.amp.GradScaler": cycle_torch(args.device),
            "ours (FP16MixedPrecision, Fabric plugin)": cycle_ours(args.device),
            "ours, its scaler alone in torch's loop": cycle_torch(args.device, ours=True),
            "plain fp32 loop (no autocast, no scaler)": cycle_plain(args.device),
        }, "torch.amp.GradScaler", args.rounds, args.steps, args.device)
    if args.mode in ("fabric", "both"):
        compare(f"Fabric loop vs hand loop, MLP width {args.width} x5, batch 32", {
            "hand loop (autocast + GradScaler)": hand_loop(args.device, args.width),
            "Fabric + ours FP16MixedPrecision": fabric_loop(lp_fabric.FP16MixedPrecision, args.device, args.width),
            "Fabric + Lightning MixedPrecision('16-mixed')": fabric_loop(
                lambda: MixedPrecision("16-mixed", args.device), args.device, args.width),
        }, "hand loop (autocast + GradScaler)", args.rounds, args.steps, args.device)


if __name__ == "__main__":
    main()
