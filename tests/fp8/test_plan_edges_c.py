"""Plan edges found by probing (issue 38): a layer named in a plan by another of its paths."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import PrecisionPlan
from lightning_precision import fabric as lp_fabric
from lightning_precision.fp8._plan_types import LayerPlan
from tests.fp8.test_plan import FP8_KW

pytest.importorskip("torchao")


class Aliased(nn.Module):
    """``a`` is registered twice, also as ``c``: one module, which ``named_modules()`` yields once, as ``a``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.c = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.c(x)))


def test_a_plan_may_name_a_layer_by_its_alias_and_two_names_must_agree():
    from torchao.float8.float8_linear import Float8Linear

    plan = PrecisionPlan((LayerPlan("c", "fp8", "by hand"), LayerPlan("b", "bf16", "by hand")))
    fabric = L.Fabric(accelerator="cpu", plugins=[lp_fabric.FP8Precision(layers=plan, **FP8_KW)])
    model = fabric.setup_module(Aliased())
    assert isinstance(model.module.a, Float8Linear) and model.module.c is model.module.a
    assert not isinstance(model.module.b, Float8Linear)
    assert {d.fqn: d.fp8 for d in fabric.strategy.precision.layer_decisions} == {"a": True, "b": False}
    fabric.backward(model(torch.randn(32, 64)).sum())  # it trains

    both = PrecisionPlan((LayerPlan("a", "fp8", "by hand"), LayerPlan("c", "bf16", "by hand")))
    fabric = L.Fabric(accelerator="cpu", plugins=[lp_fabric.FP8Precision(layers=both, **FP8_KW)])
    with pytest.raises(ValueError, match=r"'a' and 'c' are one layer .* 'fp8' and 'bf16'"):
        fabric.setup_module(Aliased())
