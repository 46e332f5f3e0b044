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


# Each check of PluginTester (its `run_<check>` method): parity with the hand-written loop, the state_dict round trip
# after steps, pickling after setup and after steps, a no_grad forward first leaving the gradients unchanged, and the
# optimizer holding the model's parameters after setup.
@pytest.mark.parametrize(("check", "cls", "spec"), [
    pytest.param(check, *case.values, id=f"{check}-{case.id}", marks=case.marks)
    for check in CHECKS for case in cases(PLUGINS, check)
])
def test_each_plugin_passes_each_shared_check(check, cls, spec):
    getattr(PluginTester(cls, spec), f"run_{check}")()
