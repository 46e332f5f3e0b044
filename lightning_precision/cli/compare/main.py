"""``lightning-precision compare``: one recipe under several precisions, same seed and steps, side by side.

Each precision trains in its own process, and the processes take turns: a block of steps each, in an order that
rotates every round, so a machine that slows down or speeds up during the comparison slows every precision alike, and
each precision's memory is its own process's, whatever the run order. Every timing figure rests on each turn's median
step time: ms/step is their median, and samples/s and MFU follow from it. The speedup is one statistic: the median of
the paired ratios (32-true's turn over this precision's in the same round, measured back to back), printed with their
interquartile range as its bracket, which the verdict reads too; a speedup whose bracket includes 1x, or that ms/step
puts on the other side of 1x (the machine's speed changed), is flagged as not resolved (``rows.speedup_text``).

Per precision: step time (median and spread), samples/s, speedup, peak memory, final loss, validation accuracy,
gradient underflow in fp16 (unscaled, and at the loss scale for 16-mixed) and skipped steps. A table on the terminal
(a line per finished turn where stdout is not one), and ``report.md``, ``report.json`` (with the machine),
``report.csv``, ``loss.png``, ``throughput.png`` and ``memory.png`` in the output folder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_precision._mfu import model_flops_per_step
from lightning_precision.cli.compare import runner, sizing, user_model
from lightning_precision.cli.compare.args import (
    PRECISIONS,
    UsageError,
    check_eval_precision,
    compiled,
    default_precisions,
    eval_note,
    on_gpu,
    one_line,
    parse_args,
    precheck,
    threads_note,
)
from lightning_precision.cli.compare.outdir import claim_folder
from lightning_precision.cli.compare.report import FILES
from lightning_precision.cli.compare.rows import Row, add_mfu, add_speedups, make_row, schedule
from lightning_precision.cli.compare.threads import threads_bounded
from lightning_precision.cli.console import lightning_quieted, say
from lightning_precision.cli.recipes import RECIPES, training_loss
from lightning_precision.cli.spawn import exit_if_importing_main
from lightning_precision.cli.stop import Interrupted, Stop, signal_name

__all__ = ["PRECISIONS", "UsageError", "choose_workload", "main", "measure_batch"]

# The parts: ``compare_args`` (the arguments), ``runner`` (the processes, taking turns), ``child`` (one precision's
# run, in its process), ``rows`` (the figures, typed) and ``report`` (the table and the files). This module ties them.


# ------------------------------------------------------------------------------------------------------------- main


def main(argv: list[str], stop: Stop | None = None) -> int:
    """``lightning-precision compare``: the exit code. ``stop``: the recorder of SIGINT, SIGTERM and SIGHUP that the
    command line installed before importing this module (torch and Lightning take seconds to import); without one, one
    is installed for the call."""
    exit_if_importing_main()  # a process of a comparison importing a script that lacks the __main__ guard: ends here
    with contextlib.ExitStack() as held:
        held.enter_context(lightning_quieted())
        if stop is None:
            stop = held.enter_context(Stop())
        try:
            with stop.raising():  # nothing is under way yet (--accelerator builds a Trainer): a signal ends it at once
                args = parse_args(argv)
        except Interrupted:
            say(stop.nothing_written())
            return stop.exit_code(1)
        # Before any training (an output folder that cannot be written must not cost the whole comparison), and held
        # for the whole run, released on every way out: a second run on this folder is refused meanwhile.
        try:
            folder = held.enter_context(claim_folder(args.out, "--out", FILES))
        except ValueError as err:
            raise UsageError(str(err)) from None
        # the processes' imports, in the fork server, while this process measures the batch; ended with the command
        held.enter_context(runner.fork_server())
        code = _compare(args, argv, folder, stop)
    return stop.exit_code(code)


def _prepare(args: argparse.Namespace, argv: list[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], Any]:
    """Before any process starts: the machine, the report's meta (with the batch measured once), the precisions that
    cannot run here and why, and the console (its first lines printed)."""
    from lightning_precision.cli.console import console
    from lightning_precision.cli.machine import describe, machine_info

    machine = machine_info()
    notes: list[str] = []
    if args.precisions is None:
        args.precisions, notes = default_precisions(machine, args)
    check_eval_precision(args.precisions, args)  # a row that cannot evaluate as asked: refused before any training
    notes += [note for note in (threads_note(args.threads), eval_note(args.precisions, args)) if note]
    if args.user is not None:  # the report names the classes it trained, with their init args
        notes += args.user.notes()
        trained = {"task": args.user.describe(), "chance": None, "model": args.user.model.call(),
                   "data": args.user.data.call(), **({"config": args.user.config} if args.user.config else {})}
    else:
        workload = choose_workload(args)
        notes += [workload.warning] if workload.warning else []
        spec = RECIPES[args.recipe].sized(workload.size)
        trained = {"task": spec.task if not args.data_dir else args.data_dir, "chance": spec.chance,
                   "size": workload.size, "workload": workload.why}
    gpu = on_gpu(args)
    meta = {"recipe": args.recipe, **trained,
            "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed, "val_batches": args.val_batches,
            "quick": args.quick, "eval_precision": args.eval_precision, "threads": args.threads,
            "device": torch.cuda.get_device_name() if gpu else "cpu",
            "machine_line": describe(machine, "cuda" if gpu else "cpu"), "machine": machine, "notes": notes,
            "interrupted": False, "command": shlex.join(["lightning-precision", "compare", *argv])}
    meta["compiled"] = [p for p in args.precisions if compiled(p, args)]
    with threads_bounded(args.threads):  # this process's one measured step keeps to --threads too
        meta.update(measure_batch(args))  # first: data that every run would refuse is one line, nothing before it
    out = console(outlive_reader=True)  # `compare | head` must not end the comparison: the report is written
    out.print(f"[bold]{args.recipe}[/bold] on {meta['machine_line']}", highlight=False)
    if "workload" in meta:
        out.print(f"workload: {meta['workload']}", highlight=False, markup=False)
    for note in notes:
        out.print(f"note: {note}", highlight=False, markup=False)
    doomed = {p: why for p in args.precisions if (why := precheck(p, args))}
    for p, why in doomed.items():
        out.print(f"{p} cannot run here: {why}", style="red", highlight=False, markup=False)
    return machine, meta, doomed, out


def _compare(args: argparse.Namespace, argv: list[str], folder: Path, stop: Stop) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lightning_precision.cli.compare import report

    try:
        with stop.raising():  # nothing runs yet (measuring the batch takes seconds): a signal ends it at once
            machine, meta, doomed, out = _prepare(args, argv)
    except Interrupted:
        say(stop.nothing_written(args.out))
        return 1
    runnable = [p for p in args.precisions if p not in doomed]
    runs: dict[str, runner.Run] = {}
    if runnable:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=out, disable=not out.is_terminal) as progress:
            runs = runner.run_all(args, runnable, progress, stop)
    stopped_by = None
    if stop.signum is not None and (len(runs) < len(runnable) or not all(r.finished for r in runs.values())):
        stopped_by = signal_name(stop.signum)
        meta.update(interrupted=True, signal=signal.Signals(stop.signum).name)
    rows: list[Row] = []
    for p in args.precisions:
        if p in doomed:
            rows.append(Row(p, error=doomed[p]))
        elif p not in runs:
            rows.append(Row(p, error=f"not started: the comparison was interrupted ({stopped_by}) before it",
                            interrupted=stopped_by))
        else:
            rows.append(make_row(runs[p], args, machine, stopped_by))
    meta["schedule"] = schedule(rows, args)
    _record_threads(meta, runs)
    add_speedups(rows, runs, args.steps)
    add_mfu(rows, meta, args)
    meta["verdict"] = report.verdict(rows, meta)
    if meta["interrupted"] and not any(r.steps_done for r in rows):  # a report of nothing replaces no report
        say(stop.nothing_written(args.out))
        return 1
    report.print_table(rows, meta, out)  # first: whatever happens to the files, the results are on the screen
    try:  # whole or not at all, also when interrupted: written beside the folder, then swapped in
        where, names, note = report.write_reports(rows, folder, meta)
    except OSError as err:
        say(f"lightning-precision compare: could not write the report to {args.out!r} ({err}); the folder keeps what"
            " it held.")
        return 1
    if where != folder:
        say(f"lightning-precision compare: could not write the report to {args.out!r}: {note}.")
    elif note:
        say(f"lightning-precision compare: note: {note}.")
    shown = Path(args.out) if where == folder else where  # the folder as the user named it
    out.print("wrote " + ", ".join(str(shown / name) for name in names), highlight=False, markup=False, soft_wrap=True)
    return 1 if where != folder or any(r.error is not None for r in rows) else 0


def _record_threads(meta: dict[str, Any], runs: dict[str, runner.Run]) -> None:
    """The torch threads each precision's process ran with, as it counted them (``torch_threads``), on the machine
    line: what bounds a CPU's speed, whether --threads set it or torch chose."""
    counted = {p: run.threads for p, run in runs.items() if run.threads is not None}
    meta["torch_threads"] = counted
    if not counted:
        return
    values = set(counted.values())
    figure = str(values.pop()) if len(values) == 1 else ", ".join(f"{p} {n}" for p, n in counted.items())
    omp = os.environ.get("OMP_NUM_THREADS")  # what torch's default follows where it is set
    given = (f"--threads {meta['threads']}" if meta.get("threads") else f"OMP_NUM_THREADS={omp}" if omp else
             "torch's default")
    meta["machine_line"] += f"; torch threads per precision's process: {figure} ({given})"


