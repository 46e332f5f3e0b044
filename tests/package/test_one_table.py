"""One table per fact: each extra, version minimum and hardware threshold is written once, and every other place reads
it from there. pyproject.toml is the one copy that cannot import ours, so it is checked against ``_imports``."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch
from lightning_utilities.core.imports import RequirementCache
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from lightning_precision import _imports
from lightning_precision._core import devices
from lightning_precision.cli import doctor

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_precision"


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _requirements(lines: list[str]) -> dict[str, Requirement]:
    """By normalised distribution name (``transformer-engine[pytorch]>=2.9`` -> ``transformer-engine``)."""
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


def _runtime_requirements() -> dict[str, Requirement]:
    """The requirements ``_imports`` checks at run time, by normalised name."""
    caches = [v for v in vars(_imports).values() if isinstance(v, RequirementCache)] + list(_imports.CLI_REQUIREMENTS)
    checks = [v.requirement for v in caches]
    return _requirements(checks)


def test_every_package_of_extra_of_is_in_the_extra_it_names():
    extras = {extra: _requirements(lines) for extra, lines in _project()["optional-dependencies"].items()}
    for package, extra in _imports.EXTRA_OF.items():
        assert extra in extras, f"EXTRA_OF[{package!r}] names extra {extra!r}, which pyproject.toml does not define"
        assert canonicalize_name(package) in extras[extra], f"extra {extra!r} does not hold {package!r}"


def test_no_core_dependency_is_in_an_extra():
    """A core dependency missing is a broken install (reinstall), never an extra to add; and an extra that repeats a
    core dependency only says the same thing twice."""
    core = set(_requirements(_project()["dependencies"]))
    assert core.isdisjoint(map(canonicalize_name, _imports.EXTRA_OF))
    for extra, lines in _project()["optional-dependencies"].items():
        assert core.isdisjoint(_requirements(lines)), f"extra {extra!r} repeats a core dependency"


def test_runtime_minimums_are_the_extras_minimums():
    extras = _project()["optional-dependencies"]
    runtime = _runtime_requirements()
    for package, extra in _imports.EXTRA_OF.items():
        name = canonicalize_name(package)
        assert name in runtime, f"{package!r} has an extra but no check in _imports"
        assert runtime[name].specifier == _requirements(extras[extra])[name].specifier, package


def test_require_says_how_to_get_the_package():
    missing = type("Missing", (), {"message": "not found", "__bool__": lambda self: False})()
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-precision\[fp8\]'"):
        _imports.require(missing, "torchao", "FP8Precision")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-precision\[plots\]'"):
        _imports.require(missing, "matplotlib", "Plotting")
    with pytest.raises(ModuleNotFoundError, match=r"PyYAML.*broken: reinstall lightning-precision"):
        _imports.require(missing, "PyYAML", "Plan files")


# A fact, and the one file that may write it. Searched in the package's sources, comments and docstrings included.
FACTS = {
    r"\(8,\s*0\)": "_core/devices.py",  # bf16's compute capability
    r"\(8,\s*9\)": "fp8/_hardware.py",  # fp8's compute capability
    r"\(10,\s*0\)": "fp8/_hardware.py",  # MXFP8's and NVFP4's
    r"torchao>=": "_imports.py",  # the torchao minimum (and pyproject.toml, checked above)
    r"transformer-engine>=": "_imports.py",  # Transformer Engine's
    r'split\("\."\)\[:2\]': "_imports.py",  # major.minor of a version: IPEX must match torch's
    r"RequirementCache\(": "_imports.py",  # availability checks
    r"importlib\.metadata": "_imports.py",  # installed versions
    r"import (torchvision|intel_extension_for_pytorch)": "_imports.py",  # the optional imports that may break
}


def _sources() -> dict[str, str]:
    return {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("pattern", FACTS)
def test_each_fact_is_written_in_one_file(pattern):
    found = {name for name, text in _sources().items() if re.search(pattern, text)}
    assert found == {FACTS[pattern]}


def test_extra_names_are_written_only_in_imports():
    """Messages name an extra through ``_imports.install_command`` or ``EXTRA_OF``, never as a literal."""
    found = {name for name, text in _sources().items() if re.search(r"lightning-precision\[\w", text)}
    assert found <= {"_imports.py"}


def test_doctor_asks_imports_whether_ipex_fits(monkeypatch):
    """An IPEX built for torch 2.8 is reported as _imports judges it, whatever this torch is: doctor has no check of
    its own to disagree with the one that guards the import."""
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda d: "2.8.10+xpu" if d == _imports.IPEX else real(d))
    for fits, status in ((True, "ok"), (False, "INCOMPATIBLE")):
        monkeypatch.setattr(_imports, "ipex_status", lambda fits=fits: (fits, "stand-in"))
        (row,) = [r for r in doctor._package_rows() if r[0] == _imports.IPEX]
        assert row[1] == "2.8.10+xpu" and row[2].startswith(status)


@pytest.mark.parametrize(("threshold", "supported"), [((8, 0), False), ((7, 5), True)])
def test_doctor_and_the_plugin_share_the_bf16_threshold(monkeypatch, threshold, supported):
    """A T4 (7.5) under the real threshold and under a moved one: doctor and the plugin move together. No GPU exists
    here: torch.cuda's answers are stand-ins."""
    monkeypatch.setattr(devices, "BF16_MIN_CAPABILITY", threshold)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=16 * 2**30))
    (gpu,) = [r for r in doctor._device_rows() if r[0].startswith("cuda:0")]
    assert gpu[1] == ("yes" if supported else "no")
    assert gpu[5] == ("BF16MixedPrecision" if supported else "FP16MixedPrecision")
    if supported:
        devices.check_bf16_supported("cuda")
    else:
        with pytest.raises(RuntimeError, match=r">= 8\.0\), found 'Tesla T4' \(compute capability 7\.5\)"):
            devices.check_bf16_supported("cuda")
