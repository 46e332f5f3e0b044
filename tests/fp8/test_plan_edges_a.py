"""The plan's edges of issue 38 (item 3): the GPU a plan predicts for when MXFP8 is a candidate, MXFP8 under fp16
autocast, and a model that is itself one ``nn.Linear``. Each cheap: a tiny model, a batch or two, no fit."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import PlanRule
from lightning_precision import fabric as lp_fabric
from lightning_precision.cli.plan import _parser
from lightning_precision.fp8 import _speed
from lightning_precision.fp8._make_plan import make_plan

pytest.importorskip("torchao")

FP8_KW = {"emulate": True, "skip_small_layers": False, "skip_first_last": False}
MX_FP16 = "torchao's MXFP8 casts take bf16 or fp32, not fp16"


def _batches(n: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(32, 64, generator=g) for _ in range(n)]


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).float().pow(2).mean()


def test_prediction_is_for_a_b200_when_a_candidate_needs_blackwell(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU of the table here: a plan predicts for an H100 SXM, but for a B200 when MXFP8 is weighed, and the plan
    command's help says so (it said an H100 SXM)."""
    monkeypatch.setattr(_speed, "_current_device", lambda: None)  # as on a CPU, whatever this machine has
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    kw = {"loss_fn": _loss, "plan_rule": PlanRule(error_budget=1.0), "skip_small_layers": False,
          "skip_first_last": False}
    assert make_plan(model, _batches(), candidates=("tensorwise",), **kw).device == "H100 SXM"  # chosen: a budget
    plan = make_plan(model, _batches(), candidates=("tensorwise", "mxfp8"), **kw)
    assert (plan.device, plan.device_here) == ("B200", False)
    assert _speed.speed_device("B200")[0].capability == (10, 0)
    help_text = " ".join(_parser().format_help().split())
    assert "a prediction for an H100 SXM, or for a B200 where a candidate needs Blackwell (mxfp8, nvfp4)" in help_text


def test_make_plan_refuses_mxfp8_under_fp16_as_the_plugin_does() -> None:
    """MXFP8 chosen under fp16 autocast made a plan `FP8Precision(compute_dtype=torch.float16)` refuses: refused
    before measuring, as the plugin refuses the same candidates."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    kw = {"loss_fn": _loss, "autocast_dtype": torch.float16, "skip_small_layers": False, "skip_first_last": False}
    with pytest.raises(ValueError, match=MX_FP16) as made:
        make_plan(model, _batches(), candidates=("tensorwise", "mxfp8"), plan_rule=PlanRule(error_budget=1.0), **kw)
    assert "autocast_dtype=torch.bfloat16" in str(made.value)
    with pytest.raises(ValueError, match=MX_FP16):
        lp_fabric.FP8Precision(layers="auto", candidates=("tensorwise", "mxfp8"), compute_dtype=torch.float16,
                               **FP8_KW)
    with pytest.raises(ValueError, match=MX_FP16):
        make_plan(model, _batches(), recipe="mxfp8", **kw)
    plan = make_plan(model, _batches(), candidates=("tensorwise",), plan_rule=PlanRule(error_budget=1.0), **kw)
    assert plan.get("0") is not None and plan.get("0").precision in ("tensorwise", "fp16")


def test_a_model_that_is_one_linear_is_refused_with_the_fix() -> None:
    """A bare nn.Linear (path '') crashed deep in the plan's types; now make_plan and Fabric's layers='auto' refuse it
    before measuring, and the fix they name (wrap it) gives a plan of its layer."""
    layer = nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"itself an nn.Linear.*nn.Sequential\(model\)"):
        make_plan(layer, _batches(), loss_fn=_loss, skip_small_layers=False, skip_first_last=False)
    plugin = lp_fabric.FP8Precision(layers="auto", calibration_batches=1, **FP8_KW)
    with pytest.raises(ValueError, match=r"FP8Precision\(layers='auto'\): the model is itself an nn.Linear"):
        L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(layer)
    plan = make_plan(nn.Sequential(layer), _batches(), loss_fn=_loss, skip_small_layers=False, skip_first_last=False)
    assert [p.fqn for p in plan.layers] == ["0"] and plan.layers[0].precision == "fp8"
