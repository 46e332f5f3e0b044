"""Plan files: what ``PrecisionPlan`` accepts, what ``save`` writes and how,
what the ``plan`` command does with a place it cannot write, and which plan a resumed fit runs.

Real files, real subprocesses (two writers racing on one path; a file-size limit that makes the write fail as a full
disk does), real Trainer fits with checkpoints, real torchao (``emulate=True``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import FP8Precision, PlanRule, PrecisionPlan
from lightning_precision import fabric as lp_fabric
from lightning_precision.fp8._plan_types import FP8, LayerPlan

HIGH = "bf16"  # the label of a layer kept in high precision by a bf16 plugin

pytest.importorskip("torchao")

ROOT = Path(__file__).resolve().parents[2]
NUMBERS = {"input_sqnr_db": 31.5, "weight_sqnr_db": 32.0, "grad_output_sqnr_db": 25.5, "input_underflow": 1e-5,
           "weight_underflow": 0.0, "grad_output_underflow": 2e-4, "input_overflow": 0.0, "weight_overflow": 0.0,
           "grad_output_overflow": 0.0, "output_error": 0.04, "grad_input_error": 0.05}


def plan_of(fp8: set[str], names=("a", "b", "c", "d", "head"), prefix: str = "", recipe: str = "tensorwise",
            batches: int = 4) -> PrecisionPlan:
    """A measured-looking plan of tests/fp8/test_plan.py's model (``prefix="net."`` for its LightningModule)."""
    return PrecisionPlan(tuple(LayerPlan(prefix + n, FP8 if n in fp8 else HIGH, "by hand", dict(NUMBERS))
                               for n in names), recipe, PlanRule(), batches)


# ---- a layer listed twice; a plan measured with another cast ---------------------------------------------------


def test_a_plan_that_lists_a_layer_twice_is_refused_naming_it(tmp_path):
    twice = (LayerPlan("a", FP8, ""), LayerPlan("b", HIGH, ""), LayerPlan("a", HIGH, ""))
    with pytest.raises(ValueError, match=r"layer 'a' is listed twice \(layers\[0\] and layers\[2\]\); keep one"):
        PrecisionPlan(twice)
    path = tmp_path / "twice.yaml"
    path.write_text("version: 1\nlayers:\n- {fqn: a, precision: fp8}\n- {fqn: b, precision: bf16}\n"
                    "- {fqn: a, precision: bf16}\n")
    with pytest.raises(ValueError, match=rf"plan file '{path}': layer 'a' is listed twice"):
        PrecisionPlan.load(path)
    with pytest.raises(ValueError, match="listed twice"):
        FP8Precision(layers=str(path), emulate=True)


def _our_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "measured with" in str(w.message)]


def test_a_plan_measured_with_another_cast_is_applied_with_a_warning_naming_both():
    """Warned, not refused: the plan is a valid choice of layers, and a Transformer Engine run under FSDP2 or a
    block-scaled recipe can only be given a plan measured elsewhere."""
    rowwise = plan_of({"a", "d", "head"}, recipe="rowwise")
    with pytest.warns(UserWarning, match=r"measured with the 'rowwise' cast and this plugin casts with 'tensorwise'.*"
                                         r"measure again with its recipe \(`make_plan\(\.\.\., recipe='tensorwise'\)`"):
        plugin = lp_fabric.FP8Precision(layers=rowwise, emulate=True)
    model = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(_Net())
    assert type(model.module.a).__name__ == "Float8Linear"  # applied as written
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        FP8Precision(layers=plan_of({"a"}), emulate=True)  # the same cast
        by_hand = PrecisionPlan((LayerPlan("a", FP8, "by hand"),), scaling_family="rowwise")
        assert not by_hand.measured
        FP8Precision(layers=by_hand, emulate=True)  # nothing measured: no numbers of another cast
        # Transformer Engine's per-tensor recipes are measured through torchao's tensorwise cast
        FP8Precision(layers=plan_of({"a"}, recipe="delayed"), emulate=True)
    assert _our_warnings(record) == []


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d, self.head = (nn.Linear(64, 64) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.d(self.c(self.b(self.a(x)))))


