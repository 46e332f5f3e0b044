"""What the wheel ships: a real wheel built from the checkout (offline, with the installed setuptools), unpacked as pip
installs a pure-Python wheel, and the command run from it."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the command line's own machinery: CI runs it on one torch (pyproject.toml)

ROOT = Path(__file__).resolve().parents[1]
# What a build reads: a copy of it is built, so the checkout gets no build/ or .egg-info/ of the test's.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "lightning_precision", "recipes")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")


def _setuptools() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_pyproject_lists_every_package():
    """The packages are listed (one lives outside lightning_precision/): a new subpackage must be added there."""
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "lightning_precision").rglob("__init__.py")}
    listed = set(_setuptools()["packages"])
    assert listed == found | {"lightning_precision.recipe_configs"}
    assert _setuptools()["package-dir"] == {"lightning_precision.recipe_configs": "recipes"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
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


def test_the_wheel_ships_the_recipe_configs(wheel):
    """`fit --config vit` and the docs name the recipe configs; the wheel had none."""
    with zipfile.ZipFile(wheel) as whl:
        shipped = {Path(n).name: whl.read(n) for n in whl.namelist()
                   if n.startswith("lightning_precision/recipe_configs/")}
    assert shipped == {p.name: p.read_bytes() for p in (ROOT / "recipes").glob("*.yaml")}


def test_fit_runs_a_shipped_config_from_the_installed_wheel(wheel, tmp_path):
    """The wheel's files, unpacked as pip installs them, alone on the path: `fit --config vit --config
    precision-16-mixed` runs from a folder without recipes/ and reads the configs from the installed package."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
    run = tmp_path / "run"
    run.mkdir()
    script = (
        "import sys, lightning_precision\n"
        "import lightning_precision.cli as cli\n"
        f"assert lightning_precision.__file__.startswith({str(site)!r}), lightning_precision.__file__\n"
        f"assert str(cli.recipe_configs()['vit']) == {str(site / 'lightning_precision/recipe_configs/vit.yaml')!r}\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, "fit", "--config", "vit", "--config", "precision-16-mixed",
         "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
         "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"],
        cwd=run, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_wheel_ships_the_license(wheel):
    """pyproject said Apache-2.0 but there was no LICENSE file: the full text ships, and the
    metadata names the license as an SPDX expression."""
    license = (ROOT / "LICENSE").read_text()
    assert license.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in license
    with zipfile.ZipFile(wheel) as whl:
        (shipped,) = [n for n in whl.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert whl.read(shipped).decode() == license
        (metadata,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        headers = whl.read(metadata).decode().split("\n\n")[0].splitlines()
    assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers


def test_the_wheel_ships_its_type_information(wheel):
    """PEP 561: without `py.typed` in the installed package, a user's mypy treats every name of it as Any."""
    with zipfile.ZipFile(wheel) as whl:
        assert "lightning_precision/py.typed" in whl.namelist()
