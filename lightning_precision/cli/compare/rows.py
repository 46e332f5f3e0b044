"""The rows of ``lightning-precision compare``'s report: ``Row``, one precision's figures, typed, read by the table,
the notes, the verdict and the plots; written to report.json and report.csv under its field names (``to_dict``), and
read back from them (``from_dict``). The figures come from what the processes reported (``make_row``), then the
speedups over 32-true (``add_speedups``) and the MFU (``add_mfu``)."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_precision._launches import launch_bound
from lightning_precision._mfu import choose_peak, compute_kind, mfu
from lightning_precision.cli.compare.args import (
    WARMUP,
    block_size,
    calibration_steps,
    emulated,
    on_gpu,
    untimed_steps,
)

if TYPE_CHECKING:
    from lightning_precision.cli.compare.runner import Run

__all__ = ["MIN_PAIRS", "NOISY", "Row", "add_mfu", "add_speedups", "make_row", "rate_text", "schedule",
           "speedup_text"]

MIN_PAIRS = 3  # paired turns needed before a speedup can count as resolved
# Interquartile range / median of a run's step times above which it is flagged as measured on a busy machine. Steps
# vary by ~20-30% on an idle shared VM (the monitor's measuring steps, the first step after a turn, slow drift that
# the paired turns cancel), so only a wider spread is called busy.
NOISY = 0.5

# Figures every started run reports, None included (the run did not say): a precision that never started has none.
_RUN_FIGURES = ("emulated", "step_ms", "peak_memory_mb", "final_loss", "val_acc", "grad_underflow_fp16",
                "grad_underflow_fp16_scaled", "skipped_steps", "bytes_per_param", "ops_per_step")


@dataclass
class Row:
    """One precision's figures. A field left None is absent from the report's files, except where None is itself the
    answer (``_keeps_none``): a run's figure it could not measure, the reference's ``speedup_resolved``, a peak or an
    MFU that is not known. ``error`` set: the run failed, or a signal stopped it (then ``interrupted`` names it)."""

    precision: str
    steps_done: int = 0
    emulated: bool | None = None
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] | None = None
    error: str | None = None
    traceback: str | None = None
    interrupted: str | None = None  # the signal that stopped the comparison ("Ctrl-C", "SIGTERM")
    # timings, present when a step was timed: every one rests on the turns' median step times
    median_step_ms: float | None = None
    turn_ms_q1: float | None = None
    turn_ms_q3: float | None = None
    turns: int | None = None
    step_ms_q1: float | None = None
    step_ms_q3: float | None = None
    samples_per_s: float | None = None
    spread: float | None = None
    noisy: bool | None = None
    timed_steps: int | None = None
    untimed_steps: int | None = None
    # the run's figures
    peak_memory_mb: float | None = None
    # weights + gradients + optimizer states per parameter (``_bytes.training_bytes``), and those bytes apart
    bytes_per_param: float | None = None
    training_bytes: dict[str, int] | None = None
    final_loss: float | None = None
    val_acc: float | None = None
    val_samples: int | None = None
    val_metrics: dict[str, float] | None = None  # a user's model: what its validation logged (val_acc or not)
    grad_underflow_fp16: float | None = None
    grad_underflow_fp16_scaled: float | None = None
    skipped_steps: int | None = None
    compute_dtype: str | None = None
    fp8_layers: int | None = None
    linear_layers: int | None = None
    fp8_plan: dict[str, Any] | None = None
    fp8_speed: str | None = None  # "measured on <GPU>" (timed there), "predicted for <GPU>", or None: the shape rules
    fp8_steps: int | None = None
    # aten ops of one untimed step (each a kernel launch on a GPU); on a GPU the host's cost of a launch, and whether
    # the launches alone take LAUNCH_BOUND of the step (``lightning_precision._launches``)
    ops_per_step: int | None = None
    launch_us: float | None = None
    launch_bound: bool | None = None
    # over 32-true (``add_speedups``)
    speedup: float | None = None
    speedup_resolved: bool | None = None
    speedup_pairs: int | None = None
    speedup_q1: float | None = None
    speedup_q3: float | None = None
    speedup_paired: float | None = None
    speedup_drift: bool | None = None
    # throughput against the device's peak (``add_mfu``)
    units_per_s: float | None = None
    compute_kind: str | None = None
    peak_tflops: float | None = None
    peak_source: str | None = None
    achieved_tflops: float | None = None
    mfu: float | None = None

    @property
    def timed(self) -> bool:
        """Whether a step was timed: the timing columns have figures."""
        return self.median_step_ms is not None

    @property
    def failed(self) -> bool:
        """A run that failed (an error, its process died), not one a signal stopped: those are ``interrupted``."""
        return self.error is not None and not self.interrupted

    def _keeps_none(self, name: str) -> bool:
        if name in _RUN_FIGURES:
            return self.emulated is not None
        if name == "speedup_resolved":
            return self.speedup is not None
        if name == "peak_tflops":
            return self.compute_kind is not None
        if name == "mfu":
            return self.achieved_tflops is not None
        return False

    def to_dict(self) -> dict[str, Any]:
        """The row as report.json and report.csv hold it."""
        return {f.name: value for f in dataclasses.fields(self)
                if (value := getattr(self, f.name)) is not None or self._keeps_none(f.name)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Row:
        """A row from report.json's ``results`` (or any mapping of the report's keys)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"Row.from_dict: unknown key {unknown[0]!r}; a row's keys are the fields of Row")
        return cls(**data)

    def update(self, figures: Mapping[str, Any]) -> None:
        """Set the fields named in ``figures`` (a child's result)."""
        names = {f.name for f in dataclasses.fields(self)}
        for name, value in figures.items():
            if name not in names:
                raise ValueError(f"Row.update: unknown key {name!r}; a row's keys are the fields of Row")
            setattr(self, name, value)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _timed(run: Run, steps: int) -> tuple[list[list[float]], int]:
    """The run's turns with the untimed steps left out (``untimed_steps``; emptied turns stay, for pairing), and how
    many steps were left out. A run that reported no step past them (``--steps 1``, an early stop) is timed whole,
    warm-up included (0 left out): the report says so."""
    blocks, seen, skip = [], 0, untimed_steps(run.precision, steps)
    if len(run.times) <= skip:
        skip = 0
    for block in run.blocks:
        blocks.append(block[max(0, skip - seen):])
        seen += len(block)
    return blocks, skip


