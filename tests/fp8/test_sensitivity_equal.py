"""The sensitivity probe (``fp8_sensitivity``, ``layers="auto"``) measures the same numbers as the probe it replaced.

tests/sensitivity_reference.py keeps the measurement as it was written first; here it hooks the same layers as the
probe under test, on the same forward and backward passes, and every figure (SQNR, underflow and overflow fractions,
output and input-gradient errors, batches kept and dropped) must be the same float, and the plan made from them the
same plan. Edge tensors: zeros, subnormals, outlier channels that flush the rest, a layer that gets no tokens, batches
with inf and nan (left out), bf16, fp16 and fp32 inputs, every per-tensor and per-row recipe. Real torchao, emulated.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import cast

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision.fabric import FP8Precision
from lightning_precision.fp8 import PrecisionPlan
from lightning_precision.fp8._sensitivity import SensitivityProbe, fp8_sensitivity, probe_config
from tests.sensitivity_reference import ReferenceProbe

pytest.importorskip("torchao")


def skip_where_torchao_rowwise_cannot_autocast() -> None:
    """torchao 0.11's per-row fp8 layer fails under autocast in its own forward ("aten._to_copy.default with axiswise
    scaling is not supported yet"): neither probe can measure it there."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    layer = nn.Sequential(nn.Linear(32, 32))
    convert_to_float8_training(layer, config=dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"),
                                                                 emulate=True))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(torch.randn(32, 32))
    except AssertionError as err:
        if "axiswise scaling is not supported" not in str(err):
            raise
        pytest.skip(f"this torchao's rowwise fp8 layer does not run under autocast ({err})")


