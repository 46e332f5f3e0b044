"""The report of ``lightning-precision compare``: the table (terminal and markdown from the same cells), its notes, the
verdict, and the files (``report.md``, ``report.json``, ``report.csv``, plots)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from lightning_precision._core.true.precision import DEFAULT_STEP_CHUNK
from lightning_precision._io import json_safe
from lightning_precision._launches import launch_floor_ms
from lightning_precision._warnings import warn
from lightning_precision.cli.compare.args import BASELINES
from lightning_precision.cli.compare.outdir import replace_folder
from lightning_precision.cli.compare.rows import MIN_PAIRS, NOISY, Row, rate_text, speedup_text
from lightning_precision.cli.compare.widths import fit_columns, table_width

__all__ = ["FILES", "NOISY", "failed", "print_table", "verdict", "write_reports"]

# Every file a report writes: the report folder holds these and nothing else (``cli.compare.outdir``).
FILES = ("report.md", "report.json", "report.csv", "loss.png", "throughput.png", "memory.png")

COLUMNS = ("precision", "ms/step", "spread", "speedup", "samples/s", "units/s", "MFU", "peak mem MB", "bytes/param",
           "final loss", "val acc", "fp16 underflow, unscaled", "at loss scale", "skipped")
# The terminal's table leaves columns out in this order where it is too wide for the console (``widths``): what
# another column already says (units/s beside samples/s), what is n/a or 0 on most runs, then what is read less.
# precision and speedup are always shown.
LEAST_IMPORTANT = ("units/s", "MFU", "at loss scale", "fp16 underflow, unscaled", "spread", "skipped", "samples/s",
                   "bytes/param", "ms/step", "peak mem MB", "final loss", "val acc")
CSV_COLUMNS = ["precision", "median_step_ms", "step_ms_q1", "step_ms_q3", "turn_ms_q1", "turn_ms_q3", "turns",
               "timed_steps", "untimed_steps", "samples_per_s", "units_per_s", "achieved_tflops", "mfu", "peak_tflops",
               "speedup", "speedup_q1", "speedup_q3", "speedup_paired", "speedup_pairs", "speedup_resolved",
               "speedup_drift", "peak_memory_mb", "bytes_per_param", "final_loss", "val_acc", "grad_underflow_fp16",
               "grad_underflow_fp16_scaled", "skipped_steps", "ops_per_step", "launch_us", "launch_bound", "steps_done",
               "emulated", "noisy", "interrupted", "error"]
SAME_ACCURACY = 0.01  # the least difference of validation accuracies the verdict calls a difference


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _loss(value: float | None) -> str:
    """A loss as the report prints it: 3 decimals, or e-notation from 1e5 up, where fixed decimals would make a
    diverging run's loss (up to 3e38 in fp32) a column of 40 digits, most of them float noise, wider than a console."""
    return _fmt(value, ".3f" if value is not None and abs(value) < 1e5 else ".3e")


def columns(meta: dict[str, Any]) -> tuple[str, ...]:
    """The table's headers: the throughput column is named after the recipe's unit (tokens/s, images/s)."""
    return tuple(f"{meta.get('unit') or 'units'}/s" if c == "units/s" else c for c in COLUMNS)


def failed(row: Row) -> bool:
    """A run that failed (an error, its process died), not one a signal stopped: those are ``interrupted``."""
    return row.failed


def _status(row: Row) -> str | None:
    return "interrupted" if row.interrupted else "failed" if row.error is not None else None


def _spread_flag(row: Row) -> str:
    """What the spread says: a launch-bound step varies with the host's jitter, not with another job."""
    return " launch-bound" if row.launch_bound else " busy" if row.noisy else ""