def _turn_medians(run: Run, steps: int) -> list[float | None]:
    """Each turn's median timed step time (None for a turn with no timed step): every timing figure rests on these."""
    return [statistics.median(b) if b else None for b in _timed(run, steps)[0]]


def make_row(run: Run, args: argparse.Namespace, machine: dict[str, Any], interrupted: str | None = None) -> Row:
    """One precision's figures; ``interrupted``: the signal that stopped the comparison ("Ctrl-C", "SIGTERM"), if one
    did. ms/step is the median over turns of each turn's median step time (samples/s, units/s, MFU and the speedup
    follow from it); spread is the interquartile range of all timed steps over their median (how much steps varied)."""
    row = Row(run.precision, steps_done=len(run.times), emulated=emulated(run.precision, machine, on_gpu(args)),
              losses=run.losses, step_ms=[t * 1e3 for t in run.times])
    if run.error:
        row.error = run.error
        row.traceback = run.detail or None
    elif run.result is None:
        row.error = (f"interrupted ({interrupted}) after {len(run.times)} of {args.steps} steps" if interrupted
                     else "did not finish")
        row.interrupted = interrupted
    blocks, left_out = _timed(run, args.steps)
    times = [t for block in blocks for t in block]
    turns = [m for m in _turn_medians(run, args.steps) if m is not None]
    if times:
        q1, median, q3 = _quartiles(times)
        t1, turn_median, t3 = _quartiles(turns)
        row.update(dict(median_step_ms=turn_median * 1e3, turn_ms_q1=t1 * 1e3, turn_ms_q3=t3 * 1e3, turns=len(turns),
                        step_ms_q1=q1 * 1e3, step_ms_q3=q3 * 1e3,
                        samples_per_s=args.batch_size / turn_median if args.batch_size else None,  # no tensor: n/a
                        spread=(q3 - q1) / median, noisy=(q3 - q1) / median > NOISY, timed_steps=len(times),
                        untimed_steps=left_out))
    row.peak_memory_mb = run.peak_mb
    row.final_loss = statistics.mean(run.losses[-5:]) if run.losses else None
    if run.result:
        row.update(run.result)
    if row.launch_us is not None and row.ops_per_step and row.median_step_ms is not None:
        row.launch_bound = launch_bound(row.ops_per_step, row.launch_us, row.median_step_ms)
    if row.fp8_layers is not None:  # the steps that ran fp8 layers: none if it has none, or fp8-auto measured all along
        measured = calibration_steps(args.steps) if run.precision == "fp8-auto" else 0
        row.fp8_steps = max(0, row.steps_done - measured) if row.fp8_layers else 0
        if not row.fp8_steps:  # every matmul ran in bf16: emulated only where bf16 is
            row.emulated = emulated("bf16-mixed", machine, on_gpu(args))
    return row