class Routed(nn.Module):
    """Linear layers of several shapes (with and without bias, on 2-d and 3-d inputs), one fed by outlier channels, and an ``expert`` that
    sees only the rows routed to it (none, in some batches)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 64)
        self.tokens = nn.Linear(16, 16)  # on a (batch, tokens, features) input
        self.expert = nn.Linear(64, 64)
        self.b = nn.Linear(64, 48)
        self.head = nn.Linear(48, 16, bias=False)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = h + self.tokens(h.reshape(h.shape[0], 4, 16)).reshape(h.shape)
        h = torch.cat([h[:, :2] * 300, h[:, 2:]], dim=1)  # outlier channels into the expert and b
        routed = torch.zeros_like(h)
        routed[route] = self.expert(h[route])
        return self.head(torch.relu(self.b(h + routed)))


def edge_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(7):
        x = torch.randn(24, 32, generator=g) * (1.0 if i % 2 else 8.0)
        route = torch.rand(24, generator=g) > 0.5
        if i == 1:
            x[:4] = 0.0  # zero rows
            x[4:8] = torch.tensor(1e-40)  # fp32 and bf16 subnormals
            x[8, 0] = 6e4  # near fp16's max
        if i == 2:
            route[:] = False  # the expert gets no tokens
        if i == 3:
            x[5, 7] = float("inf")  # a fault of the data: left out
        if i == 5:
            x[2, 2] = float("nan")
        out.append((x, route))
    return out


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(*batch).float().pow(2).mean()


def figures(result: dict) -> list:
    """Every float of every layer, as text: ``repr`` keeps a float exactly, and nan equals nan."""
    return [(fqn, repr(dataclasses.astuple(s))) for fqn, s in result.items()]


@pytest.mark.parametrize(("recipe", "autocast"), [
    ("tensorwise", torch.bfloat16), ("tensorwise", torch.float16), ("tensorwise", None),
    ("rowwise", torch.bfloat16), ("rowwise", None), ("rowwise_with_gw_hp", None),
])
def test_the_probe_measures_what_the_reference_measures(recipe, autocast):
    if recipe != "tensorwise" and autocast is not None:
        skip_where_torchao_rowwise_cannot_autocast()
    model = Routed()
    layers = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    config = probe_config(recipe)
    probe = SensitivityProbe(layers, config, keep_outputs=True)
    reference = ReferenceProbe(layers, config)
    for batch in edge_batches():
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_of(model, batch)
        outputs, probe.outputs = probe.outputs, []
        torch.autograd.grad(loss, outputs, allow_unused=True)  # as fp8_sensitivity does: no parameter's .grad
        probe.commit()
        reference.commit()
    probe.close()
    reference.close()
    measured, expected = probe.result(), reference.result()
    assert set(measured) == set(layers) and (probe.batches, probe.dropped) == (reference.batches, reference.dropped)
    assert probe.batches + probe.dropped == 7 and probe.dropped >= 2  # the inf and the nan batch, at least
    assert figures(measured) == figures(expected)
    # The subnormals and the outliers flush values: the edge is exercised.
    assert any(n.underflow > 0 for s in measured.values() for n in s.tensors().values())


def test_layers_auto_makes_the_plan_the_reference_numbers_make():
    """A Fabric loop under ``FP8Precision(layers="auto")``: the weights move between the measured batches (the
    optimizer steps), the reference measures beside the plugin's probe, and the plan it decides is the plugin's."""
    plugin = FP8Precision(layers="auto", calibration_batches=5, emulate=True, skip_small_layers=False,
                          skip_first_last=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = Routed()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-5))
    raw = model.module
    layers = {fqn: m for fqn, m in raw.named_modules() if isinstance(m, nn.Linear)}
    reference = ReferenceProbe(layers, plugin._probe_config())
    decisions = None
    with pytest.warns(UserWarning, match="2 of the 5 batches"):
        for batch in edge_batches()[:5]:  # the plan is made at the fifth step
            assert plugin._calibration is not None
            decisions = decisions or plugin._calibration.decisions
            fabric.backward(loss_of(model, batch))
            reference.commit()
            optimizer.step()
            optimizer.zero_grad()
    reference.close()
    assert plugin.plan is not None and plugin.plan.batches == 3 and decisions is not None
    expected = PrecisionPlan.decide(decisions, reference.result(), plugin.plan_rule, plugin.scaling_family,
                                    high=plugin._high)
    assert plugin.plan == expected or repr(plugin.plan) == repr(expected)
    assert all(p.numbers for p in plugin.plan.layers)  # every layer judged on its figures


def test_rowwise_with_gw_hp_measures_a_layer_whose_input_is_fp32_under_bf16_autocast():
    """The probe used to run torchao's whole backward, weight gradient included, which under that recipe is a matmul
    in high precision of the bf16 output gradient and the fp32 input: it failed on CPU ("expected m1 and m2 to have
    the same dtype"). The probe reads only the input gradient, and no longer computes the weight's."""
    from lightning_precision.fp8._sensitivity import fp8_sensitivity

    skip_where_torchao_rowwise_cannot_autocast()
    torch.manual_seed(0)
    result = fp8_sensitivity(nn.Linear(64, 32), [torch.randn(8, 64)], recipe="rowwise_with_gw_hp",
                             loss_fn=lambda m, b: m(b).float().pow(2).sum())
    assert 0 < result[""].grad_input_error < 0.2 and 0 < result[""].output_error < 0.2


# ---- under torch.compile: measuring runs eagerly, and says so once ---------------------------------------------------


def fabric_auto_fit(compiled: bool, steps: int = 4) -> FP8Precision:
    plugin = FP8Precision(layers="auto", calibration_batches=3, emulate=True, skip_small_layers=False,
                          skip_first_last=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = Routed()
    # The eager backend: dynamo's frames and guards as inductor's, without its minutes of code generation.
    model, optimizer = fabric.setup(cast(nn.Module, torch.compile(model, backend="eager")) if compiled else model,
                                    torch.optim.SGD(model.parameters(), lr=1e-5))
    for batch in edge_batches()[:steps]:
        fabric.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    return plugin


def test_calibration_of_a_compiled_model_says_once_that_it_runs_eagerly(monkeypatch):
    from torch._dynamo import eval_frame

    from lightning_precision.fp8 import _sensitivity

    monkeypatch.setattr(_sensitivity._Eager, "said", False, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin = fabric_auto_fit(compiled=True)
        fp8_sensitivity(cast(nn.Module, torch.compile(Routed(), backend="eager")), edge_batches()[:1], loss_fn=loss_of)
    said = [w for w in seen if "runs the compiled model eagerly" in str(w.message)]
    assert len(said) == 1 and said[0].category is UserWarning  # three measured batches and a measurement: once
    assert plugin.plan is not None and eval_frame._stance.stance == "default"  # compiled again after the plan


def test_calibration_of_an_eager_model_says_nothing_about_compiling(monkeypatch):
    from lightning_precision.fp8 import _sensitivity

    monkeypatch.setattr(_sensitivity._Eager, "said", False, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin = fabric_auto_fit(compiled=False)
    assert plugin.plan is not None
    assert not [w for w in seen if "compiled" in str(w.message)]


def test_a_replaced_weight_is_measured_not_the_one_the_fp8_copy_was_made_over():
    """The probe keeps one fp8 copy per layer over views of its weight and bias: an optimizer's in-place update is
    seen through them, and a weight replaced (``.data`` set, a new Parameter) makes a new copy."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    config = probe_config("tensorwise")
    probe, reference = SensitivityProbe({"l": layer}, config), ReferenceProbe({"l": layer}, config)
    for change in (None, "in place", ".data", "parameter"):
        if change == "in place":
            with torch.no_grad():
                layer.weight.mul_(3.0)
        elif change == ".data":
            layer.weight.data = layer.weight.data * -2.0
        elif change == "parameter":
            layer.bias = nn.Parameter(torch.full((16,), 5.0))
        layer(torch.randn(8, 32)).pow(2).sum().backward()
        probe.commit()
        reference.commit()
        assert figures(probe.result()) == figures(reference.result()), change
    probe.close()
    reference.close()
