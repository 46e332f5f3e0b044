"""What the wheel ships: a real wheel built from the checkout (offline, with the installed setuptools), unpacked as pip
installs a pure-Python wheel, and the command run from it."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.wheel import ROOT, tomllib

pytestmark = pytest.mark.slow  # the command line's own machinery: CI runs it on one torch (pyproject.toml)


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
def wheel(package_wheel) -> Path:
    return package_wheel


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
