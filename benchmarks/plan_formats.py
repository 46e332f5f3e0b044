"""Plans that choose among formats: the loss gap to bf16 and the predicted saving of a plan made by
``make_plan(candidates=...)``, beside "every layer fp8 tensorwise" and Megatron's "first and last block in bf16".

    python benchmarks/plan_formats.py [--models vit distilbert outlier] [--steps 120] [--calibration 4] [--tail 10]
        [--seeds 3] [--plans] [--no-shapes]

For each model (the embedded ViT and DistilBERT defaults, random weights, their own generated data; and ``Outliers``,
a residual MLP whose normalised activations carry a few channels 1e3-1e4x larger than the rest, as LLM.int8 (Dettmers
et al. 2022) observed in large transformers), the same initial weights are trained on the same batches for the same
steps (AdamW, fp8 emulated by torchao on the CPU) under:

1. ``bf16``: ``BF16MixedPrecision()``, no fp8: the reference (and Lightning's ``32-true`` beside it: how far a change
   of precision alone moves the final loss of these short fits);
2. ``all tensorwise``: ``FP8Precision(recipe="tensorwise", layer_policy=FP8LayerPolicy(skip_small_layers=False,
   skip_first_last=False))``: every eligible linear layer;
3. ``Megatron``: ``FP8LayerPolicy(first_last_blocks=1, skip_small_layers=False)``: tensorwise except the linear
   layers of the first and last block of ``block_stack`` (and, as the policy's default ``skip_first_last`` says, the
   readers of the input embedding and the writer of the logits);
4. ``plan``: ``make_plan(model, the first --calibration training batches, loss, candidates=("tensorwise", "rowwise",
   "mxfp8"), plan_rule=PlanRule(error_budget=B), device="B200", skip_small_layers=False)`` then
   ``FP8Precision(layers=plan, emulate=True)``; and the same for ``device="H100 SXM"`` with ("tensorwise",
   "rowwise"). B is read off the measured errors: ``B`` = what "all tensorwise" spends (the sum of
   ``error_contribution`` of its layers' tensorwise numbers on the calibration batches), ``B/2`` and ``B/4``.

Per model and configuration: the final training loss (mean of the last ``--tail`` steps), its gap to bf16 (and,
below the table, bf16 from the initial weights of other seeds on the same batches: the spread the gaps sit in), and the
saving the speed model predicts (``fp8._speed.predicted_saving``: a prediction, this is a CPU) on a B200 and an H100
SXM, in ms per step and as a fraction of every linear layer's GEMM time in bf16 (``high_time``), for each layer the
tokens it processed per batch as measured (``LayerSensitivity.tokens``). The embedded models are tiny: their GEMMs are
a few kernels' launch time, and fp8 is predicted slower. So the same configurations are also predicted for the layer
shapes of DistilBERT-base and ViT-B/16 at batch 32 (shapes only: nothing measured or trained at that size).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from lightning_precision import BF16MixedPrecision, FP8Precision
from lightning_precision.fp8 import FP8LayerPolicy, LayerSensitivity, PlanRule, PrecisionPlan, make_plan
from lightning_precision.fp8._plan_types import error_contribution
from lightning_precision.fp8._selection import block_stack, select_fp8_layers
from lightning_precision.fp8._sensitivity import measure_candidates
from lightning_precision.fp8._speed import GemmDevice, high_time, predicted_saving, runs, speed_device

DEVICES = ("B200", "H100 SXM")
CANDIDATES = {"B200": ("tensorwise", "rowwise", "mxfp8"), "H100 SXM": ("tensorwise", "rowwise")}
ALL_TENSORWISE = FP8LayerPolicy(skip_small_layers=False, skip_first_last=False)
MEGATRON = FP8LayerPolicy(first_last_blocks=1, skip_small_layers=False)


# --- the model with outlier channels ----------------------------------------------------------------------------------


class OutlierBlock(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x) * scale)))``; ``scale`` (a buffer) is 1 but on a few
    channels, where it is 1e3-1e4: fc1 reads activations with outlier channels, as LLM.int8 found after the LayerNorms
    of large transformers."""

    def __init__(self, dim: int, scale: torch.Tensor) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("scale", scale)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.relu(self.fc1(self.norm(x) * self.scale)))


