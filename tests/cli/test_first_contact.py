"""The command line as a new user meets it, in a fresh process: no traceback and none of the libraries' known noise
(torchao's CUDA kernels failing to load on a CPU, torch's register_constant deprecation, Lightning's LeafSpec
deprecation) on the terminal."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the command line's own machinery: CI runs it on one torch (pyproject.toml)

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("Traceback", "Failed to load", "register_constant", "LeafSpec")


def _run(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "lightning_precision.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_fit_on_a_recipe_is_quiet(tmp_path):
    code, out = _run("fit", "--config", str(ROOT / "recipes" / "vit.yaml"), "--precision", "fp8-emulated",
                     "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
                     "--trainer.enable_progress_bar", "false", cwd=tmp_path)
    assert code == 0, out
    assert not [n for n in NOISE if n in out], out


@pytest.mark.parametrize("recipe", ["distilbert"])  # transformers imports torchao whenever it is installed
def test_compare_is_quiet(recipe, tmp_path):
    code, out = _run("compare", "--recipe", recipe, "--precisions", "32-true,fp8", "--emulate", "--steps", "3",
                     "--batch-size", "8", "--val-batches", "0", cwd=tmp_path)
    assert code == 0, out
    assert not [n for n in NOISE if n in out], out
    assert (tmp_path / "compare-report" / "report.md").is_file()