# ---- save keeps links, and two writers never fail ------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_through_a_symlink_updates_the_target_and_keeps_the_link(tmp_path, suffix):
    real = tmp_path / "shared" / f"plan{suffix}"
    real.parent.mkdir()
    plan_of({"a"}).save(real)
    link = tmp_path / f"link{suffix}"
    link.symlink_to(os.path.relpath(real, tmp_path))
    assert plan_of({"a", "d"}).save(link) == link
    assert link.is_symlink() and PrecisionPlan.load(real).fp8_layers == {"a", "d"}
    assert sorted(p.name for p in real.parent.iterdir()) == [real.name]  # no temporary file left beside it


_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from lightning_precision.fp8._plan import PrecisionPlan
    from lightning_precision.fp8._plan_types import FP8, LayerPlan
    HIGH = "bf16"

    path, me, go, n = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    names = [f"block.{i}.linear" for i in range(50)]  # a plan of some size, so writes take time
    mine = PrecisionPlan(tuple(LayerPlan(f, FP8 if (i + me) % 2 else HIGH, f"writer {me}") for i, f in enumerate(names)),
                         batches=me + 1)
    Path(f"{path}.ready{me}").touch()
    while not go.exists():
        time.sleep(0.01)
    for _ in range(n):
        mine.save(path)
        seen = PrecisionPlan.load(path)  # whichever writer's, always one whole plan
        assert seen.batches in (1, 2) and len(seen.layers) == 50, seen
        assert {p.reason for p in seen.layers} == {f"writer {seen.batches - 1}"}, "a plan mixing two writers"
""")


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_two_processes_saving_one_path_never_fail_and_it_always_loads_whole(tmp_path, suffix):
    path, go = tmp_path / f"plan{suffix}", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(me), str(go), "100"], env=env,
                                stderr=subprocess.PIPE, text=True) for me in (0, 1)]
    try:
        for me in (0, 1):  # both loaded and waiting, so that their saves overlap
            for _ in range(1200):
                if Path(f"{path}.ready{me}").exists() or writers[me].poll() is not None:
                    break
                time.sleep(0.1)
        go.touch()
        errors = [w.communicate(timeout=240)[1] for w in writers]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.wait()
    assert [w.returncode for w in writers] == [0, 0], errors
    assert PrecisionPlan.load(path).batches in (1, 2)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(f"{path.name}.ready")) == \
        ["go", path.name]  # every temporary file renamed or removed


# ---- `lightning-precision plan --out` --------------------------------------------------------------------------


def test_plan_refuses_an_out_it_cannot_write_before_measuring(tmp_path, capsys, monkeypatch):
    import lightning_precision.cli as cli
    from lightning_precision.cli import plan  # where the command looks make_plan up

    monkeypatch.setattr(plan, "make_plan", lambda *a, **k: pytest.fail("measured before checking --out"))
    (tmp_path / "file.txt").write_text("a file, not a folder")
    (tmp_path / "folder.yaml").mkdir()
    for out, why in [(tmp_path / "file.txt" / "plan.yaml", "exists and is not a folder"),
                     (tmp_path / "file.txt" / "sub" / "plan.yaml", "cannot write into"),
                     (tmp_path / "folder.yaml", "is a folder"), ("", "empty path names no file"),
                     (tmp_path / "plan.txt", "name a .yaml, .yml or .json file")]:
        assert cli.main(["plan", "--recipe", "vit", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [err] and err.startswith("lightning-precision plan: error: ") and why in err, err


@pytest.mark.slow  # the plan command's process and output
def test_plan_prints_the_measured_plan_when_writing_it_fails(tmp_path):
    """The write fails for real after measuring: the command runs with a file-size limit (RLIMIT_FSIZE) below the
    plan's size, so the plan's write fails with EFBIG as a full disk fails with ENOSPC. The measurement is printed
    whole (loadable) and the exit code says it was not written."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))

    out = tmp_path / "plan.yaml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "lightning_precision.cli", "plan", "--recipe", "vit", "--emulate",
                           "--batches", "1", "--out", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit)
    assert done.returncode == 1, done.stderr
    assert f"could not write the plan to {str(out)!r} (File too large)" in done.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing half-written left behind
    printed = done.stdout[done.stdout.index("version: 1"):]
    (tmp_path / "recovered.yaml").write_text(printed)
    recovered = PrecisionPlan.load(tmp_path / "recovered.yaml")
    assert recovered.batches == 1 and recovered.fp8_layers