class Outliers(L.LightningModule):
    """An input projection, ``depth`` ``OutlierBlock`` s of width ``dim`` and a linear head over the mean token, on
    sequences of random tokens whose class is a fixed random teacher's (``batches``). Everything comes from
    ``seed``: the weights, which channels are outliers (``outliers`` of them, drawn without replacement) and their
    size (log-uniform in [1e3, 1e4])."""

    def __init__(self, dim: int = 128, depth: int = 6, inputs: int = 64, classes: int = 16, outliers: int = 4,
                 seed: int = 0, lr: float = 1e-3, weight_seed: int | None = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        channels = torch.randperm(dim, generator=g)[:outliers]
        scale = torch.ones(dim)
        scale[channels] = 10 ** (3 + torch.rand(outliers, generator=g))
        self.outlier_channels = {int(c): float(scale[c]) for c in channels}
        torch.manual_seed(seed if weight_seed is None else weight_seed)  # other weights, the same task and outliers
        self.embed = nn.Linear(inputs, dim)
        self.blocks = nn.ModuleList(OutlierBlock(dim, scale.clone()) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        self.teacher = torch.randn(inputs, classes, generator=g)
        self.inputs, self.lr, self.seed = inputs, lr, seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))

    def training_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.training_loss(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def batches(self, n: int, batch: int = 32, tokens: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed + 1)
        out = []
        for _ in range(n):
            x = torch.randn(batch, tokens, self.inputs, generator=g)
            out.append((x, (x.mean(dim=1) @ self.teacher).argmax(dim=1)))
        return out


# --- fits -------------------------------------------------------------------------------------------------------------


class LossTail(Callback):
    """Training loss of every step (read at the end: no host read during the fit)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach())


def fit(pristine: L.LightningModule, batches: list[Any], plugin: Any) -> tuple[list[float], Any]:
    """The losses of a fit of a copy of ``pristine`` (the same initial weights each time) on ``batches``, one a step;
    ``plugin``: a precision plugin, or Lightning's name of a precision."""
    L.seed_everything(0, verbose=False)
    model = copy.deepcopy(pristine)
    tail = LossTail()
    precision = {"precision": plugin} if isinstance(plugin, str) else {"plugins": [plugin]}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(batches), **precision, callbacks=[tail],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(batches, batch_size=None))  # type: ignore[arg-type]  # a list is a dataset
    return [float(loss) for loss in tail.losses], plugin


def low_layers(plugin: Any) -> dict[str, str]:
    """The layers a fitted FP8Precision ran in low precision, each with its format."""
    return {d.fqn: d.format or plugin.scaling_family for d in plugin.layer_decisions if d.fp8}


# --- predictions ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    tokens: float
    in_features: int
    out_features: int


def saving(formats: dict[str, str], shapes: dict[str, Shape], device: GemmDevice) -> float | None:
    """Seconds per step the layers in ``formats`` save on ``device`` (None: a format it does not run)."""
    if not all(runs(device, fmt) for fmt in formats.values()):
        return None
    return sum(predicted_saving(fmt, shapes[fqn].tokens, shapes[fqn].in_features, shapes[fqn].out_features, device)
               for fqn, fmt in formats.items())


def baseline(shapes: dict[str, Shape], device: GemmDevice) -> float:
    """Every linear layer's GEMM seconds per step in bf16: the denominator of every configuration's fraction."""
    return sum(high_time(s.tokens, s.in_features, s.out_features, device) for s in shapes.values())


