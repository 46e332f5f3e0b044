"""The command-line changes of issue 39 under hostile input: a diverged loss, console widths from 1 to 300 columns,
``COLUMNS`` beside a pipe, ``--threads`` beyond what a process can start, and the ``--eval-precision`` refusal's one
line."""

import re
from io import StringIO

import pytest
import torch
from rich.console import Console

import lightning_precision.cli as cli
from lightning_precision.cli import console as cli_console
from lightning_precision.cli.compare import args as compare_args
from lightning_precision.cli.compare import report as lp_report
from lightning_precision.cli.compare import runner, threads
from lightning_precision.cli.compare.rows import Row
from tests.cli.test_compare_report import META, _table_rows

TINY = ["--recipe", "vit", "--steps", "2", "--batch-size", "8", "--val-batches", "1"]
NAN = float("nan")


def _printed(rows, width):
    console = Console(file=StringIO(), width=width)
    lp_report.print_table(rows, META, console)
    return console.file.getvalue()


def _shown(printed):
    """The headers left out (the line under the table) and every word of the table."""
    table = printed.split("ms/step: the median")[0]
    match = re.search(r"not shown at \d+ columns: (.*?)\. Every column", " ".join(table.split()))
    return (match[1].split("; ") if match else []), set(table.replace("│", " ").replace("┃", " ").split())


def test_a_diverged_loss_is_printed_in_e_notation_and_leaves_the_columns_in_place():
    """A loss of 3e38 (a diverging fp32 run short of inf) printed as 43 digits, most of them float noise, and that one
    cell left 8 of the 14 columns out at 120 columns. Now it is 3.000e+38, and the table keeps the columns it keeps
    for an ordinary loss; a loss below 1e5 keeps its 3 decimals."""
    rows = _table_rows()
    ordinary, _ = _shown(_printed(rows, 120))
    rows[1].final_loss = 3.0e38
    left_out, words = _shown(_printed(rows, 120))
    assert lp_report.cells(rows[1])[9] == "3.000e+38" and "3.000e+38" in words
    assert left_out == ordinary
    rows[1].final_loss = 12345.678
    assert lp_report.cells(rows[1])[9] == "12345.678"
    rows[1].final_loss = NAN
    assert lp_report.cells(rows[1])[9] == "nan"


def _edge_sets():
    failed = Row("fp8", error="RuntimeError: " + "x" * 300 + " and on")
    nan = {"median_step_ms": NAN, "final_loss": NAN, "val_acc": NAN, "peak_memory_mb": NAN, "spread": NAN}
    return {
        "every kind": _table_rows(),
        "only the baseline": [_table_rows()[0]],
        "all NaN": [Row("32-true", **nan, speedup=1.0),
                    Row("bf16-true", **nan, speedup=NAN, speedup_q1=NAN, speedup_q3=NAN, speedup_resolved=False)],
        "failed with a long error": [_table_rows()[0], failed],
        "nothing ran": [Row("32-true", error="boom"), failed],
    }


@pytest.mark.parametrize("width", [1, 20, 40, 79, 300])
@pytest.mark.parametrize("kind", list(_edge_sets()))
def test_the_table_at_any_width_cuts_no_word_of_a_shown_column(kind, width):
    """No crash, no "…", and every word of every column shown appears whole, for any console and any rows."""
    rows = _edge_sets()[kind]
    printed = _printed(rows, width)
    left_out, words = _shown(printed)
    assert "…" not in printed
    for row in rows:
        for header, cell in zip(lp_report.columns(META), lp_report.cells(row), strict=True):
            if header not in left_out:
                assert set(cell.split()) <= words, (header, cell)


def test_columns_in_the_environment_sets_the_width_of_a_piped_report(monkeypatch):
    """stdout a pipe (pytest's capture): `COLUMNS=300 lightning-precision compare | tee log` printed at 150 columns
    regardless, as rich reads COLUMNS only where no width is given. An exported COLUMNS now wins, as on a terminal; a
    value that is not a positive number is ignored."""
    monkeypatch.setenv("COLUMNS", "300")
    assert cli_console.console(outlive_reader=True).width == 300
    for junk in ("0", "wide", ""):
        monkeypatch.setenv("COLUMNS", junk)
        assert cli_console.console(outlive_reader=True).width == 150


@pytest.mark.parametrize("threads_asked", [str(10**20), "17"])
def test_threads_beyond_what_a_process_can_start_are_one_line_exit_2_before_any_training(threads_asked, tmp_path,
                                                                                         capsys, monkeypatch):
    """`--threads 99999999999999999999` ended in a traceback (torch's "Overflow when unpacking long"); 16384 threads
    abort the process in libgomp ("Thread creation failed") and 100000 crashed it with a segfault (measured on this
    2-CPU VM, not reproduced here). More than 8 a CPU is refused now, in one line; up to that, a note warns."""
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(runner, "start", lambda *a: pytest.fail("a usage error must be reported before any training"))
    assert cli.main(["compare", *TINY, "--threads", threads_asked, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--threads {threads_asked} is more than 16, 8 for each of the 2 CPUs" in err and "give at most 2" in err
    assert not (tmp_path / "r").exists()
    assert compare_args.parse_args([*TINY, "--threads", "16"]).threads == 16  # the bound itself: a warning only
    assert compare_args.threads_note(16).startswith("--threads 16 is more than the 2 CPUs")


def test_the_eval_precision_refusal_quotes_the_plugins_reason_without_doubled_stops(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "start", lambda *a: pytest.fail("a usage error must be reported before any training"))
    argv = ["compare", *TINY, "--precisions", "32-true,bf16-true", "--eval-precision", "16-mixed"]
    assert cli.main([*argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "evaluate as it trains)); leave it out of --precisions" in err and ".)" not in err, err


def test_a_step_without_a_loss_keeps_its_nan_on_the_device_the_other_losses_are_on():
    """A user's ``training_step`` may return None: its NaN joins the block's losses, which ``flush`` stacks. Made on the
    CPU it failed beside CUDA losses on a GPU; the meta device stands in for the GPU here (no CUDA on this machine)."""
    from types import SimpleNamespace

    from lightning_precision.cli.compare.child import RunStats

    stats = RunStats(4, lambda: None, lambda *a: None)
    module = SimpleNamespace(device=torch.device("meta"))
    for outputs in (None, {"loss": None}, {"loss": torch.zeros((), device="meta")}):
        stats.on_train_batch_end(None, module, outputs)
    assert [t.device.type for t in stats._losses] == ["meta"] * 3
    torch.stack(stats._losses)  # what `flush` does: one device
