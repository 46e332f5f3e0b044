"""``benchmarks/plan_formats.py`` runs its ``main`` on a few steps of a small model with outlier channels, and its
shapes-only predictions: the table's rows and cells are checked, never a loss value or a time."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark script's smoke run (real fits), not the library

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "plan_formats.py"
CONFIGS = ["bf16", "fp32 (how far a change of precision alone moves the loss)", "all tensorwise",
           "Megatron (first/last block bf16)"] + [f"plan {d}, budget {b} = " for d in ("B200", "H100 SXM")
                                                   for b in ("B", "B/2", "B/4")]


@pytest.fixture(scope="module")
def script():
    """The script as a module (registered while loaded: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("plan_formats_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _rows(out: str, model: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith(f"| {model} |")]


def test_every_configuration_trains_and_is_predicted(script, capsys):
    result = script.main(["--models", "outlier", "--steps", "3", "--calibration", "2", "--tail", "2",
                          "--outlier-dim", "64", "--outlier-depth", "3", "--no-shapes"])
    out = capsys.readouterr().out
    assert "block_stack: `blocks`, 3 blocks" in out, out
    assert "| model | configuration | layers in low precision | final loss | gap to bf16 | B200 saving ms |" in out
    rows = _rows(out, "outlier")
    assert len(rows) == len(CONFIGS) == len(result["trained"]), out
    for row, config in zip(rows, CONFIGS, strict=True):
        assert len(row) == 7 and row[1].startswith(config), row
        float(row[3]), float(row[4])  # the final loss and its gap print as numbers
        for cell in row[5:]:
            assert re.fullmatch(r"[+-]\d+\.\d{4} \([+-]\d+%\)|n/a \(format not run\)", cell), row
    assert rows[0][4] == "+0.0000" and rows[0][2] == "0/8"  # bf16: the reference, no layer in low precision
    assert rows[2][2] == "8/8: 8 tensorwise"  # every linear layer (the shape rules off)
    assert rows[3][2] == "2/8: 2 tensorwise"  # Megatron: the middle block only (the edges kept too)
    for row, trained in zip(rows[4:], result["trained"][4:], strict=True):
        allowed = {"tensorwise", "rowwise", "mxfp8"} if "B200" in row[1] else {"tensorwise", "rowwise"}
        assert set(trained["formats"].values()) <= allowed, row
        assert trained["plan"] is not None and "embed" not in trained["formats"] and "head" not in trained["formats"]
    assert "bf16 from other initial weights (seeds 1..2), the same batches: final loss" in out
    # the plans' own predicted savings agree with the table's recomputation
    for line in out.splitlines():
        if "the plan's own figure" in line:
            found = re.search(r"saving (-?\d+\.\d+) ms per step.*recomputed here: (-?\d+\.\d+) ms", line)
            assert found is not None, line
            own, again = found.groups()
            assert float(own) == pytest.approx(float(again), abs=1e-3), line


def test_outlier_channels_are_deterministic(script):
    a, b = script.Outliers(dim=64, depth=2), script.Outliers(dim=64, depth=2)
    assert a.outlier_channels == b.outlier_channels and len(a.outlier_channels) == 4
    assert all(1e3 <= s <= 1e4 for s in a.outlier_channels.values())
    (xa, ya), (xb, yb) = a.batches(1)[0], b.batches(1)[0]
    assert xa.equal(xb) and ya.equal(yb)


def test_shapes_only_predictions(script, capsys):
    rows = script.run_shapes(["vit"])
    out = capsys.readouterr().out
    assert "Shapes only" in out and len(rows) == 6, out
    table = _rows(out, "ViT-B/16")
    assert [r[2] for r in table[:4]] == ["24/25: 24 tensorwise", "20/25: 20 tensorwise", "24/25: 24 rowwise",
                                         "24/25: 24 mxfp8"], out
    assert table[3][4] == "n/a (format not run)"  # the H100 runs no MXFP8
