"""Step time of our plugins against Lightning's built-in MixedPrecision, side by side in one run.

Both run the same model and data in the same process, alternating fit by fit, and the per-step times (from batch start
to batch end: forward, backward, optimizer step, plugin bookkeeping) are pooled per variant. Prints medians and
ratios (ours / Lightning); the goal for CPU bf16 is <= 1.02.

    python benchmarks/plugin_overhead.py [--rounds 6] [--steps 40] [--width 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision

sys.path.insert(0, str(Path(__file__).parent))
from _common import MLP, WARMUP, StepTimer  # noqa: E402


def step_times(plugin, steps: int, width: int, data: TensorDataset) -> list[float]:
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=steps, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10,
    )
    trainer.fit(MLP(width), DataLoader(data, batch_size=64))
    return timer.times[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64 * args.steps, args.width, generator=g), torch.randint(0, 10, (64 * args.steps,), generator=g))

    pairs = {
        "bf16-mixed": (lambda: BF16MixedPrecision(), lambda: MixedPrecision("bf16-mixed", "cpu")),
        "16-mixed": (lambda: FP16MixedPrecision(), lambda: MixedPrecision("16-mixed", "cpu")),
    }
    print(f"torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads, "
          f"MLP width {args.width}, batch 64, {args.rounds} rounds x {args.steps} steps (first {WARMUP} dropped)")
    print(f"{'precision':<12}{'ours (ms)':>12}{'lightning (ms)':>16}{'ratio':>8}")
    for name, (ours, theirs) in pairs.items():
        times: dict[str, list[float]] = {"ours": [], "lightning": []}
        for _ in range(args.rounds):  # alternate so drift in machine load hits both alike
            times["ours"] += step_times(ours(), args.steps, args.width, data)
            times["lightning"] += step_times(theirs(), args.steps, args.width, data)
        a, b = statistics.median(times["ours"]), statistics.median(times["lightning"])
        print(f"{name:<12}{a * 1e3:>12.2f}{b * 1e3:>16.2f}{a / b:>8.3f}")


if __name__ == "__main__":
    main()
