"""``lightning-precision plan``: measure a recipe's embedded default and write the fp8 plan."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from lightning_precision._io import check_writable_file
from lightning_precision.cli.console import echo, say
from lightning_precision.fp8 import select_fp8_layers
from lightning_precision.fp8._decision import chooses_formats
from lightning_precision.fp8._make_plan import make_plan
from lightning_precision.fp8._plan_file import dump_plan, plan_suffix
from lightning_precision.fp8._plan_setup import check_candidates
from lightning_precision.fp8._plan_types import PlanRule

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """``lightning-precision plan --recipe vit|distilbert``: measure the recipe's embedded default, print the plan and
    write it (YAML or JSON by ``--out``'s suffix)."""
    from lightning_precision.cli.recipes import RECIPES, training_loss

    args = _parser().parse_args(argv)
    if args.batches < 1:
        return _usage_error(f"--batches {args.batches}: measure at least 1 batch")
    try:
        choice = _choice_arguments(args)
    except ValueError as err:
        return _usage_error(str(err))
    out = Path(args.out) if args.out is not None else Path(f"plan-{args.recipe}.yaml")
    try:  # a bad name or a place that cannot be written fails now, not after measuring
        if args.out == "":
            raise ValueError("--out '': an empty path names no file; name a .yaml, .yml or .json file.")
        plan_suffix(out)
        check_writable_file(out, "--out")
    except ValueError as err:
        return _usage_error(str(err))
    model, batches = RECIPES[args.recipe].training_batches(args.batches)
    nothing = _nothing_to_measure(model, args.recipe, args.recipe_fp8, args.emulate)
    if nothing:  # refused before measuring: a plan of no fp8 layer is not worth the wait, nor a file
        return _usage_error(nothing)
    echo(f"measuring {len(batches)} batches of the embedded {args.recipe} default ...")
    plan = make_plan(model, batches, loss_fn=training_loss, recipe=args.recipe_fp8,
                     skip_small_layers=not args.emulate, **choice)
    echo(plan.table())
    if not plan.measured and out.exists():
        # An earlier plan there was measured, perhaps for long; one that rests on no number must not replace it.
        say(f"lightning-precision plan: error: nothing was measured (every batch had a non-finite value, or no"
            f" eligible layer ran), so the plan is not written over the existing {str(out)!r}; it follows on"
            " standard output.")
        echo(dump_plan(plan.to_dict(), out).rstrip("\n"))
        return 1
    try:
        saved = plan.save(out)
    except (OSError, ValueError) as err:  # the disk filled up, or the folder changed, while measuring: keep it
        why = err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split())
        say(f"lightning-precision plan: error: could not write the plan to {str(out)!r} ({why});"
            " it follows on standard output: save it as a file and pass that file to `layers=`.")
        echo(dump_plan(plan.to_dict(), out).rstrip("\n"))
        return 1
    echo(f"wrote {saved}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command's arguments and their help."""
    parser = argparse.ArgumentParser(
        prog="lightning-precision plan",
        description="Measure fp8 numerics per linear layer on a recipe's embedded default and write the plan.")
    parser.add_argument("--recipe", choices=["vit", "distilbert"], required=True, help="the recipe to measure")
    parser.add_argument("--batches", type=int, default=8, help="training batches to measure (default: 8)")
    parser.add_argument("--recipe-fp8", dest="recipe_fp8", default="tensorwise", choices=["tensorwise", "rowwise"],
                        help="torchao scaling recipe (default: tensorwise)")
    parser.add_argument("--emulate", action="store_true",
                        help="plan for emulated fp8 (as `fit --precision fp8-emulated`): layers too small to gain on an"
                             " fp8 GPU are judged too, instead of kept in bf16")
    parser.add_argument("--candidates", default=None,
                        help="choose per layer among these formats, comma-separated (e.g. tensorwise,rowwise,mxfp8);"
                             " default with --budget: those torchao runs on --device")
    parser.add_argument("--budget", default=None,
                        help="the error budget of a choice among formats: the most summed error (each layer's output"
                             " and input-gradient relative noise power) the model may take; 'inf' for none")
    parser.add_argument("--device", default=None,
                        help="the GPU the predicted savings are for (e.g. 'H100 SXM', 'B200'); default this"
                             " machine's; without one (or one the speed table lacks) a prediction for an H100 SXM,"
                             " or for a B200 where a candidate needs Blackwell (mxfp8, nvfp4)")
    parser.add_argument("--out", default=None, help="plan file, .yaml/.yml/.json (default: plan-<recipe>.yaml)")
    return parser


def _choice_arguments(args: Any) -> dict[str, Any]:
    """make_plan's arguments for a choice among formats (--candidates, --budget, --device), checked before measuring;
    empty without them (the one-recipe plan)."""
    if args.candidates is None and args.budget is None and args.device is None:
        return {}
    from lightning_precision.fp8._speed import speed_device, supported_candidates

    try:
        gpu, _ = speed_device(args.device)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--device {args.device!r}: {str(err).split(': ', 1)[-1]}") from None
    if args.candidates is None:
        names: tuple[str, ...] = supported_candidates(gpu, "torchao")
        if not names:
            raise ValueError(f"--device {gpu.name!r} runs no fp8 format: choose another GPU, or --candidates.")
    else:
        names = check_candidates(f"--candidates {args.candidates!r}",
                                 [c.strip() for c in args.candidates.split(",") if c.strip()])
    budget = math.inf
    if args.budget is not None:
        try:
            budget = float(args.budget)
        except ValueError:
            raise ValueError(f"--budget {args.budget!r}: a number >= 0 (or inf)") from None
        if math.isnan(budget) or budget < 0:
            raise ValueError(f"--budget {args.budget!r}: a number >= 0 (or inf)")
    rule = PlanRule(error_budget=budget)
    if args.device is not None and not chooses_formats(names, rule):  # one format and no budget: nothing to weigh
        raise ValueError(f"--device {args.device!r}: savings are weighed when choosing among formats; name several"
                         " --candidates, or a --budget")
    # no --device: the plan's own choice (this GPU; without one, a GPU that runs every candidate, as a prediction)
    return {"candidates": names, "device": args.device, "plan_rule": rule}


def _nothing_to_measure(model: nn.Module, recipe: str, scaling_family: str, emulate: bool) -> str | None:
    """Why no layer of ``model`` is left to measure, with the fix when there is one (``--emulate``); None if some is.
    ``scaling_family``: the CLI's torchao recipes are their own scaling families (tensorwise, rowwise)."""
    decisions = select_fp8_layers(model, scaling_family, skip_small_layers=not emulate)
    if any(d.fp8 for d in decisions):
        return None
    # Grouped by the rule (its details, such as each layer's dims, in parentheses left out): one readable line.
    reasons = ", ".join(f"{n} {why}" for why, n in _counted(d.reason.split(" (")[0] for d in decisions).items())
    head = (f"--recipe {recipe}: none of the {len(decisions)} linear layers of the embedded {recipe} default is left"
            f" to measure ({reasons})")
    if not emulate and any(d.fp8 for d in select_fp8_layers(model, scaling_family, skip_small_layers=False)):
        return (f"{head}. Without --emulate the plan is for an fp8 GPU, where layers this small run slower in fp8 than"
                " in bf16 and stay in bf16. Pass --emulate to judge them too (the plan for `fit --precision"
                " fp8-emulated`).")
    return f"{head}: no layer of it can run in fp8, so there is no plan to make."


def _counted(items: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def _usage_error(message: str) -> int:
    """Bad input, before anything is measured: one line, exit code 2 (as every command of ``lightning-precision``)."""
    say(f"lightning-precision plan: error: {' '.join(message.split())}")
    return 2
