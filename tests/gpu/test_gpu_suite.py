"""``benchmarks/gpu_suite.py`` on the CPU (``--smoke``): every row runs through a real Trainer fit, the derived
figures are computed from the measured ones, and a failing row leaves the rest and the outputs standing."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import torch

from tests.helpers import rowwise_emulates_on_cpu

pytestmark = pytest.mark.slow  # a benchmark script's smoke run (24 fits), not the library: CI runs it on one torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


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
            "md": (out / suite.MD_NAME).read_text(), "out": out}


def test_every_planned_row_ran_with_a_finite_positive_step_time(smoke):
    planned = {(s.section, s.name) for s in suite.plan(suite.SECTIONS, rounds=1)}
    assert set(smoke["rows"]) == planned
    assert len(planned) == 6 + 8 + 3 + 6 + 4 + 1  # resnet50, encoder, true, vit, monitors, compare
    for key, row in smoke["rows"].items():
        if key[0] == "compare":
            assert row["status"] == "ok" and row["wall_s"] > 0
            continue
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
        if row["status"] != "ok" or row["section"] == "compare":
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


def test_the_true_rows_hold_half_the_bytes_against_lightnings_bf16_true(smoke):
    rows = smoke["rows"]
    lightning = rows["true", suite.LIGHTNING_TRUE]
    assert lightning["ratio"] == 1.0 and lightning["precision"] == suite.LIGHTNING_TRUE
    for name in suite.TRUE:
        row = rows["true", name]
        assert row["baseline"] == suite.LIGHTNING_TRUE
        assert row["ratio"] == pytest.approx(row["ms_per_step"] / lightning["ms_per_step"], rel=1e-9)
        # AdamW: 16-bit weight, gradient and two states, as Lightning's; the fp32 encoder holds twice that
        assert row["bytes_per_param"] == pytest.approx(lightning["bytes_per_param"], abs=0.01)
        assert lightning["bytes_per_param"] == pytest.approx(8.0, abs=0.01)  # and AdamW's step counts
    assert rows["encoder", "32-true"]["bytes_per_param"] == pytest.approx(16.0, abs=0.01)
    goal = next(g for g in smoke["json"]["goals"] if g["goal"].startswith("true:"))
    assert goal["row"] == "bf16-true" and goal["value"] == pytest.approx(rows["true", "bf16-true"]["ratio"])


def test_eager_rows_count_their_ops_and_compiled_ones_do_not(smoke):
    for (section, name), row in smoke["rows"].items():
        if row["status"] != "ok" or section == "compare":
            continue
        assert (row["ops_per_step"] is None) == row["compiled"], (section, name)
    rows = smoke["rows"]
    # the true step widens, updates and rounds every parameter: more ops than Lightning's bf16-true
    assert rows["true", "bf16-true"]["ops_per_step"] > rows["true", suite.LIGHTNING_TRUE]["ops_per_step"]


def test_compare_ran_in_its_own_processes_and_its_figures_are_in_the_outputs(smoke):
    compare = smoke["json"]["compare"]
    assert compare["exit_code"] == 0 and compare["command"].startswith("lightning-precision compare --accelerator cpu")
    assert [r["precision"] for r in compare["rows"]] == ["32-true", "bf16-mixed"]
    assert all(r["median_step_ms"] > 0 and r["ops_per_step"] > 0 for r in compare["rows"])
    assert compare["verdict"] and (smoke["out"] / suite.COMPARE_DIR / "report.json").exists()
    md = smoke["md"]
    assert "### compare: `lightning-precision compare --accelerator cpu" in md and f"Verdict: {compare['verdict']}" in md


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


class RowClock(suite.Budget):
    """A budget whose clock advances by each row's estimate (a smoke fit is estimated at 3 s and takes well under one
    here): which rows a budget admits, independent of this machine's speed."""

    def left(self) -> float:
        return self.seconds - self.estimated


def test_a_budget_runs_the_headline_rows_first_and_says_what_it_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "Budget", RowClock)
    assert suite.main(["--smoke", "--only", "encoder,true,compare", "--budget", "10", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / suite.JSON_NAME).read_text())
    statuses = [(r["section"], r["name"], r["status"]) for r in result["rows"]]
    order = [(s.section, s.name) for s in suite.plan(("encoder", "true", "compare"), rounds=1)]
    assert [(sec, name) for sec, name, _ in statuses] == order  # every planned row, in run order
    ran = [name for _, name, status in statuses if status == "ok"]
    assert ran == ["32-true", "16-mixed", "bf16-mixed"]  # 3 x 3 s of 10: tier 0, the encoder's eager headline rows
    for row in result["rows"][3:]:
        assert row["status"] == "skipped" and row["reason"].startswith("not run: the budget (10 s) would end during")
    assert result["environment"]["budget_s"] == 10
    assert "not run: the budget (10 s)" in (tmp_path / suite.MD_NAME).read_text()