def cells(row: Row) -> list[str]:
    """The table row of one precision, as text (the terminal and report.md show the same)."""
    status = _status(row)
    if row.median_step_ms is None:
        return [row.precision, f"{status} (see notes)" if status else "-", *[""] * (len(COLUMNS) - 2)]
    return [
        row.precision + (f" ({status})" if status else ""),
        _fmt(row.median_step_ms, ".1f"),
        _fmt(row.spread * 100 if row.spread is not None else None, ".0f", "%") + _spread_flag(row),
        speedup_text(row),
        rate_text(row.samples_per_s),
        rate_text(row.units_per_s),
        _fmt(row.mfu * 100, ".1f", "%") if row.mfu is not None else "n/a",
        _fmt(row.peak_memory_mb, ".0f"),
        _fmt(row.bytes_per_param, ".1f"),
        _loss(row.final_loss),
        _fmt(row.val_acc, ".3f"),
        _fmt(row.grad_underflow_fp16, ".2e"),
        _fmt(row.grad_underflow_fp16_scaled, ".2e"),
        _fmt(row.skipped_steps, "d"),
    ]


def mfu_notes(rows: list[Row], meta: dict[str, Any]) -> list[str]:
    """What MFU was measured against, once per distinct peak (or why it is n/a)."""
    flops = meta.get("model_flops_per_step")
    timed = [r for r in rows if r.peak_source is not None]
    if not timed:
        return []
    if not flops:
        return [meta.get("flops_note") or "MFU: n/a, the model's FLOPs per step could not be counted."]
    lines = [f"MFU: the model's {flops / 1e9:.3g} GFLOP per step (forward and backward, torch.utils.flop_counter) over"
             " the median step time, against the device's dense peak for the run's compute kind:"]
    by_source: dict[str, list[str]] = {}
    for r in timed:
        peak = f"{r.peak_tflops:g} TFLOP/s, " if r.peak_tflops else ""
        kind = f" ({r.compute_kind})" if r.compute_kind is not None else ""
        by_source.setdefault(peak + (r.peak_source or ""), []).append(r.precision + kind)
    lines += [f"  {', '.join(names)}: {source}" for source, names in by_source.items()]
    return lines


BYTES_NOTE = ("bytes/param: weights, their gradients and the optimizer's states, with what a plugin keeps beside them"
              " (remainders, 16-bit halves of fp32 states), per trained parameter, counted from the tensors after"
              " training, in each precision's own process: 16 with Adam where the weights are fp32 (32-true, the"
              " mixed precisions, fp8), 8 where weights, gradients and states are 16-bit. Activations, workspace and"
              " allocator caches are not in it; peak mem has them.")


def memory_note(device: str) -> str:
    if device == "cpu":
        return ("peak mem MB: resident memory gained during training, each precision measured in its own process"
                " (allocator caches included). On a CPU it varies between identical runs by tens of MB (how the C"
                " allocator reuses freed pages; 19-44 MB for the tiny ViT's 32-true): for small models only large"
                " differences mean anything.")
    return ("peak mem MB: peak memory allocated by tensors on the GPU during training, each precision in its own"
            " process.")


# The rows that step in fp32 on 16-bit weights (``_core.true.step``), with the plugins' default arguments: 16-bit
# states, ``step_chunk`` elements widened at a time. Lightning's own bf16-true steps the bf16 weights as they are.
FP32_STEP_ROWS = ("bf16-true", "16-true")