# ---- every bad plan file names the file, the field, the value and the fix ------------------------------------

_GOOD_LAYER = "- {fqn: a, precision: fp8}\n"
BAD_FILES = {
    # name: (suffix, text, fragments of the message after the file's name)
    "yaml syntax": (".yaml", "version: 1\nlayers: [\n", ["not a plan YAML can read", "line 3", "fix it"]),
    "json syntax": (".json", '{"version": 1,\n "layers": [}', ["not valid JSON", "line 2, column 13", "fix it"]),
    "yaml tag": (".yaml", "!!python/object/apply:os.system ['echo hacked']\n", ["could not determine a constructor",
                                                                                "no tags"]),
    "empty file": (".yaml", "", ["not nothing (it is empty)", "PrecisionPlan.save"]),
    "a list": (".yaml", "- a\n- b\n", ["not a list", "`version` and `layers`"]),
    "unknown field": (".yaml", "version: 1\nlayer: []\n", ["unknown field 'layer'", "version, scaling_family, recipe, batches"]),
    "no version": (".yaml", "layers: []\n", ["`version` is missing", "add `version: 1`"]),
    "version bool": (".yaml", "version: true\nlayers: []\n", ["version True (a boolean) is not 1", "`version: 1`"]),
    "version float": (".yaml", "version: 1.0\nlayers: []\n", ["version 1.0 (a number) is not 1"]),
    "version string": (".json", '{"version": "1", "layers": []}', ["version '1' (a string) is not 1"]),
    "version 2": (".yaml", "version: 2\nlayers: []\nnew_field: 1\n", ["version 2 (an integer) is not 1", "the lightning-precision"
                                                                                         " that wrote it"]),
    "batches negative": (".yaml", "version: 1\nbatches: -1\nlayers: []\n", ["`batches`: -1 (an integer)", ">= 0"]),
    "batches bool": (".yaml", "version: 1\nbatches: yes\nlayers: []\n", ["`batches`: True (a boolean)"]),
    "batches float": (".yaml", "version: 1\nbatches: 2.5\nlayers: []\n", ["`batches`: 2.5 (a number)"]),
    "batches string": (".json", '{"version": 1, "batches": "8", "layers": []}', ["`batches`: '8' (a string)"]),
    "recipe": (".yaml", "version: 1\nrecipe: tensorwse\nlayers: []\n", ["`recipe`: 'tensorwse'", "tensorwise, rowwise"]),
    "rule not a mapping": (".yaml", "version: 1\nrule: strict\nlayers: []\n", ["`rule` is 'strict'", "defaults"]),
    "rule unknown key": (".yaml", "version: 1\nrule: {max_underflw: 0.1}\nlayers: []\n",
                         ["`rule` has an unknown field 'max_underflw'", "min_sqnr_db, max_underflow"]),
    "rule negative": (".yaml", "version: 1\nrule: {max_underflow: -1}\nlayers: []\n",
                      ["`rule.max_underflow`: -1 (an integer) is not a number >= 0", "the default is 0.001"]),
    "rule nan": (".yaml", "version: 1\nrule: {min_sqnr_db: .nan}\nlayers: []\n", ["`rule.min_sqnr_db`: nan"]),
    "rule text": (".yaml", "version: 1\nrule: {min_sqnr_db: high}\nlayers: []\n", ["`rule.min_sqnr_db`: 'high'"]),
    "rule bool": (".yaml", "version: 1\nrule: {max_overflow: no}\nlayers: []\n", ["`rule.max_overflow`: False"]),
    "no layers": (".yaml", "version: 1\n", ["`layers` is missing"]),
    "layers a mapping": (".yaml", "version: 1\nlayers: {a: fp8}\n", ["`layers` is {'a': 'fp8'} (a mapping)"]),
    "layer not a mapping": (".yaml", "version: 1\nlayers: [a]\n", ["`layers[0]` is 'a' (a string)"]),
    "fqn an integer": (".yaml", "version: 1\nlayers:\n- {fqn: 2, precision: fp8}\n",
                       ["`layers[0].fqn`: 2 (an integer) is not a layer's path", "quote it"]),
    "fqn empty": (".yaml", "version: 1\nlayers:\n- {fqn: '', precision: fp8}\n", ["`layers[0].fqn`: '' (a string)"]),
    "no fqn": (".yaml", "version: 1\nlayers:\n- {precision: fp8}\n", ["`layers[0]` has no `fqn`"]),
    "no precision": (".yaml", "version: 1\nlayers:\n- fqn: a\n", ["each layer needs `fqn` and `precision`"]),
    "precision": (".yaml", "version: 1\nlayers:\n" + _GOOD_LAYER + "- {fqn: b, precision: fp4}\n",
                  ["`layers[1].precision`: 'fp4' is not 'fp8' (the plugin's recipe), a format ('tensorwise'",
                   "or a high precision ('high', 'bf16', 'fp16', 'fp32'"]),
    "layer unknown key": (".yaml", "version: 1\nlayers:\n- {fqn: a, precision: fp8, precison: bf16}\n",
                          ["`layers[0]` has an unknown field 'precison'", "fqn, precision, reason, numbers, predicted_saving, alternatives"]),
    "reason a boolean": (".yaml", "version: 1\nlayers:\n- {fqn: a, precision: bf16, reason: no}\n",
                         ["`layers[0].reason`: False (a boolean) is not text", "quote it"]),
    "numbers a list": (".yaml", "version: 1\nlayers:\n- {fqn: a, precision: fp8, numbers: [1, 2]}\n",
                       ["`layers[0].numbers`: [1, 2] (a list) is not a mapping of names to numbers"]),
    "numbers text": (".yaml", "version: 1\nlayers:\n- {fqn: a, precision: fp8, numbers: {output_error: high}}\n",
                     ["`layers[0].numbers.output_error`: 'high' (a string) is not a number"]),
    "numbers bool": (".json", '{"version": 1, "layers": [{"fqn": "a", "precision": "fp8", "numbers": {"x": true}}]}',
                     ["`layers[0].numbers.x`: True (a boolean) is not a number"]),
    "numbers key": (".yaml", "version: 1\nlayers:\n- {fqn: a, precision: fp8, numbers: {1: 0.5}}\n",
                    ["the name 1 (an integer) is not a string"]),
    "repeated yaml key": (".yaml", "version: 1\nlayers: []\nlayers:\n" + _GOOD_LAYER,
                          ["the key 'layers' appears twice in one mapping (line 3)"]),
    "repeated json key": (".json", '{"version": 1, "layers": [{"fqn": "a", "fqn": "b", "precision": "fp8"}]}',
                          ["the key 'fqn' appears twice"]),
    "layer twice": (".json", '{"version": 1, "layers": [{"fqn": "a", "precision": "fp8"}, {"fqn": "a", "precision":'
                             ' "bf16"}]}', ["layer 'a' is listed twice"]),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_plan_file_names_the_file_the_field_the_value_and_the_fix(tmp_path, case):
    suffix, text, fragments = BAD_FILES[case]
    path = tmp_path / f"my-plan{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        PrecisionPlan.load(path)
    message = str(info.value)
    assert message.startswith(f"plan file {str(path)!r}: "), message
    for fragment in fragments:
        assert fragment in message, message
    assert type(info.value) is ValueError and info.value.__cause__ is None


def test_a_binary_file_is_named_too(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=rf"plan file '{path}': not UTF-8 text"):
        PrecisionPlan.load(path)


def test_what_a_person_writes_by_hand_is_read():
    """YAML reads ``1e-3`` (no dot) as a string, and ``save`` writes infinities as strings: both are numbers here."""
    text = "version: 1\nrule: {max_underflow: 1e-3, max_output_error: inf}\nlayers:\n- fqn: a\n  precision: fp8\n" \
           "  reason:\n  numbers: {output_error: 1e-2, x: -inf}\n"
    import yaml

    plan = PrecisionPlan.from_dict(yaml.safe_load(text))
    assert plan.rule == PlanRule(max_underflow=1e-3, max_output_error=math.inf)
    assert plan.get("a") == LayerPlan("a", FP8, "", {"output_error": 0.01, "x": -math.inf})


@pytest.mark.parametrize("case", ["fqn", "numbers", "batches", "recipe", "rule", "layers"])
def test_a_plan_that_could_not_be_loaded_cannot_be_built(case):
    """The checks of ``load`` are the constructors' own: ``save`` never writes what ``load`` refuses."""
    build = {
        "fqn": lambda: LayerPlan(2, FP8, ""),
        "numbers": lambda: LayerPlan("a", FP8, "", {"x": "high"}),
        "batches": lambda: PrecisionPlan((), batches=-1),
        "recipe": lambda: PrecisionPlan((), scaling_family="tensorwse"),
        "rule": lambda: PrecisionPlan((), rule=None),
        "layers": lambda: PrecisionPlan(({"fqn": "a", "precision": "fp8"},)),
    }[case]
    with pytest.raises(ValueError, match=r"PrecisionPlan|LayerPlan"):
        build()


AWKWARD = ["0", "1e3", "0x1F", "010", "yes", "no", "on", "null", "~", "true", "-", "- a", "a: b", "a #b", "#a", "[a]",
           "{a}", "'q'", '"q"', "!tag", "&anchor", "*alias", "%x", "@x", "`x", "|", ">", "  lead", "trail ", "a  b",
           "tab\there", "line\nbreak", "é", "中文", "\u2028", "x" * 300, "a.b.0.c", ".inf", ".nan", "2001-12-14"]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_what_save_writes_load_reads_back_as_the_same_plan(tmp_path, suffix):
    """Layer paths and reasons YAML would otherwise retype (numbers, booleans, null, dates, ...), long or multi-line
    text, infinite and NaN numbers, a rule with an infinite bound: each comes back as it was saved."""
    layers = tuple(LayerPlan(f"m.{i}.{s}" if i % 2 else s, FP8 if i % 3 else HIGH, s,
                             {"output_error": [math.inf, -math.inf, 0.0, 1e-300, 5e-324][i % 5], s: float(i)})
                   for i, s in enumerate(AWKWARD))
    plan = PrecisionPlan(layers, "rowwise", PlanRule(max_underflow=math.inf, min_sqnr_db=0), 7)
    with_nan = plan.with_layer("0", HIGH, "nan", {"output_error": math.nan})
    for original in (plan, with_nan):
        loaded = PrecisionPlan.load(original.save(tmp_path / f"plan{suffix}"))
        assert loaded.to_dict() == original.to_dict()
    assert loaded.get("0").numbers["output_error"] != loaded.get("0").numbers["output_error"]  # nan
    assert PrecisionPlan.load(plan.save(tmp_path / f"plan{suffix}")) == plan
    if suffix == ".json":  # strict JSON: no bare NaN or Infinity
        import json

        json.loads((tmp_path / "plan.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    print(plan.table())  # a table of partial numbers prints ("-" where a number is missing)


def test_a_bad_plan_in_a_checkpoint_says_checkpoint():
    plugin = FP8Precision(emulate=True)
    with pytest.raises(ValueError, match=r"^the checkpoint's plan \(FP8Precision state\): `layers\[0\]\.fqn`: 2 "):
        plugin.load_state_dict({"plan": {"version": 1, "layers": [{"fqn": 2, "precision": "fp8"}]}})
    with pytest.raises(ValueError, match=r"^PrecisionPlan.from_dict: version 7"):
        PrecisionPlan.from_dict({"version": 7, "layers": []})


# ---- resuming with another plan ----------------------------------------------------------------------------


def test_resuming_with_another_plan_file_warns_and_a_layer_stays_fp8_only_where_both_say_so(tmp_path):
    """A real fit with plan A (``a``, ``d``, ``head`` in fp8), a checkpoint, and a resume with plan B (``b``, ``d``,
    ``head``): the warning names ``a`` and ``b``; both run in bf16 (``a`` as B asks, ``b`` as the run trained)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.fp8.test_plan import Lit, fit, loader

    first_plan, second_plan = tmp_path / "a.yaml", tmp_path / "b.yaml"
    plan_of({"a", "d", "head"}, prefix="net.").save(first_plan)
    plan_of({"b", "d", "head"}, prefix="net.").save(second_plan)
    first = FP8Precision(layers=str(first_plan), emulate=True)
    fit(first, 3, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="last")])
    resumed, module = FP8Precision(layers=str(second_plan), emulate=True), Lit()
    trainer = L.Trainer(accelerator="cpu", plugins=[resumed], max_steps=5, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match=rf"differs from `layers='{second_plan}'` for 2 layer\(s\): net.a: bf16 \(by"
                                         r" hand\) given, fp8 in the checkpoint; net.b: fp8 given, bf16 \(by hand\) in"
                                         r" the checkpoint\. On resume a layer stays in fp8 only where both plans say"
                                         r" so \(else it runs in torch.bfloat16\)"):
        trainer.fit(module, loader(5), ckpt_path=str(tmp_path / "last.ckpt"))
    fp8 = {n for n in ("a", "b", "c", "d", "head") if type(getattr(module.net, n)).__name__ == "Float8Linear"}
    assert fp8 == {"d", "head"} and resumed.plan.fp8_layers == {"net.d", "net.head"}
    assert len(module.losses) == 2 and all(math.isfinite(v) for v in module.losses)

    # The same plan again: nothing differs, nothing said.
    again = FP8Precision(layers=str(first_plan), emulate=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        L.Trainer(accelerator="cpu", plugins=[again], max_steps=4, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False
                  ).fit(Lit(), loader(4), ckpt_path=str(tmp_path / "last.ckpt"))
    assert not [w for w in record if "checkpoint's plan" in str(w.message)]
    assert again.plan.fp8_layers == {"net.a", "net.d", "net.head"}


def test_a_checkpoint_loaded_before_conversion_merges_the_same_way():
    """Fabric may load the plugin's state before ``setup``: the plan applied is the same merge, said the same way."""
    saved = plan_of({"a", "d", "head"}).with_layer("d", HIGH, "FP8Guard, step 9: output error 0.3 > 0.1")
    plugin = lp_fabric.FP8Precision(layers=plan_of({"b", "d", "head"}), emulate=True)
    with pytest.warns(UserWarning, match=r"for 3 layer\(s\): a: .*; b: .*; d: fp8 given, bf16 \(FP8Guard, step 9"):
        plugin.load_state_dict({"plan": saved.to_dict()})
    model = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(_Net())
    fp8 = {n for n in ("a", "b", "c", "d", "head") if type(getattr(model.module, n)).__name__ == "Float8Linear"}
    assert fp8 == {"head"} and plugin.plan.get("d").reason.startswith("FP8Guard, step 9")


def test_the_plan_file_in_the_docs_loads(tmp_path):
    text = (ROOT / "docs" / "plan.md").read_text()
    block = text[text.index("```yaml\n") + len("```yaml\n"):]
    (tmp_path / "plan.yaml").write_text(block[:block.index("```")])
    plan = PrecisionPlan.load(tmp_path / "plan.yaml")
    assert plan.fp8_layers == {"encoder.0.linear"} and plan.rule == PlanRule() and plan.batches == 8


# ---- `plan` refuses what it cannot measure, never replaces a measured plan, and survives `| head` ---


def _plan_command(*args: str, cwd: Path, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "lightning_precision.cli", "plan", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.slow  # the plan command's process and output
def test_plan_without_emulate_on_the_embedded_default_refuses_before_measuring_and_keeps_the_earlier_plan(tmp_path):
    """Every linear layer of the embedded ViT is under the fp8-GPU size thresholds: without --emulate nothing is left to
    measure. The command says so in one line with the fix (--emulate), exit 2, before measuring; the emulated plan
    written earlier stays as it was (it used to be replaced by a plan of 0 fp8 layers)."""
    earlier = plan_of({"a", "b"})
    earlier.save(tmp_path / "plan-vit.yaml")
    before = (tmp_path / "plan-vit.yaml").read_bytes()
    done = _plan_command("--recipe", "vit", "--batches", "2", cwd=tmp_path)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 2, err
    assert out == ""  # not "measuring 2 batches"
    line = err.strip()
    assert line.splitlines() == [line] and line.startswith("lightning-precision plan: error: --recipe vit: none of the")
    assert "too small to gain" in line and "Pass --emulate" in line
    assert (tmp_path / "plan-vit.yaml").read_bytes() == before


@pytest.mark.slow  # the plan command's process and output
def test_plan_piped_into_head_exits_quietly_and_still_writes_the_plan(tmp_path):
    """`plan ... | head -1`: the reader closes the pipe after the first line, while the command measures; the table
    printed next used to raise BrokenPipeError (a traceback, exit 1, no plan file). Now the rest of the output goes
    nowhere, the plan is written, exit 0, nothing on stderr."""
    done = _plan_command("--recipe", "vit", "--emulate", "--batches", "1", cwd=tmp_path)
    first = done.stdout.readline()
    done.stdout.close()  # as `head -1` does
    err = done.stderr.read()
    assert done.wait(timeout=300) == 0, err
    assert first.startswith("measuring 1 batches")
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert PrecisionPlan.load(tmp_path / "plan-vit.yaml").fp8_layers


def test_a_plan_that_measured_nothing_is_not_written_over_an_existing_one(tmp_path, monkeypatch, capsys):
    """Every batch's loss is NaN (a fault injected in the recipe's own loss): every batch is dropped, nothing is
    measured, and that plan (0 fp8 layers, resting on no number) must not replace the measured plan already there. It
    is printed instead, exit 1; with no file there it is written (it replaces nothing)."""
    import lightning_precision.cli as cli
    from lightning_precision.cli.recipes.vision import ViTClassifier

    real = ViTClassifier.training_loss
    monkeypatch.setattr(ViTClassifier, "training_loss", lambda self, batch: real(self, batch) * math.nan)
    earlier = tmp_path / "plan.yaml"
    plan_of({"a", "b"}).save(earlier)
    before = earlier.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp8_sensitivity's warning about the dropped batches
        assert cli.main(["plan", "--recipe", "vit", "--emulate", "--batches", "1", "--out", str(earlier)]) == 1
    captured = capsys.readouterr()
    assert "nothing was measured" in captured.err and "not written over the existing" in captured.err
    assert earlier.read_bytes() == before
    assert "batches: 0" in captured.out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["plan", "--recipe", "vit", "--emulate", "--batches", "1", "--out",
                         str(tmp_path / "new.yaml")]) == 0
    assert not PrecisionPlan.load(tmp_path / "new.yaml").measured
