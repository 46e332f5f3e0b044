"""The lightning-precision command line: fit over every YAML config, compare on a tiny setting, doctor."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_precision.cli as cli
from tests.helpers import communicate

pytestmark = pytest.mark.slow  # the command line's own machinery: CI runs it on one torch (pyproject.toml)

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.mark.parametrize("command", ["compare", "doctor", "plan", "fit"])
def test_a_command_without_the_cli_extra_prints_the_one_install_line(command, monkeypatch, capsys):
    """An install without the `cli` extra (a plugin user's): the real metadata check finds a requirement this install
    does not meet (rich>=999 stands in for a missing package) and the command says how to get it, before importing
    anything of the tool."""
    from lightning_utilities.core.imports import RequirementCache

    from lightning_precision import _imports

    monkeypatch.setattr(_imports, "CLI_REQUIREMENTS", (RequirementCache("rich>=999"),))
    assert cli.main([command]) == 1
    err = capsys.readouterr().err
    assert f"lightning-precision {command}: the command line needs rich>=999" in err
    assert "pip install 'lightning-precision[cli]'" in err and "Traceback" not in err


def test_this_install_has_the_cli_extra():
    from lightning_precision import _imports

    assert _imports.missing_cli_requirements() == []


def test_unknown_command():
    assert cli.main(["train"]) == 2


def test_fit_reports_a_plugins_bad_argument_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  plugins:\n    - class_path: lightning_precision.FP16MixedPrecision\n"
                   "      init_args:\n        init_scale: -1.0\n")
    code = cli.main(["fit", "--config", str(ROOT / "recipes" / "vit.yaml"), "--config", str(bad), *FEW_STEPS])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.splitlines() == [err] and "FP16MixedPrecision(init_scale=-1.0)` is invalid" in err


def test_version(capsys):
    import lightning
    import torch

    import lightning_precision

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (f"lightning-precision {lightning_precision.__version__} (torch"
                                               f" {torch.__version__}, lightning {lightning.__version__})")


def test_version_and_help_import_neither_torch_nor_lightning():
    """`--version` took 5 s importing torch and Lightning: in a fresh interpreter, the console
    script's own import and `main(["--version"])` (and the usage) leave both unimported."""
    script = ("import sys\n"
              "from lightning_precision.cli import main\n"
              "for argv in (['--version'], ['--help'], []):\n"
              "    main(argv)\n"
              "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'pytorch_lightning'))\n"
              "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("lightning-precision 0.1.0 (torch ")


@pytest.mark.parametrize(("first_use", "registries"), [
    ("lightning_precision.XPUPrecision", "fabric trainer"),
    ("lightning_precision.FP16MixedPrecision", "fabric trainer"),
    ("__import__('lightning_precision.fabric').fabric.BF16MixedPrecision", "fabric"),
    ("__import__('lightning_precision.callbacks').callbacks.ChannelsLast", "fabric trainer"),
    ("__import__('lightning_precision.cli.recipes').cli.recipes.RECIPES", "fabric trainer"),
])
def test_the_first_use_of_the_package_registers_xpu(first_use, registries):
    """`import lightning_precision` loads its names on first use (so `--version` imports no torch): the first name
    used, or an import of a subpackage, still registers accelerator="xpu" with Lightning's registries: Fabric's always,
    the Trainer's with the Trainer's side (the Fabric plugins import nothing of `lightning.pytorch`)."""
    script = ("import lightning_precision\n"
              f"{first_use}\n"
              "import sys\n"
              "from lightning.fabric.accelerators import ACCELERATOR_REGISTRY\n"
              "assert 'xpu' in ACCELERATOR_REGISTRY\n"
              "from lightning.pytorch.accelerators import AcceleratorRegistry\n"
              f"assert ('xpu' in AcceleratorRegistry) == {'trainer' in registries}\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("command", ["doctor", "compare", "fit", "plan"])
def test_every_command_has_help_and_does_not_run(command, capsys, monkeypatch):
    from lightning_precision.cli import doctor
    from lightning_precision.cli.compare import runner

    monkeypatch.setattr(doctor, "_package_rows", lambda: pytest.fail("doctor --help ran the doctor"))
    monkeypatch.setattr(runner, "run_all", lambda *a: pytest.fail("compare --help ran a comparison"))
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: lightning-precision {command} ")


def test_fit_usage_lists_only_what_the_tool_accepts(capsys):
    """`lightning-precision fit` takes no options before `fit` and no other subcommand: the usage says so."""
    assert cli.main(["fit", "--help"]) == 0
    out = capsys.readouterr().out
    assert "[options] fit" not in out and "{fit,validate,test,predict}" not in out
    assert "--precision {32-true,bf16-mixed,bf16-true,16-mixed,16-true,fp8,fp8-emulated,nvfp4}" in out
    # what each name puts in trainer.plugins
    assert "16-true: FP16TruePrecision();" in " ".join(out.split()) and "nvfp4: NVFP4Precision()" in " ".join(out.split())


def test_compare_help_shows_every_default(capsys):
    assert cli.main(["compare", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for option, default in (("--steps", "default: 100; 30 with --quick"), ("--batch-size", "default: 32"),
                            ("--seed", "default: 0"), ("--recipe", "default: distilbert"),
                            ("--out", "default: ./compare-report"), ("--val-batches", "default: 8"),
                            ("--accelerator", "default: auto"), ("--precisions", "default: chosen for this machine")):
        assert option in out and default in out, option


def test_doctor_runs(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "cpu" in out and "recommended" in out
    assert "lightning-precision[te]" in out or "transformer-engine" not in out  # rich markup must not eat "[te]"


def test_doctor_json_is_the_machine_and_the_tables(capsys):
    from lightning_precision.cli.machine import cpu_info

    assert cli.main(["doctor", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["machine"]["cpu"] == cpu_info()
    assert found["machine"]["packages"]["torch"] == __import__("torch").__version__
    assert {p["package"] for p in found["packages"]} >= {"torch", "lightning", "torchao", "transformer-engine"}
    te = next(p for p in found["packages"] if p["package"] == "transformer-engine")
    assert te["version"] != "not installed" or te["status"] == "CUDA only: lightning-precision[te]"
    assert found["devices"][0]["device"].startswith("cpu: ")


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "table"])
def test_doctor_whose_reader_has_gone_ends_quietly(json_out, tmp_path):
    """`doctor --json | some-script` where the script exits before reading: the JSON printed
    into a closed pipe ended in a BrokenPipeError traceback on stderr. Now nothing is said (as Unix tools do when
    their reader goes away), exit 0; the tables end as rich ends them, exit 1 without a traceback."""
    run = subprocess.Popen([sys.executable, "-m", "lightning_precision.cli", "doctor", *(["--json"] * json_out)],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run.stdout.close()  # the reader has gone before anything is printed
    _, err = communicate(run)
    assert err == b"", err.decode()
    assert run.returncode == (0 if json_out else 1)


def _fit_quick(config, *extra):
    return cli.main(["fit", "--config", str(ROOT / "recipes" / config), *extra, *FEW_STEPS])


@pytest.mark.parametrize(("precision", "expected"), [
    ("32-true", "MixedPrecision"),  # no plugin of ours: Lightning's own 32-true
    ("bf16-mixed", "BF16MixedPrecision"),
    ("bf16-true", "BF16TruePrecision"),
    ("16-mixed", "FP16MixedPrecision"),
    ("16-true", "FP16TruePrecision"),
    ("fp8-emulated", "FP8Precision"),
])
def test_fit_precision_option_replaces_the_configs_plugin(precision, expected, tmp_path, monkeypatch):
    import lightning as L

    seen = {}
    fit = L.Trainer.fit

    def record(trainer, *args, **kwargs):
        seen["plugin"] = type(trainer.precision_plugin).__name__
        seen["precision"] = trainer.precision
        return fit(trainer, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "fit", record)
    monkeypatch.chdir(tmp_path)
    assert _fit_quick("vit.yaml", "--precision", precision) == 0  # vit.yaml sets BF16MixedPrecision
    if precision == "32-true":
        assert seen["precision"] == "32-true"
    else:
        assert seen["plugin"] == expected


def test_fit_trainer_precision_conflict_is_a_one_line_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _fit_quick("vit.yaml", "--trainer.precision", "16-mixed") == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert "trainer.precision='16-mixed' conflicts" in err and "--precision 16-mixed" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without an fp8 GPU")
@pytest.mark.parametrize(("precision", "says"), [
    ("fp8", "compute capability >= 8.9; use --precision fp8-emulated"),
    ("nvfp4", "compute capability >= 10.0; NVFP4 has no emulation: --precision bf16-mixed trains here"),
])
def test_fit_precision_fp8_without_an_fp8_gpu_is_a_one_line_hint(precision, says, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _fit_quick("vit.yaml", "--precision", precision) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and says in err


def test_fit_precision_nvfp4_on_a_blackwell_gpu(monkeypatch):
    """--precision nvfp4 puts NVFP4Precision() in trainer.plugins where it can run, and names the one install line
    where Transformer Engine is missing. No Blackwell GPU here: its compute capability is mocked."""
    import torch
    from jsonargparse import Namespace

    from lightning_precision import _imports

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    monkeypatch.setattr(_imports, "TRANSFORMER_ENGINE_AVAILABLE", True)
    config = Namespace(trainer=Namespace(precision=None, plugins=None))
    cli._choose_precision(config, "nvfp4")
    assert [p.class_path for p in config["trainer"]["plugins"]] == ["lightning_precision.NVFP4Precision"]
    monkeypatch.setattr(_imports, "TRANSFORMER_ENGINE_AVAILABLE", False)
    with pytest.raises(cli._ConfigError, match=r"Transformer Engine, not installed here: install it with `pip install"
                                                r" 'lightning-precision\[te\]'`"):
        cli._choose_precision(Namespace(trainer=Namespace(precision=None, plugins=None)), "nvfp4")


def test_plan_measures_a_recipe_and_writes_the_plan(tmp_path, capsys):
    pytest.importorskip("torchao")
    from lightning_precision.fp8._plan import PrecisionPlan

    out = tmp_path / "vit.json"
    assert cli.main(["plan", "--recipe", "vit", "--emulate", "--batches", "1", "--out", str(out)]) == 0
    plan = PrecisionPlan.load(out)
    assert plan.batches == 1 and plan.fp8_layers  # emulated: the tiny layers are judged, and pass
    assert f"wrote {out}" in capsys.readouterr().out


def test_plan_with_a_budget_chooses_among_formats_and_prints_the_predicted_saving(tmp_path, capsys):
    pytest.importorskip("torchao")
    from lightning_precision.fp8._plan import PrecisionPlan

    out = tmp_path / "vit.yaml"
    assert cli.main(["plan", "--recipe", "vit", "--emulate", "--batches", "1", "--budget", "0.05", "--candidates",
                     "tensorwise,mxfp8", "--device", "B200", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = PrecisionPlan.load(out)
    assert plan.rule.error_budget == 0.05 and plan.device == "B200"
    assert all({o.format for o in p.alternatives} == {"tensorwise", "mxfp8"} for p in plan.layers if p.alternatives)
    assert "error budget 0.05" in printed and "ms per step" in printed and "predicted for B200" in printed


@pytest.mark.parametrize(("args", "said"), [
    (["--budget", "-1"], "--budget '-1': a number >= 0"),
    (["--budget", "lots"], "--budget 'lots': a number >= 0"),
    (["--candidates", "fp4"], "'fp4' is not a format"),
    (["--device", "TPU"], "--device 'TPU': no such GPU in the speed table"),
    (["--device", "A100"], "--device 'A100' runs no fp8 format"),
])
def test_plan_refuses_bad_choice_arguments_before_measuring(args, said, tmp_path, capsys, monkeypatch):
    from lightning_precision.cli import plan

    monkeypatch.setattr(plan, "make_plan", lambda *a, **k: pytest.fail("measured before checking the arguments"))
    assert cli.main(["plan", "--recipe", "vit", "--out", str(tmp_path / "p.yaml"), *args]) == 2
    assert said in capsys.readouterr().err


def test_plan_refuses_a_bad_output_name_before_measuring(tmp_path, capsys, monkeypatch):
    from lightning_precision.cli import plan  # where the command looks make_plan up

    monkeypatch.setattr(plan, "make_plan", lambda *a, **k: pytest.fail("measured before checking --out"))
    assert cli.main(["plan", "--recipe", "vit", "--out", str(tmp_path / "plan.txt")]) == 2
    assert "name a .yaml, .yml or .json file" in capsys.readouterr().err


def _doctor_text_and_json(capsys):
    assert cli.main(["doctor"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich folds long lines at the console width
    assert cli.main(["doctor", "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)["devices"][0]


def test_doctor_says_what_its_cpu_advice_rests_on_and_where_speed_is_measured(capsys):
    """bf16-mixed measured 0.81x of fp32 on an AVX512-BF16 CPU where doctor said "BF16MixedPrecision": the advice
    names its ground (the instruction sets) and the command that measures speed, in both outputs."""
    from lightning_precision.cli.machine import cpu_info

    text, cpu = _doctor_text_and_json(capsys)
    ground = "native bf16 instructions" if cpu_info()["native_bf16"] else "no native bf16 or fp16 instructions"
    for said in (text, cpu["basis"]):
        assert ground in said and "not a measured speed" in said and "`lightning-precision compare` measures" in said
    assert cpu["basis"] in text  # the table and --json say the same (a table cell folds: the line under it is whole)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_doctor_advice_on_either_kind_of_cpu(native_bf16, capsys, monkeypatch):
    """Both kinds of CPU, whichever this one is: only the CPU's flags are stood in for (a CPU of the other kind cannot
    be had here); the command runs for real."""
    from lightning_precision.cli import doctor
    from lightning_precision.cli import machine as lp_machine

    def flags(real=lp_machine.cpu_info):
        isa = [name for name in real()["isa"] if "BF16" not in name] + (["AVX512-BF16"] if native_bf16 else [])
        return {**real(), "isa": isa, "native_bf16": native_bf16}

    monkeypatch.setattr(doctor, "cpu_info", flags)
    text, cpu = _doctor_text_and_json(capsys)
    if native_bf16:
        assert cpu["recommended"] == "BF16MixedPrecision if `compare` finds it faster, else 32-true"
        assert cpu["basis"].startswith("native bf16 instructions (AVX512-BF16), not a measured speed")
    else:
        assert cpu["recommended"].startswith("32-true for speed")
        assert cpu["basis"].startswith("no native bf16 or fp16 instructions")
    assert f"cpu: the recommendation rests on {cpu['basis']}." in text


def _command(*args, cwd):
    """The real command in a fresh process: (exit code, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "lightning_precision.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_fit_finds_the_shipped_configs_by_name(tmp_path, monkeypatch):
    """`--config vit --config precision-16-mixed` from a folder without recipes/: the names find
    the configs shipped with the package, combined in order; a file keeps working beside a name."""
    import lightning as L

    seen = []
    fit = L.Trainer.fit

    def record(trainer, *args, **kwargs):
        seen.append((type(trainer.precision_plugin).__name__, type(args[0]).__name__))
        return fit(trainer, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "fit", record)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["fit", "--config", "vit", "--config=precision-16-mixed.yaml", *FEW_STEPS]) == 0
    assert cli.main(["fit", "-c", "distilbert", "--config", str(ROOT / "recipes" / "precision-32-true.yaml"),
                     *FEW_STEPS]) == 0
    assert seen[0] == ("FP16MixedPrecision", "ViTClassifier")
    assert seen[1][1] == "DistilBertClassifier" and seen[1][0] != "BF16MixedPrecision"  # precision-32-true: no plugin


@pytest.mark.parametrize("recipe", ["distilbert", "vit"])
def test_the_bf16_true_config_trains_distilbert_and_vit_in_bf16(recipe, tmp_path, monkeypatch):
    """`--config <recipe> --config precision-bf16-true`: the recipe's plugin replaced by BF16TruePrecision (its
    defaults), the weights trained in bf16."""
    import lightning as L
    import torch

    seen = {}
    fit = L.Trainer.fit

    def record(trainer, model, *args, **kwargs):
        fit(trainer, model, *args, **kwargs)
        seen.update(plugin=trainer.precision_plugin, dtypes={p.dtype for p in model.parameters()},
                    loss=trainer.callback_metrics["train_loss"])

    monkeypatch.setattr(L.Trainer, "fit", record)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["fit", "--config", recipe, "--config", "precision-bf16-true", *FEW_STEPS]) == 0
    assert type(seen["plugin"]).__name__ == "BF16TruePrecision" and seen["plugin"].update == "stochastic"
    assert seen["dtypes"] == {torch.bfloat16} and torch.isfinite(seen["loss"])


def test_the_shipped_configs_are_the_checkouts_recipes():
    assert cli.recipe_configs() == {p.stem: p for p in sorted((ROOT / "recipes").glob("*.yaml"))}


@pytest.mark.parametrize(("args", "says"), [
    ([], ["fit trains a model on its data, both named by a config",
          "`lightning-precision fit --config distilbert --precision bf16-mixed`", "recipes distilbert, resnet50, vit",
          "--model and --data"]),
    (["--config", "precision-bf16-mixed"],
     ["required: model", "combine it with a recipe config, e.g. `--config distilbert --config precision-bf16-mixed`"]),
    (["--config", "nope"], ["--config nope: no such file", "distilbert, resnet50, vit", "precision-bf16-mixed"]),
    (["--config", "recipes/vit.yaml"], ["--config recipes/vit.yaml: no such file", "is `--config vit`"]),
    (["--config", "vit", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["--config", "vit", "--trainer.max_steps", "abc"], ['"trainer.max_steps"', "Got value: abc"]),
    (["--config", "distilbert", "--model.init_args.size", "huge"], ["Problem with given class_path", "huge"]),
])
def test_fit_errors_are_one_line_with_no_usage_above(args, says, tmp_path):
    """An error of `fit`'s command line was the last of ~50 lines of usage: now it is the only line,
    says the fix where there is one (a precision config alone names no model), points to --help, exits 2."""
    code, out, err = _command("fit", *args, cwd=tmp_path)
    assert code == 2 and not out, (code, out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("lightning-precision fit: error: ") and "usage:" not in err
    assert err.strip().endswith("`lightning-precision fit --help` lists the options")
    for text in says:
        assert text in err, err


def test_every_config_the_docs_name_exists():
    """`--config X` in the commands of the README, the docs, the configs' comments and the CLI's help (code spans,
    code blocks, the rest of a line after `lightning-precision fit`) names a shipped config or a file of the checkout."""
    import re

    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "recipes").glob("*.yaml")),
             ROOT / "lightning_precision" / "cli" / "__init__.py"]
    named = set()
    for path in texts:
        text = path.read_text()
        code = re.findall(r"```.*?```", text, re.S) + re.findall(r"`[^`\n]+`", text)
        code += re.findall(r"lightning-precision fit.*", text)
        named |= {(path.name, m) for part in code for m in re.findall(r"--config[ =]([\w./<>-]+)", part)}
    assert len(named) > 10
    for where, config in named:
        if "<" in config or config.removesuffix(".yaml").isupper() or config == "my.yaml":
            continue  # a placeholder
        assert config.removesuffix(".yaml") in cli.recipe_configs() or (ROOT / config).is_file(), (where, config)
