"""`compare --eval-precision` (each plugin's eval_precision=, refused before any training where a row's plugin cannot)
and `compare --threads` (the CPU threads each precision's process runs with, counted in the process itself)."""

import argparse
import json
import re

import lightning as L
import pytest

import lightning_precision.cli as cli
from lightning_precision import BF16MixedPrecision, BF16TruePrecision, FP8Precision, FP16TruePrecision
from lightning_precision.cli.compare import args as compare_args
from lightning_precision.cli.compare import child, runner

pytestmark = pytest.mark.slow  # the command line's own machinery: CI runs it on one torch (pyproject.toml)

TINY = ["--recipe", "vit", "--steps", "2", "--batch-size", "8", "--val-batches", "1"]


def _fail_if_trained(monkeypatch):
    monkeypatch.setattr(runner, "start", lambda *a: pytest.fail("a usage error must be reported before any training"))


def _args(eval_precision, val_batches=1):
    return argparse.Namespace(eval_precision=eval_precision, val_batches=val_batches, emulate=True, steps=10)


@pytest.mark.parametrize(("precision", "eval_precision", "cls"), [
    ("bf16-mixed", "16-mixed", BF16MixedPrecision),
    ("bf16-true", "32-true", BF16TruePrecision),
    ("16-true", "32-true", FP16TruePrecision),
    ("fp8", "bf16-mixed", FP8Precision),
    ("fp8-auto", "32-true", FP8Precision),
])
def test_each_row_of_ours_gets_the_eval_precision_asked(precision, eval_precision, cls):
    plugin = compare_args.make_plugin(precision, True, 10, compare_args.eval_of(_args(eval_precision)))
    assert type(plugin) is cls and plugin.eval_precision == eval_precision
    as_trained = compare_args.make_plugin(precision, True, 10, compare_args.eval_of(_args("as-trained")))
    assert as_trained.eval_precision is None


def test_lightnings_own_rows_evaluate_as_they_train_and_the_note_says_so():
    rows = ["32-true", "bf16-mixed", "lightning-bf16-true"]
    assert compare_args.make_plugin("32-true", True, 10, "bf16-mixed") is None  # the Trainer's default
    assert compare_args.eval_note(rows, _args("as-trained")) == \
        "val acc: each precision evaluated as it trains (--eval-precision as-trained)."
    # 32-true evaluates in fp32 as it trains: what --eval-precision 32-true asks of it
    assert compare_args.eval_note(rows[:2], _args("32-true")) == \
        "val acc: evaluated in 32-true for every precision (--eval-precision 32-true)."
    assert compare_args.eval_note(rows, _args("32-true")) == (
        "val acc: evaluated in 32-true for 32-true, bf16-mixed (--eval-precision 32-true); lightning-bf16-true as"
        " trained: Lightning's own precision takes no eval_precision.")
    assert compare_args.eval_note(rows, _args("bf16-mixed")).startswith(
        "val acc: evaluated in bf16-mixed for bf16-mixed (--eval-precision bf16-mixed); 32-true, lightning-bf16-true"
        " as trained")
    assert compare_args.eval_note(rows, _args("32-true", val_batches=0)) is None  # no validation, no val acc


@pytest.mark.parametrize(("argv", "message"), [
    (["--precisions", "32-true,bf16-true,16-true,bf16-mixed", "--eval-precision", "bf16-mixed"],
     r"^lightning-precision compare: error: --eval-precision bf16-mixed: bf16-true, 16-true cannot evaluate in"
     r" bf16-mixed \(`BF16TruePrecision\(eval_precision='bf16-mixed'\)`: .*\); leave them out of --precisions, or"
     r" choose another --eval-precision \(as-trained, 32-true, bf16-mixed, 16-mixed\)\.$"),
    (["--threads", "0"], r"--threads 0: give a number of threads >= 1"),
])
def test_bad_eval_precision_or_threads_is_one_line_and_exit_2_before_any_training(argv, message, tmp_path, capsys,
                                                                                  monkeypatch):
    _fail_if_trained(monkeypatch)
    assert cli.main(["compare", *TINY, *argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_more_threads_than_cpus_is_a_warning_note(monkeypatch):
    from lightning_precision.cli.compare import threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    assert compare_args.threads_note(None) is None and compare_args.threads_note(4) is None
    assert compare_args.threads_note(8) == ("--threads 8 is more than the 4 CPUs this process may run on: the threads"
                                            " take turns on them, which slows every step.")


def test_the_child_builds_its_plugin_with_the_eval_precision(monkeypatch):
    """The plumbing from the command's arguments to the plugin that validates in the precision's run (the plugin's own
    evaluation is tested with the plugins)."""
    seen = {}
    validate = L.Trainer.validate

    def record(trainer, *args, **kwargs):
        seen["plugin"] = trainer.precision_plugin
        return validate(trainer, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "validate", record)
    args = compare_args.parse_args([*TINY, "--eval-precision", "32-true"])
    figures = child.train("vit", "bf16-mixed", args)
    assert type(seen["plugin"]) is BF16MixedPrecision and seen["plugin"].eval_precision == "32-true"
    assert 0 <= figures["val_acc"] <= 1


def test_each_precisions_process_runs_with_the_threads_asked_and_the_report_says_so(tmp_path, capsys):
    """One real comparison: torch's threads as each precision's own process counted them (not a timing), on the
    report's machine line, with the evaluation precision's note."""
    import torch

    asked = 1 if torch.get_num_threads() > 1 else 2  # not torch's default here, so that the default cannot pass
    out = tmp_path / "r"
    code = cli.main(["compare", *TINY, "--precisions", "32-true,bf16-mixed", "--threads", str(asked),
                     "--eval-precision", "32-true", "--out", str(out)])
    assert code == 0
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["torch_threads"] == {"32-true": asked, "bf16-mixed": asked}
    assert (meta["threads"], meta["eval_precision"]) == (asked, "32-true")
    assert meta["machine_line"].endswith(f"; torch threads per precision's process: {asked} (--threads {asked})")
    md = (out / "report.md").read_text()
    assert f"- Machine: {meta['machine_line']}\n" in md
    assert "- val acc: evaluated in 32-true for every precision (--eval-precision 32-true).\n" in md
    assert "note: val acc: evaluated in 32-true for every precision" in capsys.readouterr().out
