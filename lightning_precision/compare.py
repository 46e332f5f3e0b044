"""``lightning-precision compare``: one recipe under several precisions, same seed and steps, side by side.

Per precision: median step time, samples/s, speedup over 32-true, peak memory, final loss, validation accuracy,
gradient underflow fraction (fp16, at the loss scale in effect) and skipped steps. A table on the terminal, and
``report.json``, ``report.csv``, ``loss.png``, ``throughput.png``, ``memory.png`` in the output folder.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_precision._io import check_writable_dir
from lightning_precision.callbacks import GradientUnderflowMonitor
from lightning_precision.fp8 import fp8_gpu_available
from lightning_precision.recipes import RECIPES

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "fp8")
WARMUP = 3


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


def make_plugin(precision: str, emulate: bool) -> Any:
    from lightning_precision import BF16MixedPrecision, FP8Precision, FP16MixedPrecision

    if precision == "32-true":
        return None
    if precision == "bf16-mixed":
        return BF16MixedPrecision()
    if precision == "16-mixed":
        return FP16MixedPrecision()
    # Emulated fp8 is for numerics on small models: run every eligible layer in fp8, not only the large ones.
    return FP8Precision(emulate=emulate and not fp8_gpu_available(), skip_small_layers=not emulate)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RunStats(Callback):
    """Step times, losses, memory, and a progress callback, for one run."""

    def __init__(self, on_step: Any = None) -> None:
        self.times: list[float] = []
        self._losses: list[torch.Tensor] = []
        self.on_step = on_step
        self.cuda = torch.cuda.is_available()
        self.rss_start = self.rss_peak = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.rss_start = self.rss_peak = _rss_bytes()

    def on_train_batch_start(self, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)
        self._losses.append(outputs["loss"].detach())  # read once, after the run: no device read inside the timing
        self.rss_peak = max(self.rss_peak, _rss_bytes())
        if self.on_step:
            self.on_step()

    @property
    def losses(self) -> list[float]:
        return torch.stack(self._losses).float().tolist() if self._losses else []

    def peak_memory_mb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return (self.rss_peak - self.rss_start) / 2**20


def run_one(recipe: str, precision: str, args: argparse.Namespace, on_step: Any = None) -> dict[str, Any]:
    L.seed_everything(args.seed, verbose=False)
    spec = RECIPES[recipe]
    data_args = {"batch_size": args.batch_size, "seed": args.seed}
    if args.data_dir:
        data_args["data_dir"] = args.data_dir
    model, data = spec.build(data_args=data_args)
    stats = RunStats(on_step)
    monitor = GradientUnderflowMonitor(formats=("fp16",), top_k=0, warn_threshold=1.0,
                                       measure_every_n_steps=max(1, args.steps // 10), log_every_n_steps=args.steps)
    plugin = make_plugin(precision, args.emulate)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.steps, plugins=[plugin] if plugin else None,
        callbacks=[stats, monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=args.val_batches, num_sanity_val_steps=0,
        check_val_every_n_epoch=10**9, log_every_n_steps=args.steps,  # validation once, after the timed steps
    )
    trainer.fit(model, data)
    metrics = dict(trainer.callback_metrics)
    val = trainer.validate(model, datamodule=data, verbose=False)[0] if args.val_batches else {}
    times, losses = stats.times[WARMUP:] or stats.times, stats.losses
    step = statistics.median(times)
    underflow = metrics.get("precision/underflow/fp16/scaled", metrics.get("precision/underflow/fp16"))
    return {
        "precision": precision,
        "median_step_ms": step * 1e3,
        "samples_per_s": args.batch_size / step,
        "peak_memory_mb": stats.peak_memory_mb(),
        "final_loss": statistics.mean(losses[-5:]),
        "val_acc": float(val["val_acc"]) if "val_acc" in val else None,
        "grad_underflow_fp16": float(underflow) if underflow is not None else None,
        "skipped_steps": getattr(trainer.precision_plugin, "skipped_steps", 0),
        "losses": losses,
    }


def add_speedups(rows: list[dict[str, Any]]) -> None:
    ok = [r for r in rows if "error" not in r]
    base = next((r for r in ok if r["precision"] == "32-true"), None)
    for r in ok:
        r["speedup"] = base["median_step_ms"] / r["median_step_ms"] if base else None


def write_reports(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if "error" not in r]
    (out / "report.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    columns = ["precision", "median_step_ms", "samples_per_s", "speedup", "peak_memory_mb", "final_loss", "val_acc",
               "grad_underflow_fp16", "skipped_steps", "error"]
    with open(out / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    files = [str(out / "report.json"), str(out / "report.csv")]
    try:
        from lightning_precision.plotting import plot_compare

        files += plot_compare(ok, out)
    except ModuleNotFoundError as err:  # matplotlib missing: the table, JSON and CSV still stand
        warnings.warn(str(err))
    return files


def print_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.table import Table

    from lightning_precision._console import console

    title = f"{meta['recipe']}: {meta['task']} | {meta['steps']} steps, batch {meta['batch_size']}, {meta['device']}"
    table = Table(title=title + (" | INTERRUPTED: partial results" if meta.get("interrupted") else ""))
    for column in ("precision", "ms/step", "samples/s", "speedup", "peak mem MB", "final loss", "val acc",
                   "fp16 underflow", "skipped"):
        table.add_column(column, justify="left" if column == "precision" else "right")

    def fmt(value: Optional[float], spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        if "error" in r:
            table.add_row(r["precision"], f"[red]failed: {r['error'][:60]}[/red]", *[""] * 7)
            continue
        table.add_row(r["precision"], fmt(r["median_step_ms"], ".1f"), fmt(r["samples_per_s"], ".0f"),
                      fmt(r.get("speedup"), ".2f") + ("x" if r.get("speedup") else ""), fmt(r["peak_memory_mb"], ".0f"),
                      fmt(r["final_loss"], ".3f"), fmt(r["val_acc"], ".3f"), fmt(r["grad_underflow_fp16"], ".2e"),
                      str(r["skipped_steps"]))
    console().print(table)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lightning-precision compare", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="distilbert", help=f"one of {', '.join(RECIPES)} (default distilbert)")
    parser.add_argument("--precisions", default=None,
                        help="comma-separated, from 32-true, bf16-mixed, 16-mixed, fp8 (default: the first three, plus"
                             " fp8 on a GPU of compute capability >= 8.9 or with --emulate)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches for the accuracy (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="auto", help="auto, cpu, cuda, ...")
    parser.add_argument("--data-dir", default=None, help="real data for the recipe (aclImdb, ImageFolder, ...)")
    parser.add_argument("--emulate", action="store_true", help="allow fp8 without fp8 hardware (torchao emulation)")
    parser.add_argument("--out", default="compare-report", help="output folder (default ./compare-report)")
    args = parser.parse_args(argv)
    if args.recipe not in RECIPES:
        raise UsageError(f"unknown recipe {args.recipe!r}: choose one of {', '.join(RECIPES)}")
    if args.precisions is None:
        args.precisions = ["32-true", "bf16-mixed", "16-mixed"] + (["fp8"] if fp8_gpu_available() or args.emulate else [])
    else:
        given = args.precisions
        args.precisions = [p.strip() for p in given.split(",") if p.strip()]
        if not args.precisions:
            raise UsageError(f"--precisions {given!r} names no precision: choose from {', '.join(PRECISIONS)}")
    for p in args.precisions:
        if p not in PRECISIONS:
            raise UsageError(f"unknown precision {p!r}: choose from {', '.join(PRECISIONS)}")
    if "fp8" in args.precisions and not (fp8_gpu_available() or args.emulate):
        raise UsageError("fp8 needs a CUDA GPU of compute capability >= 8.9; pass --emulate to run its numerics emulated")
    if args.steps < 1 or args.batch_size < 1 or args.val_batches < 0:
        raise UsageError("--steps and --batch-size must be positive, --val-batches not negative")
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise UsageError(f"data folder {args.data_dir!r} does not exist")
    try:  # before any training: an output folder that cannot be written must not cost the whole comparison
        check_writable_dir(args.out, "--out")
    except ValueError as err:
        raise UsageError(str(err)) from None
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)  # one table, not a Trainer banner per precision
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    spec = RECIPES[args.recipe]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.accelerator != "cpu" else "cpu"
    meta = {"recipe": args.recipe, "task": spec.task if not args.data_dir else args.data_dir, "chance": spec.chance,
            "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed, "device": device,
            "torch": torch.__version__, "lightning": L.__version__, "interrupted": False}
    rows: list[dict[str, Any]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as progress:
        for precision in args.precisions:
            if meta["interrupted"]:
                rows.append({"precision": precision, "error": "not run: the comparison was interrupted before it"})
                continue
            task = progress.add_task(f"{args.recipe} {precision:>10}", total=args.steps)
            try:
                rows.append(run_one(args.recipe, precision, args, on_step=lambda: progress.advance(task)))
            except (KeyboardInterrupt, SystemExit):
                # Lightning turns Ctrl-C inside `fit` into SystemExit(1) (and ignores SIGINT from then on): keep what
                # finished, say what did not, and let a second Ctrl-C stop the report writing as usual.
                signal.signal(signal.SIGINT, signal.default_int_handler)
                meta["interrupted"] = True
                rows.append({"precision": precision, "error": "interrupted (Ctrl-C) while it ran"})
            except Exception as err:  # one failed precision must not lose the others
                rows.append({"precision": precision, "error": f"{type(err).__name__}: {err}"})
    add_speedups(rows)
    print_table(rows, meta)  # first: whatever happens to the files, the results are on the screen
    try:
        files = write_reports(rows, Path(args.out), meta)
    except OSError as err:
        print(f"lightning-precision compare: could not write the report to {args.out!r}: {err}", file=sys.stderr)
        return 1
    print("wrote " + ", ".join(files))
    if meta["interrupted"]:
        return 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
    return 1 if any("error" in r for r in rows) else 0
