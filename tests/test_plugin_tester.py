"""Every precision plugin the package exports, Fabric and Trainer classes alike, through the shared checks of
tests/plugin_tester.py. Plugins are discovered: a new one runs here by existing, and fails until it has a spec."""

import pytest

from tests.plugin_tester import (
    CHECKS,
    FABRIC_PLUGINS,
    SPECS,
    TRAINER_PLUGINS,
    PluginTester,
    cases,
    missing_spec_message,
)

PLUGINS = FABRIC_PLUGINS + TRAINER_PLUGINS


def test_every_discovered_plugin_has_a_spec():
    """One failure that lists them all (each check below fails for such a plugin too, with the same message)."""
    missing = [missing_spec_message(cls) for cls in PLUGINS if not SPECS.get(cls.__name__)]
    assert not missing, "\n".join(missing)


def test_specs_name_only_discovered_plugins_and_only_nvfp4_may_not_run():
    discovered = {cls.__name__ for cls in PLUGINS}
    assert set(SPECS) <= discovered, f"specs for plugins the package no longer exports: {set(SPECS) - discovered}"
    # A skip is for hardware that cannot exist here and has no emulation; everything else runs on the CPU.
    assert {name for name, variants in SPECS.items() for spec in variants.values() if spec.cannot_run_here} \
        <= {"NVFP4Precision"}
    # A known bug names a check that exists, for Fabric or Trainer classes, or it would silently mark nothing.
    keys = {key for variants in SPECS.values() for spec in variants.values() for key in spec.known_bugs}
    assert keys <= {f"{kind}.{check}" for kind in ("fabric", "plugins") for check in CHECKS}, keys


@pytest.mark.parametrize(("cls", "spec"), cases(PLUGINS, "parity"))
def test_parity_with_the_hand_written_loop(cls, spec):
    PluginTester(cls, spec).run_parity()


@pytest.mark.parametrize(("cls", "spec"), cases(PLUGINS, "state_round_trip"))
def test_state_dict_round_trips_after_steps(cls, spec):
    PluginTester(cls, spec).run_state_round_trip()


@pytest.mark.parametrize(("cls", "spec"), cases(PLUGINS, "pickling"))
def test_pickles_after_setup_and_after_steps(cls, spec):
    PluginTester(cls, spec).run_pickling()


@pytest.mark.parametrize(("cls", "spec"), cases(PLUGINS, "no_grad_forward"))
def test_a_no_grad_forward_first_leaves_the_gradients_unchanged(cls, spec):
    PluginTester(cls, spec).run_no_grad_forward_first()


@pytest.mark.parametrize(("cls", "spec"), cases(PLUGINS, "optimizer_params"))
def test_the_optimizer_holds_the_model_parameters_after_setup(cls, spec):
    PluginTester(cls, spec).run_optimizer_holds_model_params()