def fp32_step_notes(rows: list[Row]) -> list[str]:
    """Where a true row's peak memory exceeds 32-true's, though it holds half the bytes a parameter: why, with the
    figure of its optimizer step's fp32 transient, counted from what the row holds (a constant would be wrong for
    another model or optimizer)."""
    base = next((r for r in rows if r.precision == "32-true" and r.peak_memory_mb is not None), None)
    lines = []
    for r in rows:
        held = r.training_bytes
        if (base is None or r.precision not in FP32_STEP_ROWS or not held or not held.get("weights")
                or r.peak_memory_mb is None or base.peak_memory_mb is None or r.peak_memory_mb <= base.peak_memory_mb):
            continue
        # each 16-bit weight, gradient and state has an fp32 stand-in during the step: 4 bytes for every
        # weight-sized value held (16 with Adam's two states)
        per_element = 4 * (held["weights"] + held["gradients"] + held["optimizer_states"]) / held["weights"]
        parameters, chunk = held["parameters"], min(held["parameters"], DEFAULT_STEP_CHUNK)
        transient = chunk * per_element / 2**20
        if transient < 1:  # copies under a MB explain nothing: the excess is the allocator's noise (the peak mem note)
            continue
        cap = f"{DEFAULT_STEP_CHUNK * per_element / 2**20:.0f}"
        why = (f"this model's {parameters:,} parameters fit one step_chunk ({DEFAULT_STEP_CHUNK:,} elements), so its"
               " weights, gradients and states are widened at once" if parameters <= DEFAULT_STEP_CHUNK else
               f"they are widened step_chunk ({DEFAULT_STEP_CHUNK:,}) elements at a time")
        lines.append(f"{r.precision}: peak mem {r.peak_memory_mb:.0f} MB against 32-true's {base.peak_memory_mb:.0f}"
                     f" MB, though it holds {r.bytes_per_param or 0:.1f} bytes a parameter to 32-true's"
                     f" {base.bytes_per_param or 0:.1f}: its optimizer step runs in fp32 ({per_element:.0f} bytes an"
                     f" element widened), and {why}: at least {transient:.0f} MB of fp32 copies during the step (the"
                     " optimizer's temporaries on them come on top). On models larger than a chunk the copies stay at"
                     f" step_chunk elements ({cap} MB), while the bytes held keep shrinking with the model.")
    return lines


def notes(rows: list[Row], meta: dict[str, Any]) -> list[str]:
    """The lines under the table: every failure's and interruption's whole reason, which statistic each column is, what
    each flag means where it appears."""
    lines = []
    for r in rows:
        if r.failed:
            lines.append(f"{r.precision} failed: {r.error}")
        elif r.interrupted:
            lines.append(f"{r.precision}: {r.error}" + ("; its figures are from those steps" if r.steps_done else ""))
    lines += meta.get("notes", [])
    lines += _timing_notes(rows, meta)
    lines += mfu_notes(rows, meta)
    lines += [_fp8_note(r) for r in rows if r.fp8_layers is not None]
    lines += _figure_notes(rows, meta)
    return lines


def _timing_notes(rows: list[Row], meta: dict[str, Any]) -> list[str]:
    """What ms/step and the speedup are, and each flag on them: busy, launch-bound, unresolved, drift, emulated."""
    lines = []
    if any(r.timed for r in rows):
        unit = meta.get("unit") or "units"
        lines.append(f"ms/step: the median over turns of each turn's median step time ({meta['schedule']}); samples/s,"
                     f" {unit}/s and MFU follow from it. speedup: the median over rounds of the paired ratio (32-true's"
                     " turn over this one's in the same round, measured back to back, so a change of the machine's"
                     " speed hits both), [brackets]: those ratios' interquartile range, which always holds the"
                     " speedup; the ~ mark, the verdict and throughput.png read the same figures. spread: the"
                     " interquartile range of the timed step times over their median.")
    if any(r.noisy and not r.launch_bound for r in rows):
        lines.append(f"busy: step times varied by more than {NOISY:.0%} of their median; something else was using the"
                     " machine. The paired brackets are the figures to trust; rerun when it is idle.")
    lines += launch_notes(rows)
    compiled = [r.precision for r in rows if r.precision in meta.get("compiled", ()) and r.timed]
    if compiled:
        lines.append(f"{', '.join(compiled)}: compiled (torch.compile of the LightningModule, compiling in the untimed"
                     " first steps), the other rows eager: fp8's casts are fused only when compiled, and eager fp8 is"
                     " slower than bf16.")
    if any(r.speedup_resolved is False for r in rows):
        lines.append(f"~: speedup not resolved: fewer than {MIN_PAIRS} turns were paired, or its bracket includes 1x,"
                     " or ms/step ranks it on the other side of 32-true (a note says so), so it is not measurably"
                     " different from 32-true.")
    base = next((r for r in rows if r.precision == "32-true" and r.timed), None)
    for r in rows:
        if r.speedup_drift and base is not None and base.median_step_ms and r.median_step_ms:
            lines.append(f"{r.precision}: the paired turns put it at {r.speedup_q1:.2f}-{r.speedup_q3:.2f}x"
                         f" the speed of 32-true, the ms/step medians at {base.median_step_ms / r.median_step_ms:.2f}x:"
                         " they disagree on which is faster because the machine's speed changed during the run"
                         " (paired turns cancel that, medians do not), so neither is claimed; rerun when it is idle.")
    emulated = [r.precision for r in rows if r.emulated and r.timed]
    if emulated:
        lines.append(f"emulated: no hardware arithmetic for {', '.join(emulated)} on this machine (torch emulates"
                     " it): the numerics are real, the speed says nothing about hardware that has the format.")
    return lines


