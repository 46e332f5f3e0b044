"""The compare report's terminal table at any console width (no number cut, columns left out in a stated order and
said so), its one speedup statistic (the printed figure inside its printed bracket, the verdict's word and the "~"
mark read from the same), and the note that explains a true row's peak memory above 32-true's."""

import argparse
import random
import re
import statistics
from io import StringIO

import pytest
from rich.console import Console

from lightning_precision.cli import console as cli_console
from lightning_precision.cli.compare import report as lp_report
from lightning_precision.cli.compare import rows as lp_rows
from lightning_precision.cli.compare import runner
from lightning_precision.cli.compare.rows import Row

META = {"recipe": "distilbert", "task": "sentiment of generated movie reviews (2 classes)", "steps": 100,
        "batch_size": 32, "device": "cpu", "workload": "embedded CPU default (no CUDA GPU)", "unit": "tokens",
        "verdict": "No precision was measurably faster than 32-true on this machine.", "notes": [],
        "schedule": "interleaved, 10 steps per turn", "val_batches": 8}
HELD = {"parameters": 2_000_000, "weights": 4_000_000, "gradients": 4_000_000, "optimizer_states": 8_000_000}


def _table_rows():
    """Every kind of cell the table has: the widest precision name, a bracket with both marks, a busy spread, the
    loss-scaled underflow column, a failed and an interrupted row."""
    timed = {"median_step_ms": 31.6, "spread": 0.1, "samples_per_s": 1013.0, "units_per_s": 48624.0,
             "peak_memory_mb": 85.0, "bytes_per_param": 16.0, "final_loss": 0.34, "val_acc": 0.85,
             "grad_underflow_fp16": 1.77e-4, "skipped_steps": 0}
    return [Row("32-true", **{**timed, "median_step_ms": 25.9, "speedup": 1.0}),
            Row("bf16-mixed", **timed, speedup=0.67, speedup_q1=0.66, speedup_q3=0.85, speedup_resolved=False,
                emulated=True),
            Row("lightning-bf16-true", **{**timed, "spread": 0.7, "bytes_per_param": 8.0}, noisy=True, speedup=1.23,
                speedup_q1=1.11, speedup_q3=1.35, speedup_resolved=True, grad_underflow_fp16_scaled=0.0),
            Row("16-true", error="interrupted (Ctrl-C) after 40 of 100 steps", interrupted="Ctrl-C", **timed,
                speedup=0.5, speedup_q1=0.45, speedup_q3=0.55, speedup_resolved=True),
            Row("fp8", error="RuntimeError: boom")]


def _printed(rows, console):
    lp_report.print_table(rows, META, console)
    return console.file.getvalue()


def _table_part(printed):
    return printed.split("ms/step: the median")[0]  # the table and the line under it, not the notes


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_the_table_fits_the_console_and_never_cuts_a_number(width):
    """At 100 columns cells were cut to `bf1…` and `~0.…`. Every word of every shown cell now appears whole, no line
    is wider than the console, and the columns left out are named under the table, in the order of least importance;
    at 200 columns none is left out."""
    rows = _table_rows()
    printed = _printed(rows, Console(file=StringIO(), width=width))
    table = _table_part(printed)
    assert "…" not in printed and max(map(len, printed.splitlines())) <= width
    headers = lp_report.columns(META)
    left_out = []
    match = re.search(r"not shown at (\d+) columns: (.*?)\. Every column is in report\.md and report\.csv\.",
                      " ".join(table.split()))
    if match:
        assert int(match[1]) == width
        left_out = match[2].split("; ")
    assert left_out == [h for h in headers if h in left_out]  # in the table's order, every name a header
    assert [c for c in lp_report.LEAST_IMPORTANT if lp_report.columns(META)[lp_report.COLUMNS.index(c)]
            in left_out] == list(lp_report.LEAST_IMPORTANT[:len(left_out)])  # the least important first
    assert (left_out == []) == (width == 200) and "speedup" not in left_out and "precision" not in left_out
    words = set(table.replace("│", " ").replace("┃", " ").split())
    for row in rows:
        for header, cell in zip(headers, lp_report.cells(row), strict=True):
            if header not in left_out:
                assert set(cell.split()) <= words, (header, cell)  # "0.67x", "[0.66-0.85]", "lightning-bf16-true"


