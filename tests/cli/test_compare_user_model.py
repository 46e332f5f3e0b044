"""`lightning-precision compare` on the user's own model: `--model`/`--data` class paths or a LightningCLI-style
`--config`, resolved and checked before any training (each refusal one line naming the option, the class and the fix),
measured once as a recipe is, then run under each precision in its own process, reported in the same table."""

import json
import sys

import pytest

import lightning_precision.cli as cli
from lightning_precision.cli.compare import main as compare_main
from lightning_precision.cli.compare import report as lp_report
from lightning_precision.cli.compare import user_model
from lightning_precision.cli.compare.args import UsageError, parse_args
from lightning_precision.cli.compare.rows import Row

MODELS = "tests.cli.user_models"
NET, DATA = f"{MODELS}.TinyNet", f"{MODELS}.TinyData"


def _refused(argv):
    with pytest.raises(UsageError) as caught:
        parse_args(argv)
    return str(caught.value)


def test_model_and_data_class_paths_with_json_init_args():
    args = parse_args(["--model", NET, "--model-args", '{"hidden": 8}', "--data", DATA, "--data-args",
                       '{"batch_size": 4}'])
    spec = args.user
    assert (spec.model.path, dict(spec.model.init_args)) == (NET, {"hidden": 8})
    assert (spec.data.path, dict(spec.data.init_args)) == (DATA, {"batch_size": 4})
    # the table's title and the progress lines name the model; no recipe's batch size stands in for the data's
    assert args.recipe == "TinyNet" and args.batch_size is None and spec.config is None and spec.notes() == []
    assert spec.describe() == f"{NET}(hidden=8) on {DATA}(batch_size=4)"
    assert parse_args([]).user is None and parse_args([]).recipe == "distilbert"  # a recipe, as before


