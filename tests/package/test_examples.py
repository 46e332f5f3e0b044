"""The examples the README links run as documented, with a few steps."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # three real fits and their validation: a few seconds
def test_quickstart_prints_a_row_per_precision_even_within_the_first_epoch(monkeypatch, capsys):
    """`--steps` under one epoch (128 batches) once raised `KeyError: 'val_acc'`: validation ran at the epoch's end."""
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--steps", "2"])
    runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["precision", "val", "acc", "loss", "ms/step", "loss", "scale", "skipped"]
    assert [r.split()[0] for r in rows[1:4]] == ["32-true", "bf16-mixed", "16-mixed"]
    assert rows[3].split()[-2:] == ["65536", "0"]  # the fp16 plugin's loss scale and skipped steps
    assert rows[4] == "chance accuracy is 0.125"