def _fp8_note(r: Row) -> str:
    """How many of a run's linear layers ran in fp8, chosen how, and whether its figures are bf16-mixed's after all."""
    how = "chosen from measured numerics" if r.fp8_plan is not None else "all that the shape rules leave"
    if r.fp8_speed:
        how += f", speed {r.fp8_speed}" if r.fp8_plan is not None else f" and measured faster (speed {r.fp8_speed})"
    line = f"{r.precision}: {r.fp8_layers} of {r.linear_layers} linear layers in fp8, {how}"
    if not (r.fp8_steps if r.fp8_steps is not None else r.fp8_layers):
        n = r.steps_done
        why = "" if not r.fp8_layers else \
            f"; {'its one step was' if n == 1 else f'all its {n} steps were'} measured in bf16, before the plan"
        line += (f"{why}: every matmul ran in bf16, so its figures are bf16-mixed's"
                 + (" (emulated here)" if r.emulated else " (not emulated)"))
    return line + "."


def _figure_notes(rows: list[Row], meta: dict[str, Any]) -> list[str]:
    """What the underflow, memory and bytes/param columns measure, and the baseline's place in the verdict."""
    lines = []
    if any(r.grad_underflow_fp16 is not None or r.grad_underflow_fp16_scaled is not None for r in rows):
        scaled = [r.precision for r in rows if r.grad_underflow_fp16_scaled is not None] or ["16-mixed"]
        lines.append("fp16 underflow, unscaled: the fraction of nonzero parameter gradients that would flush to zero if"
                     " cast to fp16 as they are (every precision). at loss scale: the same fraction at the loss scale"
                     f" in effect, {', '.join(scaled)} only: what {'its' if len(scaled) == 1 else 'their'} fp16"
                     " backward meets, including what it already flushed. The two answer different questions: compare"
                     " a column with itself.")
    lines += _accuracy_note(rows, meta)
    lines.append(memory_note(meta["device"]))
    lines += fp32_step_notes(rows)
    if any(r.bytes_per_param is not None for r in rows):
        lines.append(BYTES_NOTE)
    for r in rows:
        if r.bytes_per_param is None and r.error is None and r.steps_done and (r.skipped_steps or 0) >= r.steps_done:
            lines.append(f"{r.precision}: bytes/param n/a: every one of its {r.steps_done} steps was skipped (inf/nan"
                         " gradients), so the optimizer's states, made by its first step, did not exist to count.")
    baselines = [r.precision for r in rows if r.precision in BASELINES]
    if baselines:
        lines.append(f"{', '.join(baselines)}: Lightning's own plugin (precision='bf16-true': bf16 weights, every"
                     " update rounded to nearest), for comparison; the verdict does not recommend it.")
    return lines


