"""Typed configuration: ``ScalerConfig`` beside the flat arguments, keyword-only constructors, and
the Trainer classes showing their real signatures."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import lightning_precision
from lightning_precision import FP8LayerPolicy, FP8Precision, FP16MixedPrecision, ScalerConfig
from lightning_precision import fabric as lp_fabric
from tests.helpers import LitNet, loader, make_data, params, trainer

PLUGIN_NAMES = [name for name in lp_fabric.__all__ if name.endswith("Precision")]


@pytest.mark.parametrize("namespace", [lightning_precision, lp_fabric], ids=["trainer", "fabric"])
@pytest.mark.parametrize("name", PLUGIN_NAMES)
def test_constructor_options_are_keyword_only_and_listed(namespace, name):
    cls = getattr(namespace, name)
    parameters = list(inspect.signature(cls).parameters.values())
    # A `*args, **kwargs` constructor would hide the options from help() and LightningCLI.
    assert parameters and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters), parameters
    if namespace is lightning_precision:  # the Trainer class shows the Fabric class's arguments, not its own
        assert cls is not getattr(lp_fabric, name)
        assert inspect.signature(cls) == inspect.signature(getattr(lp_fabric, name))


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        FP16MixedPrecision(1024.0)  # type: ignore[misc]


def test_defaults_are_the_configs():
    flat = inspect.signature(FP16MixedPrecision).parameters
    for field in dataclasses.fields(ScalerConfig):
        assert flat[field.name].default == field.default, field.name
    assert FP16MixedPrecision().scaler_config == ScalerConfig()


def test_a_scaler_config_trains_exactly_as_the_same_flat_arguments():
    arguments = dict(init_scale=2.0**10, growth_interval=2, max_scale=2.0**12)
    weights, scales = [], []
    for plugin in (FP16MixedPrecision(scaler=ScalerConfig(**arguments)), FP16MixedPrecision(**arguments)):
        torch.manual_seed(0)
        model = LitNet()
        trainer(plugin, max_steps=6).fit(model, loader(make_data(6)))
        weights.append(params(model))
        scales.append(plugin.loss_scale)
    assert scales[0] == scales[1] == 2.0**12  # grew twice and hit max_scale: the config's bounds are in force
    for a, b in zip(*weights, strict=True):
        assert torch.equal(a, b)


def test_scaler_and_changed_flat_arguments_are_refused_together():
    with pytest.raises(ValueError, match=r"scaler=ScalerConfig\(\.\.\.\), init_scale=1024.0.*one place"):
        FP16MixedPrecision(scaler=ScalerConfig(), init_scale=1024.0)
    # Flat arguments left at their defaults are no conflict.
    assert FP16MixedPrecision(scaler=ScalerConfig(growth_interval=7)).scaler_config.growth_interval == 7


def test_scaler_must_be_a_config_and_is_validated():
    with pytest.raises(ValueError, match=r"lightning_precision.ScalerConfig\(\.\.\.\)"):
        FP16MixedPrecision(scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"FP16MixedPrecision\(growth_factor=0.5\)"):
        FP16MixedPrecision(scaler=ScalerConfig(growth_factor=0.5))


def test_scaler_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ScalerConfig().init_scale = 1.0  # type: ignore[misc]


def test_a_layer_policy_chooses_the_same_layers_as_the_flat_arguments():
    from lightning_precision.fp8 import select_fp8_layers

    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    policy = FP8LayerPolicy(skip_small_layers=False, module_filter=lambda module, fqn: fqn != "2")
    flat = FP8Precision(emulate=True, skip_small_layers=False, module_filter=policy.module_filter)
    typed = FP8Precision(emulate=True, layer_policy=policy)
    assert typed.layer_policy == flat.layer_policy == policy
    assert typed.skip_small_layers is False and typed.module_filter is policy.module_filter  # the flat names still read
    chosen = [d.fp8 for d in select_fp8_layers(model, layer_policy=policy)]
    assert chosen == [True, True, False, True]  # the filter alone decides: first and last are not skipped
    typed.convert_module(model)
    assert [d.fp8 for d in typed.layer_decisions] == chosen


def test_layer_policy_and_changed_flat_arguments_are_refused_together():
    with pytest.raises(ValueError, match=r"layer_policy=FP8LayerPolicy\(\.\.\.\), skip_first_last=False.*one place"):
        FP8Precision(emulate=True, layer_policy=FP8LayerPolicy(), skip_first_last=False)
    with pytest.raises(ValueError, match=r"FP8Precision\(module_filter=3\)"):
        FP8Precision(emulate=True, layer_policy=FP8LayerPolicy(module_filter=3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"skip_small_layers='no'"):
        FP8LayerPolicy(skip_small_layers="no").validate("FP8Precision")  # type: ignore[arg-type]


def _instantiate(parser, config):
    """jsonargparse's `instantiate` (4.49 on; it deprecates `instantiate_classes`, which the cli extra's oldest has)."""
    return (getattr(parser, "instantiate", None) or parser.instantiate_classes)(config)


def test_lightning_cli_parser_sees_and_builds_the_typed_configs():
    # LightningCLI parses plugin arguments with jsonargparse from the signature: a `*args, **kwargs` Trainer class
    # would give it nothing to parse, and the frozen configs arrive as nested mappings.
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(FP16MixedPrecision, "plugin")
    config = parser.parse_args(["--plugin.scaler", '{"init_scale": 1024.0, "growth_interval": 7}'])
    plugin = _instantiate(parser, config).plugin
    assert type(plugin) is FP16MixedPrecision
    assert plugin.scaler_config == ScalerConfig(init_scale=1024.0, growth_interval=7)
    parser = ArgumentParser()
    parser.add_class_arguments(FP8Precision, "plugin")
    config = parser.parse_args(["--plugin.emulate", "true", "--plugin.layer_policy", '{"skip_first_last": false}'])
    assert _instantiate(parser, config).plugin.layer_policy == FP8LayerPolicy(skip_first_last=False)
