"""Step time of our plugins against Lightning's built-in MixedPrecision, side by side in one run.

All variants run the same model and data in the same process, interleaved fit by fit (each round fits every variant
once, in an order rotated from round to round, so drift in machine load hits all alike). Per-step times (from batch
start to batch end: forward, backward, optimizer step, plugin bookkeeping) give one median per fit; each round pairs
a variant's fit with Lightning's fit of the same round, and the ratio of the two medians is one paired sample. Printed:
the pooled median step time per variant, and per variant the median of the paired ratios (ours / Lightning) with their
spread (min .. max over the rounds). The goal for CPU bf16 is <= 1.02.

bf16 runs twice: with the non-finite guard (``skip_nonfinite=True``: a step with inf/nan gradients is skipped, as the
fp16 scaler does) and without it (``skip_nonfinite=False``: Lightning's behaviour), so the guard's own cost is the
difference of the two ratios.

``--clock cpu`` times the CPU time of the process instead of wall time: on a machine shared with other work, the wall
time of a step includes the time the process waited for a core, which the CPU time does not.

``--within-fit`` measures the non-finite guard's own cost where fit-to-fit noise cannot hide it: in one fit of
``BF16MixedPrecision(skip_nonfinite=True)``, the guard is switched off on every other step (the plugin then steps as
Lightning's does) and the two kinds of step are timed in both clocks; which parity runs the guard alternates from round
to round. The ratio of the medians (guard on / off) per round is one paired sample.

    python benchmarks/plugin_overhead.py [--rounds 10] [--steps 40] [--width 512] [--only bf16] [--clock wall|cpu]
                                         [--threads N] [--within-fit]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision
from lightning_precision._core.scaling.step_policy import PlainStep

sys.path.insert(0, str(Path(__file__).parent))
from _common import MLP, WARMUP, StepTimer  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def step_times(plugin: Any, steps: int, width: int, data: TensorDataset, clock: str = "wall") -> list[float]:
    timer = StepTimer(CLOCKS[clock])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=steps, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10,
    )
    trainer.fit(MLP(width), DataLoader(data, batch_size=64))
    return timer.times[WARMUP:]


# name -> (variants, each a label and a factory); the first variant of each group is Lightning's, the reference.
GROUPS: dict[str, list[tuple[str, Callable[[], Any]]]] = {
    "bf16": [
        ("lightning bf16-mixed", lambda: MixedPrecision("bf16-mixed", "cpu")),
        ("ours bf16, skip_nonfinite=True", lambda: BF16MixedPrecision(skip_nonfinite=True)),
        ("ours bf16, skip_nonfinite=False", lambda: BF16MixedPrecision(skip_nonfinite=False)),
    ],
    "fp16": [
        ("lightning 16-mixed", lambda: MixedPrecision("16-mixed", "cpu")),
        ("ours 16-mixed", lambda: FP16MixedPrecision()),
    ],
}


def run_group(variants: list[tuple[str, Callable[[], Any]]], rounds: int, steps: int, width: int,
              data: TensorDataset, clock: str) -> None:
    medians: dict[str, list[float]] = {label: [] for label, _ in variants}
    pooled: dict[str, list[float]] = {label: [] for label, _ in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]  # rotate: no variant always runs first
        for label, make in order:
            times = step_times(make(), steps, width, data, clock)
            medians[label].append(statistics.median(times))
            pooled[label] += times
    reference = variants[0][0]
    print(f"{'variant':<34}{'ms/step':>9}{'ratio (paired median)':>23}{'spread (min..max)':>20}")
    for label, _ in variants:
        ratios = [a / b for a, b in zip(medians[label], medians[reference], strict=True)]
        spread = f"{min(ratios):.3f}..{max(ratios):.3f}"
        print(f"{label:<34}{statistics.median(pooled[label]) * 1e3:>9.2f}{statistics.median(ratios):>23.3f}"
              f"{spread:>20}")


class GuardToggle(Callback):
    """Switches the plugin's non-finite guard off on every other step (benchmark only: it swaps the plugin's step
    policy, the guarded one, for the plain one of ``skip_nonfinite=False``) and times each step in both clocks, by
    whether the guard ran."""

    def __init__(self, guard_on_odd: bool) -> None:
        self.guard_on_odd = guard_on_odd
        self.times: dict[tuple[bool, str], list[float]] = {(on, c): [] for on in (True, False) for c in CLOCKS}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        plugin = trainer.precision_plugin
        if not hasattr(self, "guard"):
            self.guard, self.plain = plugin.step_policy, PlainStep("benchmark")
            assert self.guard.kind == "guarded", "run the guard: BF16MixedPrecision(skip_nonfinite=True)"
        self.on = (batch_idx % 2 == 1) == self.guard_on_odd
        plugin.step_policy = self.guard if self.on else self.plain
        self._t0 = {c: clock() for c, clock in CLOCKS.items()}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        for c, clock in CLOCKS.items():
            self.times[(self.on, c)].append(clock() - self._t0[c])


def within_fit(rounds: int, steps: int, width: int, data: TensorDataset) -> None:
    ratios: dict[str, list[float]] = {c: [] for c in CLOCKS}
    pooled: dict[tuple[bool, str], list[float]] = {(on, c): [] for on in (True, False) for c in CLOCKS}
    for r in range(rounds):
        toggle = GuardToggle(guard_on_odd=r % 2 == 0)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, plugins=[BF16MixedPrecision(skip_nonfinite=True)], max_steps=steps,
            callbacks=[toggle], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, log_every_n_steps=10,
        )
        trainer.fit(MLP(width), DataLoader(data, batch_size=64))
        for key, times in toggle.times.items():
            kept = times[WARMUP // 2:]
            pooled[key] += kept
            toggle.times[key] = kept
        for c in CLOCKS:
            ratios[c].append(statistics.median(toggle.times[(True, c)]) / statistics.median(toggle.times[(False, c)]))
    print(f"{'clock':<8}{'guard off (ms)':>16}{'guard on (ms)':>15}{'ratio (paired median)':>23}"
          f"{'spread (min..max)':>20}")
    for c in CLOCKS:
        off, on = statistics.median(pooled[(False, c)]) * 1e3, statistics.median(pooled[(True, c)]) * 1e3
        print(f"{c:<8}{off:>16.2f}{on:>15.2f}{statistics.median(ratios[c]):>23.3f}"
              f"{min(ratios[c]):>13.3f}..{max(ratios[c]):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--only", choices=sorted(GROUPS), default=None)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--within-fit", action="store_true", help="the guard's cost inside one fit (see above)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64 * args.steps, args.width, generator=g),
                         torch.randint(0, 10, (64 * args.steps,), generator=g))
    print(f"torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads, "
          f"MLP width {args.width}, batch 64, {args.rounds} rounds x {args.steps} steps (first {WARMUP} dropped), "
          f"{args.clock} clock")
    if args.within_fit:
        print("\nbf16, the non-finite guard on and off on alternate steps of one fit:")
        within_fit(args.rounds, args.steps, args.width, data)
        return
    for name, variants in GROUPS.items():
        if args.only in (None, name):
            print(f"\n{name}:")
            run_group(variants, args.rounds, args.steps, args.width, data, args.clock)


if __name__ == "__main__":
    main()
