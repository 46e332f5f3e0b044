"""``benchmarks/true_precision.py`` runs, as a user would run it (a subprocess), on a few steps: its step-time part with
the optimizer step alone and its profile, its pieces, and one variant's bytes a parameter. Nothing timed is asserted;
the bytes are counted, so they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark script's smoke run (fits in subprocesses), not the library

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "true_precision.py"


def _run(*args: str, env: dict[str, str] | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--threads", "1", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_step_time_with_the_step_alone_and_the_pieces():
    out = _run("--part", "time", "--part", "pieces", "--model", "vit", "--rounds", "1", "--steps", "7", "--profile")
    for row in ("| Lightning bf16-true |", "| BF16TruePrecision() |", "| BF16TruePrecision(update='compensated') |",
                "AdamW on the bf16 weights (Lightning bf16-true)", "ours, update='stochastic', step_chunk=2**20",
                "aten::random_", "finite check: new.sum().isfinite()"):
        assert row in out, out


def test_bytes_of_the_default_are_half_of_bf16_mixed():
    label = "BF16TruePrecision(update='stochastic', optimizer_states='weight')"
    out = _run("--_child", "bytes", "--_label", label, "--model", "mlp", env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    counted = json.loads(out.splitlines()[-1])
    assert counted["parameters"] == 4_208_650
    # bf16 weight, gradient and AdamW's two states (and a few bytes of step counters)
    assert counted["per_parameter"] == pytest.approx(8.0, abs=1e-3)
    assert counted["widened"] == 4_208_650 * 16  # one chunk: weight, gradient and two states in fp32
    assert counted["rise"] > 0  # the step allocates its fp32 stand-ins
