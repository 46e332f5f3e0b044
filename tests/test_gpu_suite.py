"""``benchmarks/gpu_suite.py`` on the CPU (``--smoke``): every row runs through a real Trainer fit, the derived
figures are computed from the measured ones, and a failing row leaves the rest and the outputs standing."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import rowwise_emulates_on_cpu

pytestmark = pytest.mark.slow  # a benchmark script's smoke run (24 fits), not the library: CI runs it on one torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(BENCHMARKS))  # the suite imports `_common` from beside it, as when run as a script
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


suite = _load("gpu_suite")
common = _load("_common")

INJECTED = ("vit", "fp8-rowwise compiled")


ROWWISE_OK = rowwise_emulates_on_cpu()  # else the suite records those rows as failed, as it should


def _expected_ok(key: tuple[str, str]) -> bool:
    return key != INJECTED and (ROWWISE_OK or "rowwise" not in key[1])


def _oom_for_one_row(make_plugin):
    """``make_plugin`` that fails the way an out-of-memory fit does, for the row ``INJECTED`` only."""

    def make(spec, settings):
        if (spec.section, spec.name) == INJECTED:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nsecond line of the message")
        return make_plugin(spec, settings)

    return make


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu_suite")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(suite, "make_plugin", _oom_for_one_row(suite.make_plugin))
        code = suite.main(["--smoke", "--out", str(out)])
    result = json.loads((out / suite.JSON_NAME).read_text())
    return {"code": code, "json": result, "rows": {(r["section"], r["name"]): r for r in result["rows"]},
            "md": (out / suite.MD_NAME).read_text()}


def test_every_planned_row_ran_with_a_finite_positive_step_time(smoke):
    planned = {(s.section, s.name) for s in suite.plan(suite.SECTIONS, rounds=1)}
    assert set(smoke["rows"]) == planned
    assert len(planned) == 6 + 8 + 6 + 4  # resnet50, encoder, vit, monitors
    for key, row in smoke["rows"].items():
        if not _expected_ok(key):
            assert row["status"] == "failed" and row["reason"]
            continue
        assert row["status"] == "ok", (key, row["reason"])
        assert math.isfinite(row["ms_per_step"]) and row["ms_per_step"] > 0, key
        assert row["steps_timed"] == 2  # smoke: 2 timed steps, and monitors 1 period of 2


def test_speedups_are_against_each_rows_baseline(smoke):
    rows = smoke["rows"]
    checks = {("resnet50", "bf16-mixed channels-last"): "32-true", ("encoder", "fp8-tensorwise compiled"): "32-true",
              ("vit", "fp8-tensorwise compiled"): "bf16-mixed compiled", ("vit", "fp8-tensorwise"): "bf16-mixed",
              ("vit", "bf16-mixed compiled"): "bf16-mixed"}
    for (section, name), baseline in checks.items():
        row, base = rows[section, name], rows[section, baseline]
        assert row["baseline"] == baseline
        assert row["speedup"] == pytest.approx(base["ms_per_step"] / row["ms_per_step"], rel=1e-9)
    monitor = rows["monitors", "encoder bf16-mixed + AmaxHistoryLogger"]
    without = rows["monitors", "encoder bf16-mixed"]
    assert monitor["ms_stat"] == "mean"  # amortised over whole periods, measuring steps included
    assert monitor["ratio"] == pytest.approx(monitor["ms_per_step"] / without["ms_per_step"], rel=1e-9)


def test_mfu_is_null_with_a_reason_on_cpu_but_flops_are_counted(smoke):
    for row in smoke["json"]["rows"]:
        if row["status"] != "ok":
            continue
        assert row["mfu"] is None and "n/a on a CPU" in row["mfu_note"]
        assert row["flops_per_step"] > 0
        assert row["peak_memory_mib"] is None and row["memory_note"] == "n/a on cpu"


def test_fp8_rows_ran_emulated_with_converted_layers(smoke):
    fp8 = [r for r in smoke["json"]["rows"] if r["precision"].startswith("fp8") and r["status"] == "ok"]
    assert len(fp8) == (7 if ROWWISE_OK else 4)  # encoder 4, vit 3 (one injected failure); rowwise where it emulates
    for row in fp8:
        assert row["fp8_emulated"] is True
        assert 0 < row["fp8_layers"] < row["linear_layers"]  # the heads (dims not divisible by 16) stay high precision
    assert all(r["fp8_layers"] is None for r in smoke["json"]["rows"] if not r["precision"].startswith("fp8"))


def test_a_failing_row_is_recorded_and_the_suite_goes_on(smoke):
    row = smoke["rows"][INJECTED]
    assert row["status"] == "failed" and row["ms_per_step"] is None and row["speedup"] is None
    assert row["reason"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"
    assert smoke["code"] == 0
    assert f"| {INJECTED[1]} | - | - |" in smoke["md"] and "failed: OutOfMemoryError" in smoke["md"]
    vit_goal = next(g for g in smoke["json"]["goals"] if g["goal"].startswith("ViT-L"))
    assert vit_goal["row"] == "fp8-tensorwise compiled"  # judged on the row that ran


def test_markdown_names_every_section_device_and_versions(smoke):
    md, env = smoke["md"], smoke["json"]["environment"]
    for section in suite.SECTIONS:
        assert f"\n### {section}: " in md
    assert md.startswith("Device: cpu;") and "### Goals" in md and "Smoke run" in md
    assert f"torch {torch.__version__}" in md and f"lightning {env['lightning']}" in md and "torchao " in md
    assert env["device"] == "cpu" and env["settings"]["compile_backend"] == "eager"
    assert len(smoke["json"]["goals"]) == len(suite.GOALS)


def test_every_row_failing_exits_non_zero_and_still_writes(tmp_path, monkeypatch):
    def broken(shapes):
        raise RuntimeError("no model today")

    monkeypatch.setitem(suite.MODELS, "vit", suite.dataclasses.replace(suite.MODELS["vit"], build=broken))
    assert suite.main(["--smoke", "--only", "vit", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / suite.JSON_NAME).read_text())["rows"]
    assert len(rows) == 6 and {r["reason"] for r in rows} == {"RuntimeError: no model today"}
    assert "### vit: " in (tmp_path / suite.MD_NAME).read_text()


@pytest.mark.parametrize("argv", [["--only", "nope"], ["--steps", "0"], ["--peak-tflops", "fast"]])
def test_bad_arguments_exit_with_status_2(argv, tmp_path):
    with pytest.raises(SystemExit) as exc:
        suite.main(["--smoke", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_full_suite_needs_cuda(tmp_path):
    with pytest.raises(SystemExit) as exc:
        suite.main(["--out", str(tmp_path)])
    assert exc.value.code == 2


def test_mfu_uses_the_counted_flops_and_the_chosen_peak():
    spec = suite.RunSpec("vit", "bf16-mixed", "vit", "bf16-mixed", "bf16-mixed")
    peak = suite.PeakChoice(100.0, "--peak-tflops", "bf16")
    fits = [suite.Fit([0.010, 0.030, 0.020], 1.0, 2**30, peak, None, 9)]
    settings = suite.settings_of(suite.parse_args(["--smoke", "--peak-tflops", "bf16=100"]))
    row = suite.measured_row(spec, fits, {"flops_per_step": 10**12}, settings)
    assert row.ms_per_step == pytest.approx(20.0)  # the median
    assert row.mfu == pytest.approx(1e12 / 0.020 / 100e12)
    assert row.peak_memory_mib == 1024


def test_resnets_keep_torchvisions_layout():
    """Parameter counts of torchvision's resnet18 and resnet50 (1000 classes): the same layers, shared stage code."""
    assert sum(p.numel() for p in common.resnet18(1000).parameters()) == 11_689_512
    assert sum(p.numel() for p in common.resnet50(1000).parameters()) == 25_557_032
    tiny = common.resnet50(10, base_width=8)
    assert sum(isinstance(m, common.Bottleneck) for m in tiny.modules()) == 16
    assert tiny(torch.randn(2, 3, 32, 32)).shape == (2, 10)