def test_a_console_narrower_than_the_kept_columns_wraps_and_cuts_nothing():
    """30 columns cannot hold even the precision and the speedup: the lines are as long as they need (the terminal
    wraps them), never cut."""
    rows = _table_rows()
    table = _table_part(_printed(rows, Console(file=StringIO(), width=30)))
    assert "…" not in table and "lightning-bf16-true" in table and "[0.66-0.85]" in table


def test_a_piped_report_gets_the_readable_width_and_cuts_nothing(capsys, monkeypatch):
    """stdout a pipe (pytest's capture here, as under `| tee` or in a batch job): the console's 150 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)  # set, it says the width (test_compare_edges39)
    console = cli_console.console(outlive_reader=True)
    assert console.width == 150
    lp_report.print_table(_table_rows(), META, console)
    printed = capsys.readouterr().out
    assert "…" not in printed and max(map(len, printed.splitlines())) <= 150
    assert "0.67x" in printed and "1.77e-04" in printed


def _run(precision, turns, rng):
    """A finished run as the parent records it: the warm-up (3 untimed steps), then 4 steps a turn around each turn's
    given median. Step times are given, not measured: skewed and drifting machines cannot be made on demand."""
    run = runner.Run(precision, None, None)
    run.blocks = [[0.5] * 3 + [turns[0] / 1e3]] + [
        sorted(t / 1e3 * f for f in (rng.uniform(0.8, 1.0), 1.0, 1.0, rng.uniform(1.0, 1.4))) for t in turns[1:]]
    run.times = [t for block in run.blocks for t in block]
    run.losses = [1.0] * len(run.times)
    run.result = {"val_acc": 0.9, "grad_underflow_fp16": 0.0, "grad_underflow_fp16_scaled": None, "skipped_steps": 0}
    return run


def _rows(base, other, rng):
    steps = 4 * len(base)
    runs = {"32-true": _run("32-true", base, rng), "bf16-mixed": _run("bf16-mixed", other, rng)}
    args = argparse.Namespace(steps=steps, batch_size=32, accelerator="cpu", emulate=False)
    machine = {"cpu": {"native_bf16": True, "native_fp16": False}, "gpus": []}
    rows = [lp_rows.make_row(run, args, machine) for run in runs.values()]
    lp_rows.add_speedups(rows, runs, steps)
    return rows


# The turns that printed `0.96x [0.66-0.85]` beside "measurably slower": 32-true's ms/step over bf16-mixed's (0.96)
# outside the paired ratios' interquartile range.
SKEWED = ([40, 20, 10, 40, 40, 20, 40, 40, 40, 20], [59, 25, 16, 61, 42, 30, 46, 41, 62, 30])


def _timing_sets():
    rng = random.Random(0)
    sets = [SKEWED, ([10, 20, 30] * 2, [25, 15, 28] * 2), ([40, 10, 10, 40, 10, 10], [39, 9, 45, 19, 9, 9])]
    for _ in range(60):
        n = rng.randint(1, 12)
        drift = [rng.choice([1, 1, 2, 4]) for _ in range(n)]  # the machine's speed, turn by turn
        ratio = rng.choice([0.6, 0.95, 1.0, 1.05, 1.6])
        sets.append(([10 * d * rng.uniform(0.9, 1.1) for d in drift],
                     [10 * d / ratio * rng.uniform(0.7, 1.3) * rng.choice([1, 1, 1, 2]) for d in drift]))
    return sets


def test_the_printed_speedup_lies_in_its_bracket_and_the_verdict_reads_the_same():
    """One statistic for the cell, its bracket, the "~" mark and the verdict: the median of the paired turn ratios
    with their interquartile range. Over skewed, drifting and steady machines, the printed figure lies within its
    printed bracket, "measurably slower" only where the whole bracket is below 1x, "the one to use" only where it is
    above, and "~" exactly where neither is claimed."""
    rng = random.Random(1)
    for base, other in _timing_sets():
        rows = _rows(base, other, rng)
        row, cell = rows[1], lp_report.cells(rows[1])[3]
        match = re.fullmatch(r"(~?)(\d+\.\d\d)x(?: \[(\d+\.\d\d)-(\d+\.\d\d)\])?", cell)
        assert match, cell
        if match[3] is not None:
            assert float(match[3]) <= float(match[2]) <= float(match[4]), (base, other, cell)
        verdict = lp_report.verdict(rows, META)
        slower, faster = "bf16-mixed" in verdict and "measurably slower" in verdict, "one to use" in verdict
        assert slower <= (row.speedup_q3 is not None and row.speedup_q3 < 1), (base, other, cell, verdict)
        assert faster <= (row.speedup_q1 is not None and row.speedup_q1 > 1), (base, other, cell, verdict)
        assert (match[1] == "~") == (not slower and not faster), (base, other, cell, verdict)
        if slower or faster:
            assert f"{row.speedup:.2f}x" in verdict  # the verdict quotes the cell's figure


def test_the_skewed_turns_print_the_paired_median_inside_its_bracket():
    rows = _rows(*SKEWED, random.Random(2))
    bf16 = rows[1]
    assert rows[0].median_step_ms / bf16.median_step_ms == pytest.approx(0.96, abs=0.02)  # what the cell printed
    assert lp_report.cells(bf16)[3] == "0.67x [0.66-0.85]"
    assert bf16.speedup == bf16.speedup_paired == pytest.approx(statistics.median(
        b / o for b, o in zip(*SKEWED, strict=True)))
    assert "(bf16-mixed 0.67x: measurably slower)" in lp_report.verdict(rows, META)


def _memory_rows(true_peak, precision="bf16-true", held=HELD):
    true_held = {**held, "weights": held["weights"] // 2, "gradients": held["gradients"] // 2,
                 "optimizer_states": held["optimizer_states"] // 2}
    return [Row("32-true", peak_memory_mb=93.0, bytes_per_param=16.0, training_bytes=held),
            Row(precision, peak_memory_mb=true_peak, bytes_per_param=8.0, training_bytes=true_held)]


def test_a_true_row_above_32_trues_peak_says_why_with_its_transient():
    """bf16-true measured 145 MB against 32-true's 93 MB with half the bytes a parameter: its fp32 optimizer step on a
    model of one step_chunk. The note gives the transient counted from the row (2M parameters, bf16 weights,
    gradients and Adam's two states: 16 bytes an element widened, at least 31 MB), only where the peak is above 32-true's and
    only for the rows that step in fp32."""
    notes = lp_report.fp32_step_notes(_memory_rows(145.0))
    assert notes == [
        "bf16-true: peak mem 145 MB against 32-true's 93 MB, though it holds 8.0 bytes a parameter to 32-true's 16.0:"
        " its optimizer step runs in fp32 (16 bytes an element widened), and this model's 2,000,000 parameters fit"
        " one step_chunk (16,777,216 elements), so its weights, gradients and states are widened at once: at least 31"
        " MB of fp32 copies during the step (the optimizer's temporaries on them come on top). On models larger than a"
        " chunk the copies stay at step_chunk elements (256 MB), while the bytes held keep shrinking with the model."]
    assert notes[0] in lp_report.notes(_memory_rows(145.0), META)
    assert lp_report.fp32_step_notes(_memory_rows(90.0)) == []  # below 32-true's: nothing to explain
    assert lp_report.fp32_step_notes(_memory_rows(145.0, "lightning-bf16-true")) == []  # no fp32 step
    assert lp_report.fp32_step_notes(_memory_rows(145.0, "16-true"))[0].startswith("16-true: peak mem 145 MB")
    tiny = {k: v // 4000 for k, v in HELD.items()}  # 500 parameters: copies of 8 KB, 2 MB over 32-true is noise
    assert lp_report.fp32_step_notes(_memory_rows(95.0, held=tiny)) == []
    large = {k: v * 20 for k, v in HELD.items()}  # 40M parameters: three chunks
    assert "widened step_chunk (16,777,216) elements at a time: at least 256 MB of fp32 copies" in \
        lp_report.fp32_step_notes(_memory_rows(2000.0, held=large))[0]