def saving_cells(formats: dict[str, str], shapes: dict[str, Shape]) -> list[str]:
    cells = []
    for name in DEVICES:
        device = speed_device(name)[0]
        s = saving(formats, shapes, device)
        cells.append("n/a (format not run)" if s is None else
                     f"{s * 1e3:+.4f} ({s / baseline(shapes, device):+.0%})")
    return cells


def formats_cell(formats: dict[str, str], total: int) -> str:
    counts: dict[str, int] = {}
    for fmt in formats.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return f"{len(formats)}/{total}" + (f": {', '.join(f'{n} {f}' for f, n in sorted(counts.items()))}"
                                        if counts else "")


# --- one model --------------------------------------------------------------------------------------------------------


def model_and_batches(name: str, n: int, args: argparse.Namespace) -> tuple[L.LightningModule, list[Any], Callable]:
    if name == "outlier":
        outliers = Outliers(dim=args.outlier_dim, depth=args.outlier_depth)
        return outliers, outliers.batches(n), lambda m, b: m.training_loss(b)
    from lightning_precision.cli.recipes import RECIPES, training_loss

    L.seed_everything(0, verbose=False)
    model, batches = RECIPES[name].training_batches(n)
    return model, batches, training_loss


def other_weights(name: str, seed: int, args: argparse.Namespace) -> L.LightningModule:
    """The model with the initial weights of another seed (its data is seeded apart: the batches are the same)."""
    if name == "outlier":
        return Outliers(dim=args.outlier_dim, depth=args.outlier_depth, weight_seed=seed)
    from lightning_precision.cli.recipes import RECIPES

    L.seed_everything(seed, verbose=False)
    return RECIPES[name].build()[0]