def test_a_lightningcli_config_in_its_full_and_short_forms_other_keys_said_to_be_ignored(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(f"seed_everything: 0\ntrainer:\n  max_steps: 5\nmodel:\n  class_path: {NET}\n  init_args:\n"
                      f"    hidden: 8\ndata:\n  class_path: {DATA}\n")
    spec = parse_args(["--config", str(config)]).user
    assert (spec.model.path, dict(spec.model.init_args), spec.data.path, dict(spec.data.init_args)) == \
        (NET, {"hidden": 8}, DATA, {})
    assert spec.model.named_by == f"model.class_path in {config}" and spec.ignored == ("seed_everything", "trainer")
    assert spec.notes() == [f"--config {config}: seed_everything:, trainer: ignored: compare runs its own Trainer for"
                            " each precision (--steps, --seed, --accelerator), and the model's configure_optimizers."]
    config.write_text(f"model: {NET}\ndata: {DATA}\n")  # the class path alone
    spec = parse_args(["--config", str(config)]).user
    assert (spec.model.path, spec.data.path, spec.ignored) == (NET, DATA, ())


@pytest.mark.parametrize(("argv", "message"), [
    (["--recipe", "vit", "--model", NET, "--data", DATA], "--recipe and --model both say what to train"),
    (["--model", NET], "--model needs --data: compare trains --model pkg.Net on --data pkg.Data"),
    (["--model", "Net", "--data", DATA], "--model Net: give the class's full import path, module.Class"),
    (["--model", f"{MODELS}.Nope", "--data", DATA], f"--model {MODELS}.Nope: module '{MODELS}' .* has no attribute"
                                                    " 'Nope'"),
    (["--model", f"{MODELS}.PlainModule", "--data", DATA], f"--model {MODELS}.PlainModule is not a LightningModule"
                                                           r" \(its bases: Module\)"),
    (["--model", f"{MODELS}.not_a_class", "--data", DATA], "is not a class but a function"),
    (["--model", f"{MODELS}.NoOptimizer", "--data", DATA], r"NoOptimizer defines no configure_optimizers\(\), which"),
    (["--model", NET, "--data", NET], f"--data {NET} is not a LightningDataModule"),
    (["--model", NET, "--data", DATA, "--batch-size", "8"], "--batch-size is a recipe's: .* --data-args"),
    (["--model", NET, "--data", DATA, "--model-args", "[8]"], r"--model-args '\[8\]' is a JSON list"),
    (["--model", NET, "--data", DATA, "--model-args", "{hidden: 8}"], "--model-args '{hidden: 8}' is not JSON"),
    (["--config", "c.yaml", "--model", NET], "--config and --model both name the model"),
    (["--config", "/nonexistent/c.yaml"], "--config /nonexistent/c.yaml: cannot read it"),
])
def test_what_cannot_be_resolved_is_refused_naming_the_option_and_the_class(argv, message):
    import re

    assert re.search(message, _refused(argv))


def test_size_is_refused_before_the_users_module_is_imported(tmp_path, monkeypatch):
    """Nothing of the user's runs for a command that is refused: their module's import-time code included."""
    (tmp_path / "loud_models.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.chdir(tmp_path)
    assert _refused(["--model", "loud_models.Net", "--data", "loud_models.Data", "--size", "real"]) == (
        "--size real: the recipes' sizes; your own model runs as its data makes it")
    assert "loud_models" not in sys.modules


def test_a_module_that_is_not_there_names_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _refused(["--model", "my_pkg.Net", "--data", DATA]) == (
        f"--model my_pkg.Net: no module named 'my_pkg' (the current directory is {tmp_path}; is the package"
        " installed?)")


@pytest.mark.parametrize(("text", "message"), [
    ("model:\n  class_path: a.B\n   init_args: {}\n", "--config {cfg}: not valid YAML: line 3, column 13: mapping values"),
    ("- model\n", "--config {cfg}: expected a mapping with model: and data: (LightningCLI's format), not a list"),
    (f"model: {NET}\n", "--config {cfg} sets no data: (add `data: {{class_path: my_pkg.Data, init_args: {{...}}}}`)"),
    (f"model:\n  class_path: {NET}\n  hidden: 8\ndata: {DATA}\n",
     "--config {cfg}: model: has hidden beside class_path: init args go under model.init_args"),
    (f"model: {NET}\ndata:\n  class_path: {MODELS}.PlainModule\n",
     f"data.class_path in {{cfg}} {MODELS}.PlainModule is not a LightningDataModule"),
])
def test_a_bad_config_is_refused_with_its_path_and_line(tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    assert message.format(cfg=config) in _refused(["--config", str(config)])


def test_the_current_directory_is_importable_and_the_callers_sys_path_kept(tmp_path, monkeypatch):
    """As under `python -m`: a module in the current directory is found, without leaving it on the caller's path."""
    (tmp_path / "my_models.py").write_text(f"from {MODELS} import TinyData, TinyNet  # the user's module\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    spec = parse_args(["--model", "my_models.TinyNet", "--data", "my_models.TinyData"]).user
    assert spec.cwd == str(tmp_path) and sys.path == before


def test_the_batch_and_the_flops_are_measured_on_the_users_training_step():
    """Counted on the loss training_step returns: 8 samples through Linear(32, 16) and Linear(16, 4), forward 2 * 8 *
    (512 + 64) FLOPs, backward the second layer's input and weight gradients and the first layer's weight gradient
    (its input needs none): 9216 + 2048 + 8192."""
    measured = compare_main.measure_batch(parse_args(["--model", NET, "--data", DATA]))
    assert measured == {"batch_size": 8, "unit": None, "units_per_batch": None, "model_flops_per_step": 19456}


def test_a_step_that_needs_the_trainer_leaves_the_flops_out_with_a_note():
    measured = user_model.measure_batch(parse_args(["--model", f"{MODELS}.TrainerBoundNet", "--data", DATA]).user, 0)
    assert measured["model_flops_per_step"] is None and measured["batch_size"] == 8
    assert measured["flops_note"].startswith("MFU: n/a: TrainerBoundNet's FLOPs per step could not be counted on its"
                                             " training_step outside a Trainer (RuntimeError: ")
    assert lp_report.mfu_notes([Row("32-true", peak_source="x")], measured) == [measured["flops_note"]]


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", NET, "--model-args", '{"hidden": 0}', "--data", DATA],
     f"--model {NET}: {NET}(hidden=0) raised ValueError: hidden must be positive, got 0 (init args from"
     " --model-args)"),
    (["--model", NET, "--data", DATA, "--data-args", '{"batch": 8}'],
     f"--data {DATA}: {DATA}(batch=8) raised TypeError: "),
    (["--model", NET, "--data", f"{MODELS}.BrokenData"],
     f"--data {MODELS}.BrokenData: its first training batch cannot be made (FileNotFoundError: /data/train.csv), so"
     " every precision would fail"),
    (["--model", NET, "--data", f"{MODELS}.EmptyData"],
     f"--data {MODELS}.EmptyData: train_dataloader() yields no batch (it is empty), so every precision would fail"),
    # found on the step the FLOPs are counted on: the Trainer would skip every step, or fail in every precision
    (["--model", f"{MODELS}.ReturnsNothing", "--data", DATA],
     f"--model {MODELS}.ReturnsNothing: ReturnsNothing.training_step returned None: nothing would train; return the"
     " loss (or a dict with 'loss')"),
    (["--model", f"{MODELS}.ReturnsNoLoss", "--data", DATA],
     f"--model {MODELS}.ReturnsNoLoss: ReturnsNoLoss.training_step returned a dict without 'loss' (keys: total):"
     " nothing would train; return the loss (or a dict with 'loss')"),
])
def test_a_model_or_data_that_cannot_be_built_is_refused_before_any_run(argv, message):
    with pytest.raises(UsageError) as caught:
        compare_main.measure_batch(parse_args(argv))
    assert str(caught.value).startswith(message)


def test_a_precisions_process_imports_from_the_current_directory(tmp_path, monkeypatch):
    """`build` in a precision's process puts the directory the command ran in first on its path, for the whole run (a
    module may import another in a step)."""
    import importlib

    (tmp_path / "my_models.py").write_text(f"from {MODELS} import TinyData, TinyNet\n")
    (tmp_path / "my_layers.py").write_text("WIDTH = 8\n")  # what the user's step imports when it runs
    monkeypatch.chdir(tmp_path)
    spec = parse_args(["--model", "my_models.TinyNet", "--data", "my_models.TinyData"]).user
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])  # a process's path, restored after
    monkeypatch.delitem(sys.modules, "my_models")
    model, data = user_model.build(spec)
    assert type(model).__name__ == "TinyNet" and data.batch_size == 8
    assert importlib.import_module("my_layers").WIDTH == 8
    monkeypatch.delitem(sys.modules, "my_layers")


