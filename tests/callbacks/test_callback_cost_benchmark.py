"""``benchmarks/callback_cost.py`` runs, as a user would run it (a subprocess), on small MLPs: its ops part prints a
row per callback and layer count, and the counts it prints are those the tests hold (nothing added on a step the
callback neither measures nor logs). Nothing timed is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark script's smoke run (fits in a subprocess), not the library

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "callback_cost.py"), "--threads", "1", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_ops_and_time_parts_print_each_callbacks_rows():
    out = _run("--part", "all", "--layers", "4", "--width", "32", "--batch", "8", "--steps", "12", "--rounds", "1",
               "--cadence", "4")
    ops, time = out.split("CPU time per step")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in ops.splitlines() if line.startswith("| ")}
    for name in ("GradientUnderflowMonitor (bf16)", "GradientUnderflowMonitor (fp16)", "MFUMonitor"):
        assert rows[name].split(" | ")[2] == "0 / 0, 0", rows[name]  # nothing on an ordinary step
    cpu, gpu = rows["AmaxHistoryLogger"].split(" | ")[2].split(",")[0].split(" / ")
    assert int(cpu) > int(gpu) > 0  # records every step; the weights' amaxes fused on a GPU
    assert "| AmaxHistoryLogger | 4 |" in time and "| MFUMonitor | 4 |" in time, time
