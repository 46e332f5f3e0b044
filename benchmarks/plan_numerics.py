"""What ``FP8Precision(layers="auto")`` measures on the embedded recipes, and what measuring and guarding cost.

    python benchmarks/plan_numerics.py [--recipes vit distilbert] [--batches 8] [--every 100] [--guard-steps 205]

For each recipe (embedded default, random weights, its own generated data): the range over its linear layers of each
quantity ``PlanRule`` bounds (the figures behind the defaults in docs/plan.md), the plan the defaults make, and the
cost of measuring a batch in step-equivalents: ``fp8_sensitivity`` on N batches against a plain forward and backward
on the same N batches, timed side by side in this process (torchao emulates fp8 here: on a GPU both sides change).

Then ``FP8Guard``'s amortised overhead: one fp8 fit (every eligible layer, emulated) with the guard measuring one step
in ``--every``, one without, alternated. Its measured steps cost what measuring costs; amortised:
((every - 1) x median ordinary step + mean measured step) / every, against the median step of the same fit (free of
fit-to-fit noise) and of the fit without the guard. Goal: <= 1.03. The cadence that meets it is printed too.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import WARMUP, StepTimer  # noqa: E402

from lightning_precision import FP8Precision
from lightning_precision import fp8 as _fp8
from lightning_precision.callbacks import FP8Guard
from lightning_precision.cli.recipes import RECIPES
from lightning_precision.fp8 import PrecisionPlan, fp8_sensitivity


def _loss(model: nn.Module, batch) -> torch.Tensor:
    return model.training_loss(batch)


def _plain(model: nn.Module, batches: list) -> None:
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, batch)
        loss.backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["vit", "distilbert"], choices=["vit", "distilbert"])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--every", type=int, default=100, help="FP8Guard's cadence")
    parser.add_argument("--guard-steps", type=int, default=205, help="steps of each guard fit")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # the fits' banners and layer tables
    torch.manual_seed(0)
    for name in args.recipes:
        model, batches = RECIPES[name].training_batches(args.batches)
        _plain(model, batches[:1])  # warm-up
        t0 = time.perf_counter()
        _plain(model, batches)
        plain = time.perf_counter() - t0
        t0 = time.perf_counter()
        sens = fp8_sensitivity(model, batches, loss_fn=_loss)
        measured = time.perf_counter() - t0
        print(f"{name}: {len(sens)} linear layers, {len(batches)} batches")
        columns = {
            "input SQNR dB (e4m3)": [s.input.sqnr_db for s in sens.values()],
            "weight SQNR dB (e4m3)": [s.weight.sqnr_db for s in sens.values()],
            "grad_output SQNR dB (e5m2)": [s.grad_output.sqnr_db for s in sens.values()],
            "max underflow fraction": [max(n.underflow for n in s.tensors().values()) for s in sens.values()],
            "output error": [s.output_error for s in sens.values()],
            "input-gradient error": [s.grad_input_error for s in sens.values()],
        }
        for label, values in columns.items():
            print(f"  {label:<28} min {min(values):<10.4g} median {statistics.median(values):<10.4g}"
                  f" max {max(values):.4g}")
        decisions = _fp8.select_fp8_layers(model, "tensorwise", module_filter=lambda m, fqn: True)
        plan = PrecisionPlan.decide(decisions, sens)
        print(f"  default rule: {len(plan.fp8_layers)} of {len(plan.layers)} layers in fp8 (shape rules off)")
        print(f"  measuring costs {measured / plain:.1f} step-equivalents per batch"
              f" ({measured / len(batches) * 1e3:.0f} ms against {plain / len(batches) * 1e3:.0f} ms)")
        guard_overhead(name, args.every, args.guard_steps)


def _fp8_fit(recipe: str, steps: int, callbacks: list) -> list[float]:
    import lightning as L

    L.seed_everything(0, verbose=False)
    model, data = RECIPES[recipe].build()
    timer = StepTimer()
    plugin = FP8Precision(emulate=True, skip_small_layers=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], callbacks=[timer, *callbacks],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, data)
    return timer.times


def guard_overhead(recipe: str, every: int, steps: int, rounds: int = 2) -> None:
    import tempfile

    plain: list[float] = []
    times: list[list[float]] = []
    events = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):  # alternated, each order once, so drift hits both alike
            for guarded in ((False, True) if r % 2 == 0 else (True, False)):
                if guarded:
                    guard = FP8Guard(every_n_steps=every, plan_path=Path(tmp) / "plan.yaml")
                    times.append(_fp8_fit(recipe, steps, [guard]))
                    events += len(guard.events)
                else:
                    plain += _fp8_fit(recipe, steps, [])[WARMUP:]
    measured = [t for fit in times for i, t in enumerate(fit) if (i + 1) % every == 0]
    ordinary = statistics.median(t for fit in times for i, t in enumerate(fit) if i >= WARMUP and (i + 1) % every)
    mean_measured = statistics.mean(measured)
    amortised = (ordinary * (every - 1) + mean_measured) / every
    cost = mean_measured / ordinary - 1  # extra step-equivalents per measured step
    print(f"  FP8Guard(every_n_steps={every}) on the fp8 fit ({rounds} x {steps} steps, {len(measured)} measured,"
          f" {events} demotions): a measured step costs {cost:.1f} step-equivalents more"
          f" ({mean_measured * 1e3:.0f} ms against {ordinary * 1e3:.0f} ms); amortised x{amortised / ordinary:.3f}"
          f" of its own ordinary steps, x{amortised / statistics.median(plain):.3f} of the fits without it;"
          f" <= 1.03 from every_n_steps >= {max(1, math.ceil(cost / 0.03))}")


if __name__ == "__main__":
    main()
