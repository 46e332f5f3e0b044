"""What ``FP8Precision(layers="auto")`` measures on the embedded recipes, and what measuring costs.

    python benchmarks/plan_numerics.py [--recipes vit distilbert] [--batches 8]

For each recipe (embedded default, random weights, its own generated data): the range over its linear layers of each
quantity ``PlanRule`` bounds (the figures behind the defaults in docs/plan.md), the plan the defaults make, and the
cost of measuring a batch in step-equivalents: ``fp8_sensitivity`` on N batches against a plain forward and backward
on the same N batches, timed side by side in this process (torchao emulates fp8 here: on a GPU both sides change).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from torch import nn

from lightning_precision import fp8 as _fp8
from lightning_precision.plan import PrecisionPlan
from lightning_precision.recipes import RECIPES
from lightning_precision.sensitivity import fp8_sensitivity


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
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.recipes:
        model, data = RECIPES[name].build()
        data.prepare_data()
        data.setup("fit")
        batches = list(itertools.islice(iter(data.train_dataloader()), args.batches))
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


if __name__ == "__main__":
    main()
