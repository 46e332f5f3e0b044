"""The package's wheel, built from a copy of the checkout, offline, with the installed setuptools (what
``tests/package/test_packaging.py`` unpacks and ``tests/gpu/test_gpu_suite.py`` carries as ``benchmarks/gpu_run.sh`` does)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What a build reads: a copy of it is built, so the checkout gets no build/ or .egg-info/ of the test's.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "lightning_precision", "recipes")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")


def build_wheel(tmp_path_factory: Any) -> Path:
    """The wheel's path; skips the calling test where setuptools is missing or too old to build offline."""
    from packaging.version import Version

    try:
        import setuptools
    except ImportError:
        pytest.skip("setuptools is not installed: the wheel cannot be built offline here")
    need = next(r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
                if r.startswith("setuptools"))
    if Version(setuptools.__version__) < Version(need.partition(">=")[2]):
        pytest.skip(f"the build needs {need}, this environment has setuptools {setuptools.__version__}"
                    " (`pip install -e '.[dev]'` installs it)")
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("lightning_precision-*.whl")
    return built
