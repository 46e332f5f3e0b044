"""Callbacks side by side on a ResNet18 CPU fit (fp32), alternating fits, median step times.

1. GradientUnderflowMonitor at the default cadence (log_every_n_steps=50) vs no callback: the monitor's cost sits on
   one step in 50, which a median hides and a mean over ~100 noisy steps cannot resolve, so its step time is
   amortised: (49 * median of ordinary steps + mean of measuring steps) / 50, against the median without it, and
   against its own ordinary steps (what the measuring adds, free of fit-to-fit noise). Goal ratio <= 1.03.
2. ChannelsLast callback vs converting by hand (model and each batch in the training step) vs contiguous:
   goal: the callback's speedup over contiguous >= 95% of the by-hand speedup.

    python benchmarks/callbacks_overhead.py [--rounds 3] [--steps 105] [--batch 16] [--size 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import WARMUP, ResNet18Module, StepTimer, image_data  # noqa: E402

from lightning_precision.callbacks import ChannelsLast, GradientUnderflowMonitor, apply_channels_last, to_channels_last



class ByHand(ResNet18Module):
    """Channels-last the way people write it without the callback."""

    def __init__(self) -> None:
        super().__init__()
        apply_channels_last(self.net)

    def training_step(self, batch, batch_idx):
        return super().training_step(to_channels_last(batch), batch_idx)


CADENCE = 50


def fit(module: L.LightningModule, callbacks: list, steps: int, data, log_every: int = CADENCE, keep_all: bool = False) -> list[float]:
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=[*callbacks, timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=log_every,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=args.batch))
    return timer.times if keep_all else timer.times[WARMUP:]


def amortised(times_per_fit: list[list[float]]) -> tuple[float, float, float]:
    """(amortised step time, median ordinary step, mean measuring step) over fits whose steps i with (i+1) % CADENCE
    == 0 measured."""
    ordinary = [t for times in times_per_fit for i, t in enumerate(times) if i >= WARMUP and (i + 1) % CADENCE]
    measuring = [t for times in times_per_fit for i, t in enumerate(times) if (i + 1) % CADENCE == 0]
    base = statistics.median(ordinary)
    return (base * (CADENCE - 1) + statistics.mean(measuring)) / CADENCE, base, statistics.mean(measuring)


def compare(variants: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():  # alternate so machine drift hits every variant alike
            times[name] += run()
    return {name: statistics.median(t) for name, t in times.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=105)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--only", choices=("monitor", "channels_last"), default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    data = image_data(args.batch * args.steps, args.size)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ResNet18 fp32, batch {args.batch}, "
          f"{args.size}x{args.size}, {args.rounds} rounds x {args.steps} steps (first {WARMUP} dropped)")

    if args.only in (None, "monitor"):
        none, with_monitor = [], []
        for _ in range(args.rounds):
            none += fit(ResNet18Module(), [], args.steps, data)
            with_monitor.append(fit(ResNet18Module(), [GradientUnderflowMonitor()], args.steps, data, keep_all=True))
        base = statistics.median(none)
        amort, ordinary, measuring = amortised(with_monitor)
        print(f"GradientUnderflowMonitor: without {base * 1e3:.1f} ms; with: ordinary steps {ordinary * 1e3:.1f} ms,"
              f" measuring steps {measuring * 1e3:.1f} ms, amortised {amort * 1e3:.1f} ms;"
              f" ratio {amort / base:.3f} against the fits without it, {amort / ordinary:.3f} against its own ordinary"
              " steps (the latter free of fit-to-fit noise; goal <= 1.03)")
    if args.only == "monitor":
        sys.exit(0)

    c = compare({
        "contiguous": lambda: fit(ResNet18Module(), [], args.steps, data),
        "by hand": lambda: fit(ByHand(), [], args.steps, data),
        "callback": lambda: fit(ResNet18Module(), [ChannelsLast()], args.steps, data),
    }, args.rounds)
    hand, cb = c["contiguous"] / c["by hand"], c["contiguous"] / c["callback"]
    print(f"ChannelsLast: contiguous {c['contiguous'] * 1e3:.1f} ms, by hand {c['by hand'] * 1e3:.1f} ms "
          f"(speedup {hand:.3f}), callback {c['callback'] * 1e3:.1f} ms (speedup {cb:.3f}); "
          f"callback / by-hand speedup = {cb / hand:.3f} (goal >= 0.95)")