def choose_workload(args: argparse.Namespace) -> sizing.Workload:
    """The recipe's size and batch for this machine (``sizing.choose_workload`` over the GPU's memory as it is now),
    set on ``args`` (``size``, ``batch_size``) for the precisions' processes and the report."""
    gpu = None
    if on_gpu(args):
        free, total = torch.cuda.mem_get_info()
        gpu = sizing.Gpu(torch.cuda.get_device_name(), total, free)
    no_gpu = f"--accelerator {args.accelerator}" if torch.cuda.is_available() else "no CUDA GPU"
    given = args.batch_size if getattr(args, "batch_size_given", True) else None
    try:
        workload = sizing.choose_workload(args.size, RECIPES[args.recipe].real, gpu, given, len(args.precisions),
                                          no_gpu)
    except ValueError as err:
        raise UsageError(str(err)) from None
    args.size, args.batch_size = workload.size, workload.batch_size
    return workload


def measure_batch(args: argparse.Namespace) -> dict[str, Any]:
    """What one training batch of the recipe costs and holds, the same for every precision, so measured once before the
    runs: ``model_flops_per_step`` (forward and backward, in fp32 on the CPU, at the real dimensions on two samples
    and scaled to the batch; None if it cannot be counted) and ``units_per_batch`` with its ``unit`` (tokens or
    images). For the user's own model, ``batch_size`` too (its
    batch's first dim: samples/s rests on it), and ``flops_note`` where its FLOPs could not be counted."""
    if args.user is not None:
        try:
            measured = user_model.measure_batch(args.user, args.seed)
        except user_model.ModelError as err:
            raise UsageError(str(err)) from None
        args.batch_size = measured["batch_size"]  # samples/s: the precisions' processes do not read it
        return measured
    real = getattr(args, "size", None) == "real"  # as choose_workload set it; "auto" is unresolved: the default
    recipe = RECIPES[args.recipe].sized("real" if real else "embedded")
    data_args = {"batch_size": args.batch_size, "seed": args.seed}
    if args.data_dir:
        data_args["data_dir"] = args.data_dir
    out: dict[str, Any] = {"model_flops_per_step": None, "unit": recipe.unit, "units_per_batch": None}
    given = (f"--recipe {args.recipe}{' --size real' if real else ''} --batch-size {args.batch_size}"
             + (f" --data-dir {args.data_dir}" if args.data_dir else ""))
    try:
        model, (batch,) = recipe.training_batches(1, data_args)
        out["units_per_batch"] = recipe.units(batch)
    except Exception as err:  # every precision's run builds the same data: none of them could start
        raise UsageError(f"{given}: the recipe's first batch cannot be made ({type(err).__name__}: {one_line(err)}),"
                         " so every precision would fail; check --data-dir or choose other arguments.") from None
    # At the real dimensions the whole batch would take the CPU minutes: their FLOPs grow with the batch and nothing
    # else (no term that does not), so two samples are counted, and scaled.
    counted = [t[:2] if isinstance(t, torch.Tensor) else t for t in batch] if real else batch
    try:
        out["model_flops_per_step"] = (model_flops_per_step(model, counted, training_loss) * len(batch[-1])
                                       // len(counted[-1]))
    except Exception as err:
        _check_one_step(model, counted, given)
        # a model flop_counter cannot trace: MFU is then n/a, the comparison still runs
        warnings.warn(f"compare: the model's FLOPs could not be counted ({type(err).__name__}: {err}); MFU is n/a.",
                      stacklevel=2)
    return out


def _check_one_step(model: Any, batch: Any, given: str) -> None:
    """A ``UsageError`` if one fp32 training step fails here for a reason that is not memory (every precision's run
    would fail the same way: a ResNet's batch norm refuses a batch of 1)."""
    try:
        model.training_loss(batch).backward()
    except Exception as err:
        text = str(err).lower()  # the CPU's allocator ran out: a GPU run might not
        memory = isinstance(err, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))) or \
            "out of memory" in text or "allocate" in text
        if not memory:
            raise UsageError(f"{given}: one training step fails in fp32 before any precision runs"
                             f" ({type(err).__name__}: {one_line(err)}), so every precision would fail; choose other"
                             " arguments (e.g. a larger --batch-size).") from None