def test_a_budget_on_the_real_clock_ends_the_suite_inside_it(tmp_path):
    assert suite.main(["--smoke", "--only", "encoder,true", "--budget", "5", "--out", str(tmp_path)]) == 0
    env = json.loads((tmp_path / suite.JSON_NAME).read_text())["environment"]
    assert env["elapsed_s"] < 5 + 3  # the last row admitted may overrun by what it took beyond its estimate


@pytest.mark.parametrize("make", ["a file", "under a file"])
def test_an_out_that_cannot_be_written_fails_before_any_fit(make, tmp_path, monkeypatch):
    (tmp_path / "taken").write_text("not a folder")
    out = tmp_path / "taken" if make == "a file" else tmp_path / "taken" / "out"
    monkeypatch.setattr(suite, "fit_once", lambda *a: pytest.fail("a fit ran before the results could be written"))
    assert suite.main(["--smoke", "--only", "encoder", "--out", str(out)]) == 2


def test_the_budget_scales_its_estimates_by_what_the_rows_took():
    budget = suite.Budget(10.0, start=suite.time.perf_counter() - 5)  # 5 s left
    assert budget.admits(4) and not budget.admits(6)
    budget.record(estimate=2, taken=4)  # the rows so far took twice their estimate
    assert budget.scale() == 2 and budget.admits(2) and not budget.admits(3)
    budget.record(estimate=10, taken=1)  # faster than estimated: never trusted below the estimates
    assert budget.scale() == 1
    assert suite.Budget(None).admits(10**9)


def test_the_files_hold_the_rows_reached_when_the_suite_stops_mid_way(tmp_path, monkeypatch):
    """Written whole after every row: a suite stopped (Ctrl-C) at its third fit leaves the first two, and says they are
    so far."""
    fits = []
    fit_once = suite.fit_once

    def stopping(spec, shapes, settings):
        if len(fits) == 2:
            raise KeyboardInterrupt
        fits.append(spec.name)
        return fit_once(spec, shapes, settings)

    monkeypatch.setattr(suite, "fit_once", stopping)
    assert suite.main(["--smoke", "--only", "encoder", "--out", str(tmp_path)]) == 130  # as Ctrl-C
    result = json.loads((tmp_path / suite.JSON_NAME).read_text())
    assert [r["name"] for r in result["rows"]] == fits == ["32-true", "16-mixed"]
    assert all(r["status"] == "ok" for r in result["rows"])
    assert "2 of 8 planned runs reached" in (tmp_path / suite.MD_NAME).read_text()
    assert not list(tmp_path.glob(".*.partial"))


@pytest.mark.parametrize("argv", [["--only", "nope"], ["--steps", "0"], ["--peak-tflops", "fast"], ["--budget", "0"],
                                  ["--budget", "soon"], ["--budget", "inf"]])
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


# ---- benchmarks/gpu_run.sh -------------------------------------------------------------------------------------------

GPU_RUN = BENCHMARKS / "gpu_run.sh"