def test_the_accuracy_note_names_what_the_users_validation_logged():
    meta = {"model": NET, "recipe": "TinyNet", "val_batches": 2, "device": "cpu"}
    logged = [Row("32-true", steps_done=4, val_metrics={"val_loss": 1.2, "val_f1": 0.4})]
    assert "val acc: -: TinyNet logs no val_acc; its validation logs val_f1, val_loss (each precision's values in" \
           " report.json's val_metrics)." in lp_report.notes(logged, meta)
    assert "val acc: -: no validation ran: TinyNet defines no validation_step, or its data no val_dataloader." in \
        lp_report.notes([Row("32-true", steps_done=4)], meta)
    assert not [n for n in lp_report.notes([Row("32-true", steps_done=4, val_acc=0.5)], meta) if "val acc" in n]


@pytest.mark.slow
def test_compare_runs_the_users_model_under_each_precision_and_a_failing_one_is_its_row(tmp_path, monkeypatch,
                                                                                        capsys):
    """The whole command on a user's model in a module of the current directory (which each precision's process
    imports): 32-true runs whole; bf16-mixed runs under autocast, where the model raises at its fifth step, and its
    row says so, naming the precision and the class; the exit code says a precision failed."""
    (tmp_path / "my_models.py").write_text(f"from {MODELS} import TinyData, TinyNet  # the user's module\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "report"
    code = cli.main(["compare", "--model", "my_models.TinyNet", "--model-args", '{"fail_in": "bfloat16"}', "--data",
                     "my_models.TinyData", "--precisions", "32-true,bf16-mixed", "--steps", "6", "--val-batches", "1",
                     "--out", str(out)])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 1
    report = json.loads((out / "report.json").read_text())
    meta, (fp32, bf16) = report["meta"], report["results"]
    assert (meta["model"], meta["data"]) == ("my_models.TinyNet(fail_in='bfloat16')", "my_models.TinyData()")
    assert meta["recipe"] == "TinyNet" and meta["batch_size"] == 8 and meta["model_flops_per_step"] == 19456
    assert (fp32["precision"], fp32["steps_done"], bf16["precision"]) == ("32-true", 6, "bf16-mixed")
    assert "error" not in fp32 and fp32["bytes_per_param"] == pytest.approx(16.0, abs=0.05)
    assert fp32["samples_per_s"] == pytest.approx(8 / (fp32["median_step_ms"] / 1e3))  # the batch's first dim
    assert fp32["val_acc"] is None and set(fp32["val_metrics"]) == {"val_loss"}
    error = ("RuntimeError: the loss went to NaN in layer net.2 (training my_models.TinyNet on my_models.TinyData under"
             " bf16-mixed)")
    assert bf16["error"] == error and bf16["steps_done"] == 4 and "Traceback" in bf16["traceback"]
    assert f"bf16-mixed failed: {error}" in printed and "TinyNet: my_models.TinyNet(fail_in='bfloat16') on" in printed
    md = (out / "report.md").read_text()
    assert "- Model: my_models.TinyNet(fail_in='bfloat16') on my_models.TinyData()" in md
    assert "| 32-true | " in md and "| bf16-mixed (failed) | " in md
    assert "val acc: -: TinyNet logs no val_acc; its validation logs val_loss" in md