def _accuracy_note(rows: list[Row], meta: dict[str, Any]) -> list[str]:
    """For a user's model that logs no val_acc: what its validation logged instead, or why none ran."""
    finished = [r for r in rows if r.error is None and r.steps_done]
    if "model" not in meta or not meta.get("val_batches") or not finished or any(r.val_acc is not None for r in rows):
        return []
    logged = sorted({name for r in rows for name in (r.val_metrics or {})})
    if logged:
        return [f"val acc: -: {meta['recipe']} logs no val_acc; its validation logs {', '.join(logged)} (each"
                " precision's values in report.json's val_metrics)."]
    if any(r.val_metrics is not None for r in finished):
        return [f"val acc: -: {meta['recipe']}'s validation logs nothing."]
    return [f"val acc: -: no validation ran: {meta['recipe']} defines no validation_step, or its data no"
            " val_dataloader."]


LAUNCH_ADVICE = ("To measure the arithmetic instead: a larger batch (--batch-size) or model, or torch.compile (fewer,"
                 " fused kernels).")


def launch_notes(rows: list[Row]) -> list[str]:
    """Where steps are launch-bound: each one's launches against its step time, what that means and what to do."""
    bound = [r for r in rows if r.launch_bound]
    if not bound:
        return []
    figures = "; ".join(f"{r.precision} {r.ops_per_step} ops, at least"
                        f" {launch_floor_ms(r.ops_per_step or 0, r.launch_us or 0.0):.1f} of {r.median_step_ms:.1f} ms"
                        for r in bound)
    return [f"launch-bound: each step's aten ops (counted in one untimed step) are each a kernel launch that costs the"
            f" host about {bound[0].launch_us:.1f} us here ({figures}). The GPU waits for the"
            " host, so these step times measure kernel launches, not the precisions' arithmetic, and they vary with"
            " the host's jitter (the spread), not with another job. " + LAUNCH_ADVICE]


def accuracy_tolerance(base: Row, meta: dict[str, Any]) -> float:
    """How far two validation accuracies may differ by chance alone: two standard errors of the difference of two
    accuracies on the validation samples 32-true's run counted (at its accuracy), at least ``SAME_ACCURACY``."""
    n = max(1, base.val_samples or meta.get("val_batches", 0) * meta.get("batch_size", 0))
    p = base.val_acc or 0.5
    return max(SAME_ACCURACY, 2 * math.sqrt(2 * p * (1 - p) / n))