def run_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    pristine, batches, loss_fn = model_and_batches(name, args.steps, args)
    calibration = batches[:args.calibration]
    linear = [fqn for fqn, m in pristine.named_modules() if isinstance(m, nn.Linear)]
    stack = block_stack(pristine)
    outliers = ", ".join(f"{c}: {s:.0f}" for c, s in getattr(pristine, "outlier_channels", {}).items())
    print(f"\n## {name}: {len(linear)} linear layers; block_stack: "
          + (f"`{stack[0]}`, {len(stack[1])} blocks" if stack else "none")
          + (f"; outlier channels (channel: scale) {outliers}" if outliers else ""), flush=True)
    # Every linear layer's numbers under every candidate (one pass), for the tokens and the budget.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = measure_candidates(copy.deepcopy(pristine), calibration, CANDIDATES["B200"], loss_fn, linear)
    tokens = {fqn: max((by[fqn].tokens for by in measured.values() if fqn in by), default=0.0) for fqn in linear}
    modules = dict(pristine.named_modules())
    shapes = {fqn: Shape(tokens[fqn], modules[fqn].in_features, modules[fqn].out_features)
              for fqn in linear if tokens[fqn] > 0}  # a layer whose forward never runs has no GEMM

    def numbers(fmt: str, fqn: str) -> LayerSensitivity | None:
        return measured[fmt].get(fqn)

    rows: list[dict[str, Any]] = []

    def add(config: str, losses: list[float], formats: dict[str, str], plan: PrecisionPlan | None = None) -> None:
        final = sum(losses[-args.tail:]) / len(losses[-args.tail:])
        rows.append({"model": name, "config": config, "loss": final, "formats": formats, "plan": plan})

    losses, _ = fit(pristine, batches, BF16MixedPrecision())
    add("bf16", losses, {})
    losses, _ = fit(pristine, batches, "32-true")
    add("fp32 (how far a change of precision alone moves the loss)", losses, {})
    losses, plugin = fit(pristine, batches, FP8Precision(emulate=True, recipe="tensorwise",
                                                         layer_policy=ALL_TENSORWISE))
    add("all tensorwise", losses, low_layers(plugin))
    all_tensorwise = rows[-1]["formats"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # first_last_blocks says when the blocks are all of them: said below
        losses, plugin = fit(pristine, batches, FP8Precision(emulate=True, recipe="tensorwise", layer_policy=MEGATRON))
    add("Megatron (first/last block bf16)", losses, low_layers(plugin))
    spent = sum(error_contribution(s) for fqn in all_tensorwise if (s := numbers("tensorwise", fqn)) is not None)
    budgets = {"B": spent, "B/2": spent / 2, "B/4": spent / 4}
    print(f"budget B = {spent:.4g}: the summed error_contribution (output_error**2 + grad_input_error**2) of the"
          f" {len(all_tensorwise)} layers 'all tensorwise' runs, tensorwise, on {len(calibration)} calibration batches")
    for device in DEVICES:
        for label, budget in budgets.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = make_plan(copy.deepcopy(pristine), calibration, loss_fn, candidates=CANDIDATES[device],
                                 plan_rule=PlanRule(error_budget=budget), device=device, skip_small_layers=False)
                losses, plugin = fit(pristine, batches, FP8Precision(layers=plan, emulate=True))
            formats = low_layers(plugin)
            assert formats == {p.fqn: p.precision for p in plan.layers if p.low}, "the plan ran as made"
            add(f"plan {device}, budget {label} = {budget:.3g}", losses, formats, plan)
    reference = rows[0]["loss"]
    spread = []
    for seed in range(1, args.seeds):
        losses, _ = fit(other_weights(name, seed, args), batches, BF16MixedPrecision())
        spread.append(sum(losses[-args.tail:]) / len(losses[-args.tail:]))
    print(f"\n{len(batches)} steps (the data's first {len(batches)} batches), loss = mean of the last"
          f" {min(args.tail, len(batches))}; saving predicted (ms per step, and % of every linear layer's GEMM time in"
          " bf16), tokens as measured")
    print("| model | configuration | layers in low precision | final loss | gap to bf16 | B200 saving ms |"
          " H100 SXM saving ms |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        b200, h100 = saving_cells(row["formats"], shapes)
        print(f"| {name} | {row['config']} | {formats_cell(row['formats'], len(linear))} | {row['loss']:.4f} |"
              f" {row['loss'] - reference:+.4f} | {b200} | {h100} |")
    if spread:
        gaps = ", ".join(f"{x - reference:+.4f}" for x in spread)
        print(f"bf16 from other initial weights (seeds 1..{args.seeds - 1}), the same batches: final loss"
              f" {', '.join(f'{x:.4f}' for x in spread)} (gap to bf16 {gaps}): the seed-to-seed spread the gaps above"
              " sit in")
    for row in rows:
        plan = row["plan"]
        if plan is not None:
            check = saving({p.fqn: p.precision for p in plan.layers if p.low}, shapes, speed_device(plan.device)[0])
            print(f"{row['config']}: the plan's own figure: {plan.saving_line()}"
                  f" [recomputed here: {(check or 0.0) * 1e3:.4f} ms]")
            if args.plans:
                print(plan.table())
    return rows


# --- the same configurations on realistic shapes ----------------------------------------------------------------------


def scaled_shapes(name: str, batch: int = 32) -> tuple[nn.Module, dict[str, Shape]]:
    """DistilBERT-base (seq 128) or ViT-B/16 (197 tokens) as the recipes build them (nothing run): every linear layer
    that runs as one, with ``batch * seq`` tokens; the classifier layers read the class token only (``batch`` rows)."""
    from lightning_precision.cli.recipes import RECIPES

    heads: tuple[str, ...]
    if name == "distilbert":
        model, seq, heads = RECIPES["distilbert"].build(model_args={"size": "base"})[0], 128, ("pre_classifier",
                                                                                                "classifier")
    else:
        model, seq, heads = RECIPES["vit"].build(model_args={"size": "b16"})[0], 197, ("head",)
    out = {}
    for d in select_fp8_layers(model, "tensorwise", layer_policy=ALL_TENSORWISE):
        if "forward never runs" in d.reason:
            continue
        rows = batch if d.fqn.split(".")[-1] in heads else batch * seq
        out[d.fqn] = Shape(rows, d.in_features, d.out_features)
    return model, out


def run_shapes(models: Sequence[str]) -> list[dict[str, Any]]:
    print("\n## Shapes only: the same choices predicted for DistilBERT-base (batch 32 x 128 tokens) and ViT-B/16"
          " (batch 32 x 197 tokens); nothing measured or trained at this size")
    print("| model | configuration | layers in low precision | B200 saving ms | H100 SXM saving ms |")
    print("|---|---|---|---|---|")
    rows = []
    for name in (m for m in models if m in ("distilbert", "vit")):
        model, shapes = scaled_shapes(name)
        label = "DistilBERT-base" if name == "distilbert" else "ViT-B/16"
        eligible = {d.fqn: "tensorwise" for d in select_fp8_layers(model, "tensorwise", layer_policy=ALL_TENSORWISE)
                    if d.fp8 and d.fqn in shapes}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            megatron = {d.fqn: "tensorwise" for d in select_fp8_layers(model, "tensorwise", layer_policy=MEGATRON)
                        if d.fp8 and d.fqn in shapes}
        configs: dict[str, dict[str, str]] = {"all tensorwise": eligible, "Megatron (first/last block bf16)": megatron}
        for fmt in ("rowwise", "mxfp8"):
            configs[f"all {fmt}"] = {fqn: fmt for fqn in eligible}
        for device_name in DEVICES:
            # the most a plan could save there: each layer's fastest candidate, errors ignored (none measured)
            device = speed_device(device_name)[0]

            def fastest(s: Shape, device: GemmDevice = device, name: str = device_name) -> str:
                return max(CANDIDATES[name], key=lambda f: predicted_saving(f, s.tokens, s.in_features,
                                                                            s.out_features, device))

            configs[f"fastest candidate per layer on {device_name} (errors ignored)"] = {
                fqn: fastest(shapes[fqn]) for fqn in eligible}
        for config, formats in configs.items():
            b200, h100 = saving_cells(formats, shapes)
            print(f"| {label} | {config} | {formats_cell(formats, len(shapes))} | {b200} | {h100} |")
            rows.append({"model": label, "config": config, "formats": formats})
        del model
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vit", "distilbert", "outlier"],
                        choices=["vit", "distilbert", "outlier"])
    parser.add_argument("--steps", type=int, default=120,
                        help="training steps of every fit (at most the batches a recipe's data has: 128)")
    parser.add_argument("--calibration", type=int, default=4, help="batches the plans measure (the first ones)")
    parser.add_argument("--tail", type=int, default=10, help="final loss: mean of the last TAIL steps")
    parser.add_argument("--seeds", type=int, default=3,
                        help="bf16 also from the initial weights of seeds 1..SEEDS-1 (the spread of the loss)")
    parser.add_argument("--outlier-dim", type=int, default=128)
    parser.add_argument("--outlier-depth", type=int, default=6)
    parser.add_argument("--plans", action="store_true", help="print each plan's table (its per-layer choice)")
    parser.add_argument("--no-shapes", action="store_true", help="skip the realistic-shape predictions")
    args = parser.parse_args(argv)
    if args.calibration > args.steps:
        parser.error(f"--calibration {args.calibration} > --steps {args.steps}: the plans measure training batches")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # the fits' banners and layer tables
    print(f"torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} thread(s), load average"
          f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    out: dict[str, list[dict[str, Any]]] = {"trained": [], "shapes": []}
    for name in args.models:
        out["trained"] += run_model(name, args)
    if not args.no_shapes:
        out["shapes"] = run_shapes(args.models)
    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return out


if __name__ == "__main__":
    main()
