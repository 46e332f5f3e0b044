"""``benchmarks/true_precision.py`` runs, as a user would run it (a subprocess), on a few steps: its step-time part with
the optimizer step alone and its profile, its pieces and its op counts in one run (each test reads its part of the
output: a process's start costs more than a part), and one variant's bytes a parameter. Nothing timed is asserted; the
bytes are counted, so they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark script's smoke run (fits in subprocesses), not the library

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "true_precision.py"


def _run(*args: str, env: dict[str, str] | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--threads", "1", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def time_pieces_and_ops() -> str:
    """The time part (torchao's peer row included), its profile, the pieces, then the ops part (last: the ops tests
    split the output at its tables' titles), in one process."""
    return _run("--part", "time", "--part", "pieces", "--part", "ops", "--model", "vit", "--rounds", "1", "--steps", "7",
                "--profile", "--ops-layers", "2,8")


def test_step_time_with_the_step_alone_and_the_pieces(time_pieces_and_ops):
    out = time_pieces_and_ops.split("\nOne training step")[0]
    for row in ("| Lightning bf16-true |", "| BF16TruePrecision() |", "| BF16TruePrecision(update='compensated') |",
                "| Lightning bf16-mixed |", "| FP16TruePrecision() |", "| torchao _AdamW(bf16_stochastic_round=True)",
                "AdamW on the bf16 weights (Lightning bf16-true)", "ours, update='stochastic', step_chunk=2**20",
                "aten::random_", "finite check: new.sum().isfinite()"):
        assert row in out, out


def _ops(out: str, model: str, variant: str, table: int) -> int:
    rows = out.split("\nOne training step")[table + 1].splitlines()
    cells = next(r.split(" | ") for r in rows if r.startswith(f"| {model} | {variant} |"))
    return int(cells[2])


def test_the_ops_part_counts_what_the_step_adds_as_a_constant(time_pieces_and_ops):
    """The op-count part, on MLPs of 2 and 8 layers: what each true plugin adds to Lightning's bf16-true is the same
    number of aten ops for both (constant per chunk, not per parameter), with AdamW's loop and with its foreach."""
    out = time_pieces_and_ops
    for table in (0, 1):
        for variant in ("BF16TruePrecision()", "FP16TruePrecision()", "BF16TruePrecision(update='compensated')"):
            added = [_ops(out, f"MLP {n} x 64x64 ({2 * n} parameters)", variant, table)
                     - _ops(out, f"MLP {n} x 64x64 ({2 * n} parameters)", "Lightning bf16-true", table)
                     for n in (2, 8)]
            assert added[0] == added[1] > 0, (variant, table, added)
    assert "| vit recipe (tiny) | Lightning bf16-mixed |" in out


def test_bytes_of_the_default_are_half_of_bf16_mixed():
    label = "BF16TruePrecision(update='stochastic', optimizer_states='weight')"
    out = _run("--_child", "bytes", "--_label", label, "--model", "mlp", env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    counted = json.loads(out.splitlines()[-1])
    assert counted["parameters"] == 4_208_650
    # bf16 weight, gradient and AdamW's two states (and a few bytes of step counters)
    assert counted["per_parameter"] == pytest.approx(8.0, abs=1e-3)
    assert counted["widened"] == 4_208_650 * 16  # one chunk: weight, gradient and two states in fp32
    assert counted["rise"] > 0  # the step allocates its fp32 stand-ins