def schedule(rows: list[Row], args: argparse.Namespace) -> str:
    """How the steps were run and which were timed, as it happened: a run with no more steps than it leaves untimed
    (``--steps 1``, an early stop) is timed whole, warm-up included, and this says so."""
    block = block_size(args.steps)
    parts = [f"interleaved, {block} step{'s' if block > 1 else ''} per turn"]
    timed = [r for r in rows if r.untimed_steps is not None]
    whole = [r for r in timed if not r.untimed_steps]
    groups: dict[int, list[str]] = {}
    for r in timed:
        if r.untimed_steps:
            groups.setdefault(r.untimed_steps, []).append(r.precision)
    for left_out, names in groups.items():
        who = f" for {', '.join(names)}" if len(groups) > 1 or whole else ""
        why = "warm-up" if left_out == WARMUP else f"{left_out - WARMUP} measuring steps, then the warm-up"
        parts.append(f"first {left_out} steps untimed{who} ({why})")
    if whole:
        done = max(r.steps_done for r in whole)
        who = f" for {', '.join(r.precision for r in whole)}" if len(whole) < len(timed) else ""
        first = sorted({untimed_steps(r.precision, args.steps) for r in whole})
        parts.append(f"every step timed{who}, warm-up included: {done} step{'s' if done > 1 else ''} reported, too few"
                     f" to leave out the first {' or '.join(map(str, first))}")
    return "; ".join(parts)


def add_mfu(rows: list[Row], meta: dict[str, Any], args: argparse.Namespace) -> None:
    """Achieved TFLOP/s (the model's FLOPs per step over the median step time) and MFU against the device's dense
    peak for the run's compute kind (``lightning_precision._mfu``), with the peak's source or why there is none."""
    flops, units = meta.get("model_flops_per_step"), meta.get("units_per_batch")
    for row in rows:
        if row.median_step_ms is None:
            continue
        if units:  # tokens or images per second: what a recipe's readers compare, beside samples/s
            row.units_per_s = units / (row.median_step_ms / 1e3)
        if row.compute_dtype is None:  # a run that did not finish does not say
            row.peak_source = "n/a: the run did not finish"
            continue
        kind = compute_kind(row.compute_dtype)
        peak = choose_peak(meta["device"], kind, args.peak_overrides)
        row.compute_kind, row.peak_tflops, row.peak_source = kind, peak.tflops, peak.source
        if flops:
            row.achieved_tflops, row.mfu = mfu(flops, row.median_step_ms / 1e3, peak.tflops)


def add_speedups(rows: list[Row], runs: Mapping[str, Run], steps: int) -> None:
    """Speedup over 32-true: one statistic for the cell, its bracket, the "~" mark and the verdict. It is the median
    of the paired ratios (32-true's turn median over this one's, in the same round: measured back to back, so a
    machine whose speed drifts affects both), its bracket their interquartile range, so the figure always lies in its
    bracket; it is resolved when at least ``MIN_PAIRS`` pairs put the whole bracket on one side of 1x and ms/step does
    not rank the row on the other side (``speedup_drift``: the machine's speed changed during the run; paired turns
    cancel that, medians do not, and the report claims neither). With no pair (turns that never met) it falls back to
    32-true's ms/step over this one's, unbracketed and unresolved."""
    base_row = next((r for r in rows if r.precision == "32-true" and r.median_step_ms is not None), None)
    if base_row is None or base_row.median_step_ms is None:
        return
    base = _turn_medians(runs["32-true"], steps)
    for row in rows:
        if row.median_step_ms is None:
            continue
        if row is base_row:
            row.speedup, row.speedup_resolved = 1.0, None  # the reference itself
            continue
        by_medians = base_row.median_step_ms / row.median_step_ms
        row.speedup, row.speedup_resolved, row.speedup_pairs = by_medians, False, 0
        ratios = [b / m for b, m in zip(base, _turn_medians(runs[row.precision], steps), strict=False) if b and m]
        if not ratios:
            continue
        q1, median, q3 = _quartiles(ratios)
        above, below = q1 > 1, q3 < 1
        row.speedup, row.speedup_q1, row.speedup_q3, row.speedup_pairs = median, q1, q3, len(ratios)
        row.speedup_paired = median
        row.speedup_drift = (above and by_medians < 1) or (below and by_medians > 1)
        row.speedup_resolved = len(ratios) >= MIN_PAIRS and (above or below) and not row.speedup_drift


def speedup_text(row: Row) -> str:
    """The speedup as the table's cell and the throughput plot's label show it: "~" where it is not resolved, the
    paired ratios' interquartile range in brackets, "emulated" where the format has no hardware arithmetic here."""
    if row.speedup is None:
        return "-"
    mark = "~" if row.speedup_resolved is False else ""
    bracket = f" [{row.speedup_q1:.2f}-{row.speedup_q3:.2f}]" if row.speedup_q1 is not None else ""
    return f"{mark}{row.speedup:.2f}x{bracket}" + (" emulated" if row.emulated else "")


def rate_text(value: float | None) -> str:
    """A rate (samples/s, tokens/s) as the table and the plots show it: whole from 10 up, three significant digits
    below (a real model on a CPU trains well under one sample a second, which must not read 0)."""
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.3g}"
