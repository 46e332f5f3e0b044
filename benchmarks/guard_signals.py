"""What FP8Guard's early divergence signals read on the embedded recipes: per linear layer, the kurtosis of its input
and the growth of its input's largest magnitude since the first measured step.

    python benchmarks/guard_signals.py [--recipes vit distilbert] [--steps 60] [--every 2] [--lr-scale 1]

For each recipe (embedded default, random weights, its own generated data), a bf16-mixed fit of ``--steps`` steps
(the recipe's optimizer; ``--lr-scale`` multiplies its learning rate, e.g. 100 for a run pushed towards divergence)
with the guard's own ``InputSignals`` on every linear layer, read every ``--every`` steps as the guard reads them.
Printed: the range over the layers of each layer's largest kurtosis and largest amax growth over the fit, the layers
that reach the top, and the loss at the start and end. docs/plan.md's suggested ``max_kurtosis`` and
``max_amax_growth`` come from these figures.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import warnings

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_precision import BF16MixedPrecision
from lightning_precision.callbacks.guard import InputSignals
from lightning_precision.cli.recipes import RECIPES
from lightning_precision.fp8._selection import functional_linears, linear_layers


class Signals(Callback):
    """The guard's signals on every linear layer whose forward runs, on one step in ``every``."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.inputs: InputSignals | None = None
        self.kurtosis: dict[str, list[float]] = {}
        self.growth: dict[str, list[float]] = {}
        self.first: dict[str, float] = {}
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (trainer.global_step + 1) % self.every == 0:
            functional = functional_linears(pl_module)
            self.inputs = InputSignals({f: m for f, m, _ in linear_layers(pl_module) if id(m) not in functional})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        inputs, self.inputs = self.inputs, None
        if inputs is None:
            return
        inputs.close()
        for fqn, (kurtosis, amax) in inputs.result().items():
            self.first.setdefault(fqn, amax)
            self.kurtosis.setdefault(fqn, []).append(kurtosis)
            self.growth.setdefault(fqn, []).append(amax / self.first[fqn])


def spread(label: str, per_layer: dict[str, list[float]], top: int = 3) -> None:
    peaks = {fqn: max(v for v in values if not math.isnan(v)) for fqn, values in per_layer.items()}
    values = sorted(peaks.values())
    highest = sorted(peaks, key=peaks.get, reverse=True)[:top]
    print(f"  {label:<22} over {len(values)} layers: min {values[0]:.3g}  median {statistics.median(values):.3g}"
          f"  max {values[-1]:.3g}   highest: " + ", ".join(f"{f} {peaks[f]:.3g}" for f in highest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["vit", "distilbert"], choices=["vit", "distilbert"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--lr-scale", type=float, default=1.0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for name in args.recipes:
        L.seed_everything(0, verbose=False)
        model, data = RECIPES[name].build()
        if args.lr_scale != 1:
            model.lr *= args.lr_scale
        signals = Signals(args.every)
        L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, plugins=[BF16MixedPrecision()],
                  callbacks=[signals], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0).fit(model, data)
        measured = len(next(iter(signals.kurtosis.values()), []))
        losses = signals.losses
        print(f"{name}: {args.steps} bf16 steps (lr x{args.lr_scale:g}), {measured} measured; loss"
              f" {statistics.mean(losses[:5]):.3f} (first 5) -> {statistics.mean(losses[-5:]):.3f} (last 5)")
        spread("input kurtosis (max)", signals.kurtosis)
        spread("input amax growth (max)", signals.growth)


if __name__ == "__main__":
    main()