def verdict(rows: list[Row], meta: dict[str, Any]) -> str:
    """The result in a sentence or two, claiming only what the figures resolve. It rests on the table's own figures:
    a run a signal stopped is partial, not failed, and its speedup counts as the table shows it."""
    prefix = "Interrupted: the figures below are partial. " if meta.get("interrupted") else ""
    failures = [r.precision for r in rows if r.failed]
    tail = f" {', '.join(failures)} failed (see the notes)." if failures else ""
    base = next((r for r in rows if r.precision == "32-true" and r.timed), None)
    if base is None:
        return prefix + "No 32-true step was timed: speedups are not computed." + tail
    # a run whose loss is nan or inf trained nothing worth its speed: never recommended, and said so
    diverged = [r for r in rows if not r.failed and r.final_loss is not None and not math.isfinite(r.final_loss)]
    losses = ", ".join(f"{r.precision} (final loss {_loss(r.final_loss)})" for r in diverged)
    if any(r is base for r in diverged):
        return (prefix + f"Nothing is recommended: the loss diverged in {losses}, 32-true among them, so no run here"
                " trained soundly enough to compare with; check the model's numerics first." + tail)
    if diverged:  # said first: the rest of the verdict is about the other rows
        prefix += (f"{losses} diverged where 32-true did not: not recommended; check"
                   f" {'its' if len(diverged) == 1 else 'their'} numerics. ")
    others = [(r, r.speedup) for r in rows if r is not base and not r.failed and r.speedup is not None
              and not any(r is d for d in diverged)]
    tolerance = accuracy_tolerance(base, meta)

    def same_accuracy(r: Row) -> bool:
        if r.val_acc is None or base.val_acc is None:
            return True
        return abs(r.val_acc - base.val_acc) <= tolerance

    def accuracy(r: Row) -> str:
        if r.val_acc is None or base.val_acc is None:
            return f"final loss {_loss(r.final_loss)} vs {_loss(base.final_loss)}"
        return f"validation accuracy {r.val_acc:.3f} vs {base.val_acc:.3f}"

    def differs(r: Row) -> str:
        return f"{r.precision}'s {accuracy(r)} differs by more than chance allows ({tolerance:.3f})"

    def speed(r: Row, speedup: float) -> str:
        return (f"{speedup:.2f}x the speed of 32-true (interquartile {_fmt(r.speedup_q1, '.2f')}-"
                f"{_fmt(r.speedup_q3, '.2f')}x over {r.speedup_pairs} paired turns)")

    resolved = sorted(((r, s) for r, s in others if r.speedup_resolved and s > 1 and not r.emulated),
                      key=lambda rs: -rs[1])
    # a baseline (Lightning's own plugin) is there to be compared with, never the one to use
    faster = [(r, s) for r, s in resolved if r.precision not in BASELINES]
    if faster:
        r, speedup = faster[0]
        if same_accuracy(r):
            return prefix + f"{r.precision} is the one to use here: {speed(r, speedup)}, {accuracy(r)}." + tail
        return (prefix + f"{r.precision} ran at {speed(r, speedup)}, but {differs(r)}: check its numerics before"
                " switching." + tail)
    slower = [f"{r.precision} {s:.2f}x" for r, s in others if r.speedup_resolved and s < 1 and not r.emulated]
    emulated = [r.precision for r, _ in others if r.emulated]
    text = f"No {'other ' if diverged else ''}precision was measurably faster than 32-true on this machine"
    if resolved:  # only baselines were: said, as measured, and not recommended
        text = ("None of lightning-precision's precisions was measurably faster than 32-true on this machine ("
                + "; ".join(f"{r.precision}, Lightning's own, ran at {speed(r, s)}" for r, s in resolved) + ")")
    text += f" ({', '.join(slower)}: measurably slower)" if slower else ""
    text += f"; {' and '.join(emulated)} {'is' if len(emulated) == 1 else 'are'} emulated here" if emulated else ""
    if any(r.launch_bound for r in rows):
        text += (". The steps are launch-bound on this GPU (the host issues kernels more slowly than the GPU runs"
                 " them), so the lower precisions cannot show their speed here. " + LAUNCH_ADVICE)
    else:
        text += ". Here the lower precisions show their numerics, not their speed."
    if any(r.noisy and not r.launch_bound for r in rows):
        text += " Step times varied widely (a busy machine): rerun when it is idle."
    text += "".join(f" {differs(r)}: check its numerics." for r, _ in others if not same_accuracy(r))
    return prefix + text + tail


