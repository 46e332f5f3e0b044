"""The arguments of ``lightning-precision compare``: parsing, validation before any training, the defaults this machine
calls for (which precisions, which of them cannot run here and why), and what each precision name builds."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from lightning_precision._mfu import parse_peak_override
from lightning_precision.cli.compare.sizing import SIZES
from lightning_precision.cli.compare.user_model import ModelError, from_args
from lightning_precision.cli.console import quiet_lightning
from lightning_precision.cli.recipes import RECIPES

__all__ = [
    "BASELINES", "EVAL_PRECISIONS", "FP8_PRECISIONS", "LIGHTNINGS_OWN", "PRECISIONS", "QUICK_STEPS",
    "QUICK_VAL_BATCHES", "WARMUP", "UsageError", "block_size", "calibration_steps", "check_accelerator",
    "check_eval_precision", "compiled", "default_precisions", "emulated", "eval_note", "eval_of", "make_plugin",
    "on_gpu", "one_line", "parse_args", "precheck", "threads_note", "untimed_steps",
]

DESCRIPTION = ("``lightning-precision compare``: one recipe, or your own model (--model/--data or --config), under"
               " several precisions, same seed and steps, side by side.")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "fp8", "fp8-auto", "lightning-bf16-true")
FP8_PRECISIONS = ("fp8", "fp8-auto")  # fp8-auto: FP8Precision(layers="auto"), layers chosen from measured numerics
# Lightning's own plugins, run only when named, for comparison with ours: the verdict never recommends one.
BASELINES = ("lightning-bf16-true",)
# Rows of Lightning's own precision, no plugin of ours: they take no eval_precision, and evaluate as they train.
LIGHTNINGS_OWN = ("32-true", *BASELINES)
_BF16 = ("bf16-mixed", "bf16-true", "lightning-bf16-true")  # what bf16 hardware support decides
# --eval-precision: as-trained, or the plugins' eval_precision= values
EVAL_PRECISIONS = ("as-trained", "32-true", "bf16-mixed", "16-mixed")
WARMUP = 3  # first steps left out of every timing (allocation, autotuning, lazy init)
QUICK_STEPS, QUICK_VAL_BATCHES = 30, 2
MAX_SEED = 2**32 - 1  # Lightning's seed_everything (numpy's bound) refuses a seed outside [0, 2**32 - 1]


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


def one_line(text: object) -> str:
    """A message (or an exception's) as one line: the whole of it, whitespace runs folded."""
    return " ".join(str(text).split())


def calibration_steps(steps: int) -> int:
    """fp8-auto's measured steps: 8 (the plugin's default), fewer in short runs so that most steps run the plan."""
    return max(1, min(8, steps // 4))


def untimed_steps(precision: str, steps: int) -> int:
    """Steps left out of the timings: the warm-up, and for fp8-auto its measured steps and a warm-up after them."""
    return WARMUP + (calibration_steps(steps) if precision == "fp8-auto" else 0)


def block_size(steps: int) -> int:
    """Steps per turn: about ten turns per run."""
    return max(1, steps // 10)


def make_plugin(precision: str, emulate: bool, steps: int = 100, eval_precision: str | None = None) -> Any:
    """The Trainer plugin a precision name stands for (None for 32-true, the Trainer's default): ours, each with its
    default arguments and ``eval_precision`` (given only when not None), and for ``lightning-bf16-true`` Lightning's
    own ``precision="bf16-true"``. Lightning's rows (``LIGHTNINGS_OWN``) take no ``eval_precision``: ``eval_note`` says
    so."""
    from lightning_precision import (
        BF16MixedPrecision,
        BF16TruePrecision,
        FP8Precision,
        FP16MixedPrecision,
        FP16TruePrecision,
    )
    from lightning_precision.fp8._hardware import fp8_gpu_available

    if precision == "32-true":
        return None
    if precision == "lightning-bf16-true":
        from lightning.pytorch.plugins.precision import HalfPrecision

        return HalfPrecision("bf16-true")
    evaluation: dict[str, Any] = {} if eval_precision is None else {"eval_precision": eval_precision}
    if precision == "bf16-mixed":
        return BF16MixedPrecision(**evaluation)
    if precision == "bf16-true":
        return BF16TruePrecision(**evaluation)
    if precision == "16-mixed":
        return FP16MixedPrecision(**evaluation)
    if precision == "16-true":
        return FP16TruePrecision(**evaluation)
    # Emulated fp8 is for numerics on small models: run every eligible layer in fp8, not only the large ones.
    emulated_fp8 = emulate and not fp8_gpu_available()
    if precision == "fp8-auto":
        return FP8Precision(emulate=emulated_fp8, skip_small_layers=not emulate, layers="auto",
                            calibration_batches=calibration_steps(steps), **evaluation)
    return FP8Precision(emulate=emulated_fp8, skip_small_layers=not emulate, **evaluation)


def eval_of(args: argparse.Namespace) -> str | None:
    """The plugins' ``eval_precision=`` that ``--eval-precision`` asks for: None to evaluate as trained."""
    chosen = getattr(args, "eval_precision", "as-trained")  # a Namespace a script built may lack it
    return None if chosen == "as-trained" else chosen


def check_eval_precision(precisions: list[str], args: argparse.Namespace) -> None:
    """A ``UsageError`` naming every row of ours whose plugin cannot evaluate in ``--eval-precision`` (a true plugin
    in bf16-mixed): said before any training, not as a failed row after minutes of it. A plugin that cannot be built
    here for another reason (hardware, a package) is ``precheck``'s to report."""
    wanted = eval_of(args)
    if wanted is None:
        return
    refused: dict[str, str] = {}
    for p in precisions:
        if p in LIGHTNINGS_OWN:
            continue
        try:
            make_plugin(p, args.emulate, args.steps, wanted)
        except (TypeError, ValueError) as err:  # TypeError: a plugin that takes no eval_precision at all
            if "eval_precision" in str(err):
                refused[p] = one_line(err)
        except Exception:  # precheck builds it again and reports why
            pass
    if refused:
        first = next(iter(refused.values())).rstrip(".")  # it goes in parentheses
        raise UsageError(f"--eval-precision {wanted}: {', '.join(refused)} cannot evaluate in {wanted} ({first});"
                         f" leave {'them' if len(refused) > 1 else 'it'} out of --precisions, or choose another"
                         f" --eval-precision ({', '.join(EVAL_PRECISIONS)}).")


def eval_note(precisions: list[str], args: argparse.Namespace) -> str | None:
    """The report's line on the precision of the validation behind "val acc"; None when no validation runs."""
    if not args.val_batches:
        return None
    wanted = eval_of(args)
    if wanted is None:
        return "val acc: each precision evaluated as it trains (--eval-precision as-trained)."
    # Lightning's own 32-true evaluates in fp32 as it trains: already what 32-true asks
    asked = [p for p in precisions if p not in LIGHTNINGS_OWN or p == wanted]
    own = [p for p in precisions if p not in asked]
    if not own:
        return f"val acc: evaluated in {wanted} for every precision (--eval-precision {wanted})."
    where = f"in {wanted} for {', '.join(asked)}" if asked else "in no other precision"
    return (f"val acc: evaluated {where} (--eval-precision {wanted}); {', '.join(own)} as trained: Lightning's own"
            " precision takes no eval_precision.")


# --threads above this many a CPU is refused: threads beyond the CPUs only take turns on them, and in the thousands
# OpenMP fails to start them (libgomp aborts the process; 10**5 crashed it; 2**63 overflows torch's argument).
MAX_THREADS_PER_CPU = 8


def _check_threads(threads: int) -> None:
    from lightning_precision.cli.compare.threads import usable_cpus

    if threads < 1:
        raise UsageError(f"--threads {threads}: give a number of threads >= 1, or leave it out for torch's own choice.")
    cpus = usable_cpus()
    most = MAX_THREADS_PER_CPU * cpus
    if threads > most:
        raise UsageError(f"--threads {threads} is more than {most}, {MAX_THREADS_PER_CPU} for each of the {cpus} CPUs"
                         " this process may run on: threads beyond the CPUs only take turns on them, and thousands"
                         f" cannot be started; give at most {cpus}, or leave it out for torch's own choice.")


def threads_note(threads: int | None) -> str | None:
    """A warning where ``--threads`` asks for more threads than this process may run on."""
    from lightning_precision.cli.compare.threads import usable_cpus

    cpus = usable_cpus()
    if threads is None or threads <= cpus:
        return None
    return (f"--threads {threads} is more than the {cpus} CPUs this process may run on: the threads take turns on"
            " them, which slows every step.")


def on_gpu(args: argparse.Namespace) -> bool:
    return torch.cuda.is_available() and args.accelerator in ("auto", "cuda", "gpu")


def compiled(precision: str, args: argparse.Namespace) -> bool:
    """Whether a precision's run compiles its LightningModule (``torch.compile`` before the fit): the fp8 rows where
    they run real fp8 (a CUDA GPU of compute capability >= 8.9). Eager fp8 casts are separate kernels, slower than
    bf16 (../shared/GPU.md; torchao's own advice); emulated fp8 is about numerics, so it stays eager."""
    from lightning_precision.fp8._hardware import fp8_gpu_available

    return precision in FP8_PRECISIONS and on_gpu(args) and fp8_gpu_available()


def emulated(precision: str, machine: dict[str, Any], gpu: bool) -> bool:
    """Whether this precision's arithmetic is emulated where it runs: its speed then says nothing about the format."""
    if precision in FP8_PRECISIONS:
        from lightning_precision.fp8._hardware import fp8_gpu_available

        return not fp8_gpu_available()
    if gpu or precision == "32-true":
        return False
    return not machine["cpu"][f"native_{'bf16' if precision in _BF16 else 'fp16'}"]


def default_precisions(machine: dict[str, Any], args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The precisions this machine can compare usefully, and a line for each one left out, saying why."""
    from lightning_precision import _imports
    from lightning_precision.fp8._hardware import fp8_gpu_available

    chosen, notes = ["32-true"], []
    gpu = on_gpu(args)
    no_bf16 = precheck("bf16-mixed", args) if gpu else None
    if no_bf16:
        notes.append(f"bf16-mixed left out: {no_bf16}")
    else:
        chosen.append("bf16-mixed")
    if gpu or machine["cpu"]["native_fp16"]:
        chosen.append("16-mixed")
    else:
        notes.append("16-mixed left out: this CPU has no fp16 arithmetic (torch emulates it, several times slower than"
                     " 32-true). Add it with --precisions 32-true,bf16-mixed,16-mixed to check its numerics.")
    if fp8_gpu_available() or args.emulate:
        if _imports.TORCHAO_AVAILABLE:
            chosen.append("fp8")
        else:
            notes.append(f"fp8 left out: torchao is not installed ({_imports.install_command('torchao')}).")
    return chosen, notes


def precheck(precision: str, args: argparse.Namespace) -> str | None:
    """Why this precision cannot run here, found before any precision starts; None if it can."""
    from lightning_precision import _imports

    if precision in FP8_PRECISIONS and not _imports.TORCHAO_AVAILABLE:
        return f"{precision} needs torchao, which is not installed: {_imports.install_command('torchao')}"
    if precision in _BF16 and on_gpu(args):
        from lightning_precision._core.devices import check_bf16_supported

        try:
            check_bf16_supported("cuda")
        except RuntimeError as err:
            return one_line(err)
    try:
        make_plugin(precision, args.emulate, args.steps, eval_of(args))
    except Exception as err:  # a constructor's own check (hardware, versions): its message is the reason
        return f"{type(err).__name__}: {one_line(err)}"
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-precision compare", description=DESCRIPTION,
        epilog="Run `lightning-precision doctor` to see what this machine supports natively. Exit codes: 0 all ran, 1"
               " a precision failed or the report could not be written, 2 bad arguments or --out held by another"
               " run, 130 interrupted by Ctrl-C, 143 by SIGTERM, 129 by SIGHUP (the terminal closed; not under"
               " nohup): what finished is written.")
    parser.add_argument("--recipe", default=None,
                        help=f"the recipe: {', '.join(RECIPES)} (default: distilbert, unless --model or --config names"
                             " your own model)")
    parser.add_argument("--model", default=None,
                        help="your LightningModule instead of a recipe, as an import path (my_pkg.models.Net; the"
                             " current directory is importable, as for `python -m`), with --data")
    parser.add_argument("--data", default=None, help="your LightningDataModule, as an import path (my_pkg.data.Data)")
    parser.add_argument("--model-args", default=None, help="--model's init args as a JSON object: '{\"hidden\": 64}'")
    parser.add_argument("--data-args", default=None,
                        help="--data's init args as a JSON object: '{\"batch_size\": 64}' (the data sets the batch)")
    parser.add_argument("--config", default=None,
                        help="a LightningCLI config (YAML) whose model: and data: (class_path, init_args) name your"
                             " model, instead of --model and --data; its other keys (trainer: ...) are ignored, and"
                             " said to be")
    parser.add_argument("--precisions", default=None,
                        help=f"comma-separated, from {', '.join(PRECISIONS)} (default: chosen for this machine:"
                             " 32-true and bf16-mixed; 16-mixed where fp16 arithmetic is native"
                             " (any CUDA GPU, CPUs with AVX512-FP16/AMX-FP16); fp8 on a GPU of compute capability >="
                             " 8.9 or with --emulate). bf16-true, 16-true: BF16TruePrecision(), FP16TruePrecision()"
                             " (16-bit weights, gradients and optimizer states). fp8-auto: the layers chosen from their"
                             " measured fp8 numerics (FP8Precision(layers='auto'); its measured steps are left out of"
                             " the timings). lightning-bf16-true: Lightning's own precision='bf16-true', a baseline"
                             " (only when named)")
    _add_run_options(parser)
    return parser


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """How each precision runs: steps, batch, size, validation, seed, machine, output."""
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps per precision (default: 100; {QUICK_STEPS} with --quick)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="a recipe's samples per step (default: 32 for the embedded default; at the real"
                             " dimensions, the most that fits the GPU, see --size; your own data sets its own)")
    parser.add_argument("--size", default="auto", choices=SIZES,
                        help="a recipe's size: embedded (the small default a CPU trains in seconds), real"
                             " (DistilBERT-base at 128 tokens, ViT-B/16 and ResNet50 at 224x224, randomly initialised,"
                             " with a batch that fills a share of the GPU's memory: the speed a GPU shows), or auto:"
                             " real on a CUDA GPU, embedded elsewhere (default: auto)")
    parser.add_argument("--val-batches", type=int, default=None,
                        help=f"validation batches for the accuracy, 0 for none (default: 8; {QUICK_VAL_BATCHES} with"
                             " --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the data and their order (default: 0)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a rough first look: {QUICK_STEPS} steps, {QUICK_VAL_BATCHES} validation batches")
    parser.add_argument("--accelerator", default="auto", help="auto, cpu, cuda, ... (default: auto)")
    parser.add_argument("--data-dir", default=None,
                        help="real data for the recipe: aclImdb for distilbert, an ImageFolder for vit and resnet50"
                             " (default: the recipe's embedded generated task)")
    parser.add_argument("--emulate", action="store_true",
                        help="allow fp8 without fp8 hardware (torchao emulation: numerics, not speed)")
    parser.add_argument("--eval-precision", default="as-trained", choices=EVAL_PRECISIONS,
                        help="the precision of the validation behind val acc: as-trained (each precision evaluates as"
                             " it trains), or one for every plugin of ours: 32-true, bf16-mixed, 16-mixed (their"
                             " eval_precision=; Lightning's own rows, 32-true and lightning-bf16-true, evaluate as they"
                             " train, which for 32-true is fp32; a row whose plugin cannot evaluate so is refused"
                             " before any training) (default: as-trained)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads each precision's process may use (torch's threads, OMP_NUM_THREADS,"
                             " MKL_NUM_THREADS), for a machine shared with other work (default: torch's own choice,"
                             " one per physical core)")
    parser.add_argument("--out", default="compare-report", help="output folder (default: ./compare-report)")
    parser.add_argument("--peak-tflops", default=None,
                        help="the device's peak for MFU, instead of the built-in table of GPUs: one number in TFLOP/s"
                             " for every precision, or kind=number pairs (kinds fp32, tf32, bf16, fp16, fp8), e.g."
                             " bf16=989,fp8=1979")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command's arguments with the defaults filled in; a ``UsageError`` for any that every run would refuse.
    ``--out`` is checked when ``main`` claims it, under its lock, so that no check writes into a folder another run
    holds."""
    from lightning_precision.fp8._hardware import fp8_gpu_available

    args = _parser().parse_args(argv)
    try:
        args.user = from_args(args)  # the user's model instead of a recipe: imported and checked now
    except ModelError as err:
        raise UsageError(str(err)) from None
    if args.user is not None:
        args.recipe = args.user.label
    args.recipe = args.recipe or "distilbert"
    args.batch_size_given = args.batch_size is not None  # it wins over the batch sizing chooses (main, sizing)
    if args.batch_size is None and args.user is None:  # your own data's batch is measured (main.measure_batch)
        args.batch_size = 32
    if args.user is None and args.recipe not in RECIPES:
        raise UsageError(f"unknown recipe {args.recipe!r}: choose one of {', '.join(RECIPES)}")
    args.steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else 100)
    args.val_batches = args.val_batches if args.val_batches is not None else (QUICK_VAL_BATCHES if args.quick else 8)
    if args.precisions is not None:
        given = args.precisions
        args.precisions = list(dict.fromkeys(p.strip() for p in given.split(",") if p.strip()))
        if not args.precisions:
            raise UsageError(f"--precisions {given!r} names no precision: choose from {', '.join(PRECISIONS)}")
        for p in args.precisions:
            if p not in PRECISIONS:
                raise UsageError(f"unknown precision {p!r}: choose from {', '.join(PRECISIONS)}")
        fp8 = [p for p in args.precisions if p in FP8_PRECISIONS]
        if fp8 and not (fp8_gpu_available() or args.emulate):
            raise UsageError(f"{fp8[0]} needs a CUDA GPU of compute capability >= 8.9; pass --emulate to run its"
                             " numerics emulated")
    try:
        args.peak_overrides = parse_peak_override(args.peak_tflops) if args.peak_tflops is not None else {}
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.steps < 1 or (args.batch_size is not None and args.batch_size < 1) or args.val_batches < 0:
        raise UsageError("--steps and --batch-size must be positive, --val-batches not negative")
    if args.threads is not None:
        _check_threads(args.threads)
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed {args.seed} is out of range: seeds go from 0 to {MAX_SEED} (2**32 - 1).")
    if args.accelerator != "auto":
        check_accelerator(args.accelerator)
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise UsageError(f"data folder {args.data_dir!r} does not exist")
    return args


def check_accelerator(name: str) -> None:
    """A ``UsageError`` if a Trainer refuses ``--accelerator`` here (unknown, or absent from this machine), which every
    precision's run would do."""
    import lightning as L

    quiet_lightning()  # the Trainer's banner ("GPU available: ...") is for runs, not for a check
    try:
        L.Trainer(accelerator=name, devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    except Exception as err:  # Lightning raises ValueError, MisconfigurationException, ImportError
        raise UsageError(f"--accelerator {name!r}: {one_line(err)}") from None
