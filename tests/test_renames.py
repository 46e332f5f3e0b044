"""Issue 14's renames keep every old public name working, with a DeprecationWarning naming the new one."""

import pytest
from torch import nn

from lightning_precision import fabric as lp_fabric
from lightning_precision import fp8


def test_recipe_name_is_now_scaling_family():
    pytest.importorskip("torchao")
    plugin = lp_fabric.FP8Precision(recipe="rowwise_with_gw_hp", emulate=True)
    assert plugin.scaling_family == "rowwise"  # a threshold family, not the recipe's name
    with pytest.warns(DeprecationWarning, match=r"FP8Precision.recipe_name.*use `FP8Precision.scaling_family`"):
        assert plugin.recipe_name == "rowwise"
    with pytest.warns(DeprecationWarning, match="use `torchao_scaling_family`"):
        assert fp8.torchao_recipe_name(plugin.recipe) == "rowwise"
    with pytest.warns(DeprecationWarning, match="use `scaling_family_of`"):
        assert fp8.recipe_name_of("torchao", plugin.recipe) == "rowwise"
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48))
    with pytest.warns(DeprecationWarning, match=r"select_fp8_layers\(recipe_name=...\)"):
        old = fp8.select_fp8_layers(net, recipe_name="mxfp8", module_filter=lambda m, f: True)
    assert old == fp8.select_fp8_layers(net, "mxfp8", module_filter=lambda m, f: True)
    assert [d.fp8 for d in old] == [True, False]  # the old keyword still chooses the family's rules
    with pytest.raises(ValueError, match="pass one"), pytest.warns(DeprecationWarning):
        fp8.select_fp8_layers(net, "rowwise", recipe_name="mxfp8")  # two families: neither wins silently