def print_table(rows: list[Row], meta: dict[str, Any], console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    steps = f"{meta['steps']} step{'s' if meta['steps'] != 1 else ''}"
    title = f"{meta['recipe']}: {meta['task']} | {steps}, batch {meta['batch_size']}, {meta['device']}"
    title += f"\nworkload: {meta['workload']}" if meta.get("workload") else ""
    table = Table(title=title + (" | INTERRUPTED: partial results" if meta.get("interrupted") else ""))
    headers, texts = columns(meta), [cells(row) for row in rows]
    kept, widths = fit_columns(headers, texts, console.width, [COLUMNS.index(c) for c in LEAST_IMPORTANT])
    for i, width in zip(kept, widths, strict=True):
        table.add_column(headers[i], justify="left" if i == 0 else "right", width=width)
    for row, text in zip(rows, texts, strict=True):
        style = "red" if row.failed else "yellow" if row.interrupted else ""
        table.add_row(*(Text(text[i], style=style if i < 2 else "") for i in kept))
    width = console.width
    # too narrow even for the kept columns: lines the terminal wraps, never cut; the lines under the table too, which
    # rich would otherwise fold a character a line at a width of 1
    wide = table_width(widths) > width
    if wide:
        console.width = table_width(widths)
    try:
        console.print(table, crop=False)
        if len(kept) < len(headers):
            left_out = "; ".join(h for i, h in enumerate(headers) if i not in kept)  # a header may hold a comma
            console.print(Text(f"not shown at {width} columns: {left_out}. Every column is in report.md and"
                               " report.csv.", style="dim"))
        for line in notes(rows, meta):
            console.print(Text(line, style="red" if " failed: " in line else "dim"))
        console.print(Text(meta["verdict"], style="bold"))
    finally:
        if wide:
            console.width = width


def markdown(rows: list[Row], meta: dict[str, Any], images: list[str]) -> str:
    packages = ", ".join(f"{k} {v}" for k, v in meta["machine"]["packages"].items() if v)
    lines = [
        f"# compare: {meta['recipe']} on {meta['device']}", "",
        meta["verdict"], "",
        f"- Task: {meta['task']} (chance accuracy {meta['chance']})" if meta.get("chance") is not None else
        f"- Model: {meta['task']}",
        *([f"- Workload: {meta['workload']}"] if meta.get("workload") else []),
        f"- Run: {meta['steps']} step{'s' if meta['steps'] != 1 else ''} per precision, batch {meta['batch_size']},"
        f" seed {meta['seed']}, {meta['val_batches']} validation batches; {meta['schedule']}"
        + ("; --quick" if meta.get("quick") else ""),
        f"- Machine: {meta['machine_line']}",
        f"- Packages: {packages}",
        f"- Command: `{meta.get('command', 'lightning-precision compare')}`",
        "",
        "| " + " | ".join(columns(meta)) + " |",
        "|" + "|".join("---" if c == "precision" else "---:" for c in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |" for r in rows]
    lines += [""] + [f"- {n}" for n in notes(rows, meta)] + [""]
    lines += [f"![{Path(p).stem}]({Path(p).name})" for p in images]
    return "\n".join(lines) + "\n"


def _write_files(rows: list[Row], folder: Path, meta: dict[str, Any]) -> list[str]:
    """Write the report's files into ``folder``; their names, report.md first."""
    results = [r.to_dict() for r in rows]
    # Strict JSON (no bare NaN or Infinity, which most parsers refuse): a loss that diverged is "nan", as in the CSV.
    (folder / "report.json").write_text(json.dumps(json_safe({"meta": meta, "results": results}), indent=2,
                                                   allow_nan=False))
    with open(folder / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    images: list[str] = []
    try:
        from lightning_precision.cli.compare.plots import plot_compare

        images = [Path(p).name for p in plot_compare(rows, folder, meta)]
    except ModuleNotFoundError as err:  # matplotlib missing: the table, JSON and CSV still stand
        warn(str(err))
    (folder / "report.md").write_text(markdown(rows, meta, images))
    return ["report.md", "report.json", "report.csv", *images]


def write_reports(rows: list[Row], out: Path, meta: dict[str, Any]) -> tuple[Path, list[str], str | None]:
    """Replace the report in ``out`` (a folder held with ``claim_folder``) whole: written beside it, then swapped in, so
    that ``out`` holds one whole report, the previous one or this one, whatever happens during the writes (an
    ``OSError`` leaves it as it was). Returns the folder that holds the new report (``out``, unless ``out`` holds
    something a report does not write), the names of the files written, and a note when something is not where it was
    (``replace_folder``)."""
    names: list[str] = []

    def fill(folder: Path) -> list[str]:
        names[:] = _write_files(rows, folder, meta)
        return names

    where, note = replace_folder(out, FILES, fill)
    return where, names, note
