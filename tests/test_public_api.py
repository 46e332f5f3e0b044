"""Every module declares its public API in ``__all__``, every name there exists, the API index in docs/index.md is the
one ``tests/api_index.py`` renders, and ``lightning_precision.functional`` is the one namespace of pure functions."""

from __future__ import annotations

import importlib

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


def test_functional_gathers_the_pure_functions():
    from lightning_precision import _mfu, callbacks, fp8, functional
    from lightning_precision.fp8 import _sensitivity as sensitivity
    from lightning_precision.callbacks import channels_last

    for name in ("apply_channels_last", "to_channels_last", "select_fp8_layers", "fp8_sensitivity", "underflow_stats",
                 "mfu", "choose_peak", "model_flops_per_step"):
        assert name in functional.__all__, name
    # re-exports are the same objects, wherever a user imports them from
    assert functional.select_fp8_layers is fp8.select_fp8_layers
    assert functional.fp8_sensitivity is sensitivity.fp8_sensitivity
    assert (functional.mfu, functional.choose_peak, functional.model_flops_per_step) == (
        _mfu.mfu, _mfu.choose_peak, _mfu.model_flops_per_step)
    for name in ("apply_channels_last", "to_channels_last"):  # public in callbacks before functional held them
        assert getattr(callbacks, name) is getattr(channels_last, name) is getattr(functional, name)
