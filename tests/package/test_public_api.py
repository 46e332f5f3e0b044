"""Every module declares ``__all__`` and every name there exists; the public API is the six public packages' ``__all__``
(at most 80 names), the API index in docs/index.md is the one ``tests/api_index.py`` renders, and
``lightning_precision.functional`` is the one namespace of pure functions."""

from __future__ import annotations

import importlib
import re

import pytest

from tests import api_index

MODULES = api_index.module_names()


@pytest.mark.parametrize("name", MODULES)
def test_every_module_declares_all(name):
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), (list, tuple)), (
        f"{name} has no `__all__`: list its public API (a private module: what other modules of the package import)"
    )


@pytest.mark.parametrize("name", MODULES)
def test_every_name_in_all_exists_once(name):
    module = importlib.import_module(name)
    names = list(getattr(module, "__all__", ()))
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what the module does not have: {missing}"
    assert len(names) == len(set(names)), f"{name}.__all__ repeats a name"


def test_discovery_found_the_package():
    assert MODULES[0] == "lightning_precision" and "lightning_precision.functional" in MODULES


def test_api_index_in_the_docs_is_current():
    assert api_index.current_section() == api_index.render(), (
        "docs/index.md's Public API section differs from the modules' `__all__`: run `python -m tests.api_index` to"
        " regenerate"
    )


def test_public_api_is_the_six_packages():
    assert api_index.PUBLIC == ("lightning_precision", "lightning_precision.fabric", "lightning_precision.callbacks",
                                "lightning_precision.functional", "lightning_precision.fp8",
                                "lightning_precision.formats")
    private = [m for m in MODULES if not api_index.is_public(m)]
    # the tool, underscore modules, and the implementation modules beneath a public package
    for name in ("lightning_precision.cli", "lightning_precision.cli.compare.main", "lightning_precision._mfu",
                 "lightning_precision.callbacks.amax", "lightning_precision.fabric.bf16_mixed"):
        assert name in private, name
    section = api_index.render()
    headings = [line for line in section.splitlines() if line.startswith("### ")]
    assert headings == [f"### `{m}`" for m in api_index.PUBLIC]
    assert "callbacks.amax" not in section and "lightning_precision.cli" not in section


def test_at_most_80_public_names_each_in_the_index():
    names = api_index.public_names()
    assert len(names) <= 80, f"{len(names)} public names: the API is meant to stay within 80"
    section = api_index.current_section()
    listed = {m.group(1) for m in re.finditer(r"^- `(?:class )?(\w+)", section, re.MULTILINE)}
    missing = sorted(names - listed)
    assert not missing, f"public names not in docs/index.md: {missing}"


def test_functional_gathers_the_pure_functions():
    from lightning_precision import _channels_last, _mfu, fp8, functional
    from lightning_precision.fp8 import _sensitivity as sensitivity

    for name in ("apply_channels_last", "to_channels_last", "select_fp8_layers", "fp8_sensitivity", "underflow_stats",
                 "mfu", "choose_peak", "model_flops_per_step"):
        assert name in functional.__all__, name
    # re-exports are the same objects, wherever a user imports them from
    assert functional.select_fp8_layers is fp8.select_fp8_layers
    assert functional.fp8_sensitivity is sensitivity.fp8_sensitivity
    assert (functional.mfu, functional.choose_peak, functional.model_flops_per_step) == (
        _mfu.mfu, _mfu.choose_peak, _mfu.model_flops_per_step)
    assert (functional.apply_channels_last, functional.to_channels_last) == (
        _channels_last.apply_channels_last, _channels_last.to_channels_last)


def test_top_level_all_is_what_loads_lazily():
    import lightning_precision

    assert set(lightning_precision.__all__) == {*lightning_precision._SOURCE, "__version__"}