def _gpu_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU_RUN), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_gpu_run_runs_the_cuda_tier_then_the_suite_in_its_budget_smoke(tmp_path, package_wheel):
    """The one GPU command, on this CPU (SMOKE=1): the carried wheels installed apart, the tier run on the CPU, then the
    suite with the budget left; every step's output in the results folder."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    shutil.copy2(package_wheel, wheels)
    out = tmp_path / "out"
    done = _gpu_run({"SMOKE": "1", "PYTHON": sys.executable, "GPU_WHEELS": str(wheels), "GPU_SITE": str(tmp_path / "site"), "OUT": str(out),
                     "SUITE_ARGS": "--only true", "TOTAL_SECONDS": "200"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} >= {"environment.txt", "cuda_tier.txt", "cuda_tier.xml", "gpu_suite.json",
                                                "gpu_suite.md", "gpu_suite.log"}
    tier = ElementTree.parse(out / "cuda_tier.xml").getroot().find("testsuite")
    assert int(tier.get("tests")) > 50 and tier.get("failures") == tier.get("errors") == "0"
    assert int(tier.get("tests")) - int(tier.get("skipped")) > 50  # the tier ran, on the CPU
    result = json.loads((out / suite.JSON_NAME).read_text())
    assert [r["status"] for r in result["rows"]] == ["ok"] * 3 and 60 <= result["environment"]["budget_s"] < 160
    assert "lightning_precision from" in (out / "environment.txt").read_text()
    assert "cuda tier exit 0, suite exit 0" in done.stdout


def test_gpu_run_without_wheels_or_with_a_bad_argument_says_what_to_do(tmp_path):
    done = _gpu_run({"GPU_WHEELS": str(tmp_path / "none"), "OUT": str(tmp_path / "out")})
    assert done.returncode == 1 and "run 'benchmarks/gpu_run.sh prepare'" in done.stderr
    done = _gpu_run({}, "bogus")
    assert done.returncode == 2 and "usage: benchmarks/gpu_run.sh [prepare]" in done.stderr


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile
                pass
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc (Linux)")
def test_sigterm_stops_the_suite_and_the_compare_it_started(tmp_path):
    """The suite under `timeout` gets SIGTERM: it stops compare and every process compare started, and its files hold
    the rows reached, whole."""
    out = tmp_path / "out"
    suite_process = subprocess.Popen([sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--smoke", "--only",
                                      "compare", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    compare_out = str(out / suite.COMPARE_DIR)
    try:
        deadline = time.monotonic() + 120
        while not _processes_naming(compare_out) and time.monotonic() < deadline:
            assert suite_process.poll() is None, suite_process.communicate()
            time.sleep(0.2)
        assert _processes_naming(compare_out), "compare never started"
        time.sleep(2)  # compare's own runs under way
        suite_process.send_signal(signal.SIGTERM)
        _, stderr = suite_process.communicate(timeout=suite.COMPARE_GRACE_S + 30)
    finally:
        if suite_process.poll() is None:
            suite_process.kill()
    assert suite_process.returncode == 143 and "stopped (SIGTERM)" in stderr, stderr
    deadline = time.monotonic() + 10
    while _processes_naming(compare_out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_naming(compare_out)
    result = json.loads((out / suite.JSON_NAME).read_text())
    assert result["rows"] == [] and result["environment"]["rows_done"] == 0


def test_a_compare_that_wrote_no_report_is_a_failed_row_not_the_last_runs(smoke, monkeypatch):
    """An earlier suite's compare report in the same folder is not this run's: a compare that exits 1 before writing
    (here a stand-in process that does only that: such a failure cannot be made on demand) fails its row."""
    assert (smoke["out"] / suite.COMPARE_DIR / "report.json").exists()
    monkeypatch.setattr(suite, "compare_argv", lambda settings, folder: [sys.executable, "-c", "import sys; sys.exit(1)"])
    settings = suite.settings_of(suite.parse_args(["--smoke"]))
    with pytest.raises(RuntimeError, match="compare exited with 1 and wrote no report"):
        suite.run_compare(settings, smoke["out"], timeout=60)


_STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"


def _stubborn_group() -> subprocess.Popen:
    """A process that ignores SIGTERM (as a compare stuck in a kernel would answer too late), in a session of its own."""
    process = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def test_stopping_compare_kills_what_ignores_sigterm_after_the_grace(monkeypatch):
    monkeypatch.setattr(suite, "COMPARE_GRACE_S", 1)
    process = _stubborn_group()
    suite.stop_group(process)
    assert process.returncode == -signal.SIGKILL


def test_a_second_ctrl_c_while_compare_stops_kills_it_at_once():
    """The grace is 30 s; a second Ctrl-C during it kills compare's group now, and the Ctrl-C goes on up."""
    process = _stubborn_group()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    # Ctrl-C as in a terminal, also where this process started with SIGINT ignored (a background job of a script, as
    # CI's second lane runs its tests), where Python installs no handler of its own
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            suite.stop_group(process)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert process.wait(timeout=10) == -signal.SIGKILL and time.monotonic() - start < 20


def test_a_full_disk_mid_run_loses_no_row_the_tables_reach_stdout(tmp_path, monkeypatch, capsys):
    """The results folder is writable at the start, then every write fails as on a full disk (a stand-in for
    write_atomically: a disk cannot be filled on demand here). The suite measures on, says so once, prints the tables,
    exits 1, and leaves no partial file."""
    writes, real = [], suite.write_atomically

    def full_disk(path, text):
        writes.append(path.name)
        if len(writes) > 2:  # the two files written before any fit went through
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(suite, "write_atomically", full_disk)
    assert suite.main(["--smoke", "--only", "true", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("cannot write the results into") == 1 and "No space left on device" in captured.err
    assert "| bf16-true |" in captured.out and "| 16-true |" in captured.out  # every row, on stdout
    assert "could not write the results" in captured.err
    assert json.loads((tmp_path / suite.JSON_NAME).read_text())["rows"] == []  # the last whole write: before any fit
    assert not list(tmp_path.glob(".*.partial"))


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_partial(tmp_path, monkeypatch):
    target = tmp_path / "gpu_suite.json"
    target.write_text("old")

    def no_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(suite.os, "replace", no_replace)
    with pytest.raises(OSError):
        suite.write_atomically(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["gpu_suite.json"]
