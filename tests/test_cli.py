"""The lightning-precision command line: fit over every YAML config, compare on a tiny setting, doctor."""

import json
from pathlib import Path

import pytest

from lightning_precision import cli, compare

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("precision-"))
VARIANTS = sorted(p.name for p in (ROOT / "recipes").glob("precision-*.yaml"))
FEW_STEPS = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
             "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]


def test_there_is_a_config_per_recipe_and_per_precision():
    assert CONFIGS == ["distilbert.yaml", "resnet50.yaml", "vit.yaml"]
    assert len(VARIANTS) >= 4


@pytest.mark.parametrize("config", CONFIGS)
def test_each_config_runs_through_fit(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["fit", "--config", str(ROOT / "recipes" / config), *FEW_STEPS]) == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_precision_variant_combines_with_a_recipe(variant, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    configs = ["--config", str(ROOT / "recipes" / "vit.yaml"), "--config", str(ROOT / "recipes" / variant)]
    assert cli.main(["fit", *configs, *FEW_STEPS]) == 0


def test_compare_writes_table_json_csv_and_plots(tmp_path, capsys):
    out = tmp_path / "report"
    code = cli.main(["compare", "--recipe", "vit", "--precisions", "32-true,bf16-mixed,16-mixed", "--steps", "4",
                     "--batch-size", "8", "--val-batches", "1", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "32-true" in printed and "bf16-mixed" in printed and "16-mixed" in printed and "speedup" in printed
    report = json.loads((out / "report.json").read_text())
    rows = report["results"]
    assert [r["precision"] for r in rows] == ["32-true", "bf16-mixed", "16-mixed"]
    assert rows[0]["speedup"] == 1.0 and all(r["median_step_ms"] > 0 and len(r["losses"]) == 4 for r in rows)
    assert all(0 <= r["val_acc"] <= 1 and r["grad_underflow_fp16"] is not None for r in rows)
    assert (out / "report.csv").read_text().splitlines()[0].startswith("precision,median_step_ms")
    for png in ("loss.png", "throughput.png", "memory.png"):
        assert (out / png).stat().st_size > 5_000


def test_a_failed_precision_keeps_the_others(tmp_path, monkeypatch, capsys):
    real = compare.make_plugin

    def broken(precision, emulate):
        if precision == "bf16-mixed":
            raise RuntimeError("simulated failure")
        return real(precision, emulate)

    monkeypatch.setattr(compare, "make_plugin", broken)
    out = tmp_path / "r"
    code = cli.main(["compare", "--recipe", "vit", "--precisions", "32-true,bf16-mixed", "--steps", "2",
                     "--batch-size", "8", "--val-batches", "0", "--out", str(out)])
    assert code == 1
    rows = json.loads((out / "report.json").read_text())["results"]
    assert rows[0]["precision"] == "32-true" and "error" not in rows[0]
    assert rows[1] == {"precision": "bf16-mixed", "error": "RuntimeError: simulated failure"}
    assert "failed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recipe", "gpt2"], "unknown recipe 'gpt2'"),
        (["--precisions", "32-true,fp4"], "unknown precision 'fp4'"),
        (["--precisions", "fp8"], "fp8 needs a CUDA GPU.*--emulate"),
        (["--data-dir", "/nonexistent/imdb"], "data folder '/nonexistent/imdb' does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    import re

    assert cli.main(["compare", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err)


def test_doctor_runs(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "cpu" in out and "recommended" in out


def test_unknown_command():
    assert cli.main(["train"]) == 2


def _fail_if_trained(monkeypatch):
    def run_one(*args, **kwargs):
        raise AssertionError("a usage error must be reported before any training")

    monkeypatch.setattr(compare, "run_one", run_one)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precisions", ",,,"], r"--precisions ',,,' names no precision"),
        (["--out", "{blocker}/report"], r"--out: cannot write into .*a-file"),
        (["--out", "{blocker}"], r"--out: .*a-file' exists and is not a folder"),
    ],
)
def test_bad_output_and_precisions_fail_before_any_training(args, message, tmp_path, capsys, monkeypatch):
    import re

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _fail_if_trained(monkeypatch)
    assert cli.main(["compare", *[a.format(blocker=blocker) for a in args]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err)


TINY = ["--recipe", "vit", "--steps", "3", "--batch-size", "8", "--val-batches", "0"]


def test_the_table_is_printed_before_the_files_are_written(tmp_path, capsys):
    out = tmp_path / "r"
    (out / "report.json").mkdir(parents=True)  # a real write failure after the training: a folder in the file's way
    code = cli.main(["compare", *TINY, "--precisions", "32-true", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert "32-true" in captured.out and "speedup" in captured.out  # the results reached the screen
    assert "could not write the report" in captured.err


def test_ctrl_c_keeps_the_finished_precisions(tmp_path, capsys, monkeypatch):
    """A real SIGINT during the second precision's fit: Lightning turns it into SystemExit(1). What finished is kept
    and written, the interrupted and the unrun precisions are marked, and the exit code says "interrupted"."""
    import os
    import signal

    runs = []
    start, end = compare.RunStats.on_train_start, compare.RunStats.on_train_batch_end

    def on_train_start(self, *args):
        runs.append(self)
        start(self, *args)

    def on_train_batch_end(self, *args):
        end(self, *args)
        if len(runs) == 2 and len(self.times) == 2:  # the second precision, after its second step
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(compare.RunStats, "on_train_start", on_train_start)
    monkeypatch.setattr(compare.RunStats, "on_train_batch_end", on_train_batch_end)
    out = tmp_path / "r"
    code = cli.main(["compare", *TINY, "--precisions", "32-true,bf16-mixed,16-mixed", "--out", str(out)])
    assert code == 130
    report = json.loads((out / "report.json").read_text())
    rows = {r["precision"]: r for r in report["results"]}
    assert report["meta"]["interrupted"] is True
    assert "error" not in rows["32-true"] and len(rows["32-true"]["losses"]) == 3
    assert "interrupted" in rows["bf16-mixed"]["error"] and "not run" in rows["16-mixed"]["error"]
    assert "INTERRUPTED" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again afterwards


def test_fit_reports_a_plugins_bad_argument_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  plugins:\n    - class_path: lightning_precision.FP16MixedPrecision\n"
                   "      init_args:\n        init_scale: -1.0\n")
    code = cli.main(["fit", "--config", str(ROOT / "recipes" / "vit.yaml"), "--config", str(bad), *FEW_STEPS])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.splitlines() == [err] and "FP16MixedPrecision(init_scale=-1.0)` is invalid" in err
