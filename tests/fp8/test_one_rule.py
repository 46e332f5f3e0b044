"""One rule for choose or decide (``lightning_precision/fp8/_decision.py``, ``chooses_formats``) across ``make_plan``,
the ``plan`` command and ``FP8Precision(layers="auto")``: one candidate and no error budget decides between that
format and high precision; several candidates, or a budget, choose among formats, weighing savings for a device.
``make_plan`` decides on its one candidate's own numbers; the plugin, which runs its recipe, takes a single candidate
only if it is that recipe; savings for a device or timed (``device``, ``benchmark``, ``--device``) without a choice
are refused, saying the fix."""

import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import FP8Precision, NVFP4Precision, PlanRule
from lightning_precision import fabric as lp_fabric
from lightning_precision.fp8._make_plan import make_plan
from tests import te_standin
from tests.helpers import rowwise_emulates_on_cpu

pytest.importorskip("torchao")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 16))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 64, generator=g), torch.randint(0, 16, (32,), generator=g))]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]).float(), batch[1])


def _calibrated(**kwargs) -> object:
    """The plan ``FP8Precision(layers="auto")`` makes under Fabric, calibrating on ``_batches()`` at lr 0."""
    plugin = lp_fabric.FP8Precision(layers="auto", emulate=True, calibration_batches=1, skip_small_layers=False,
                                    **kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.0))
    for batch in _batches() * 2:
        optimizer.zero_grad()
        fabric.backward(_loss(model, batch))
        optimizer.step()
    return plugin.plan


@pytest.mark.skipif(not rowwise_emulates_on_cpu(), reason="this torchao cannot emulate rowwise under CPU autocast")
def test_make_plan_decides_on_its_one_candidate_as_on_that_recipe():
    """``candidates=("rowwise",)`` and ``recipe="rowwise"``: the same plan, numbers included, whatever ``recipe`` says
    beside the candidate, and the plan the plugin makes with that recipe as its one candidate; a decision (fp8 or bf16
    per layer), not a choice, unless a budget asks to choose."""
    kwargs = dict(loss_fn=_loss, skip_small_layers=False)
    by_recipe = make_plan(_net(), _batches(), recipe="rowwise", **kwargs)
    assert make_plan(_net(), _batches(), candidates=("rowwise",), **kwargs) == by_recipe
    assert make_plan(_net(), _batches(), recipe="tensorwise", candidates=("rowwise",), **kwargs) == by_recipe
    assert _calibrated(recipe="rowwise", candidates=("rowwise",)) == by_recipe
    assert by_recipe.scaling_family == "rowwise" and math.isinf(by_recipe.rule.error_budget)
    assert {p.precision for p in by_recipe.layers} == {"fp8", "bf16"} and by_recipe.measured

    for choice in ({"device": "H100 SXM"}, {"benchmark": True}):
        with pytest.raises(ValueError, match=r"savings are weighed when choosing among formats.*error_budget"):
            make_plan(_net(), _batches(), candidates=("rowwise",), **choice, **kwargs)
    chosen = make_plan(_net(), _batches(), candidates=("rowwise",), device="H100 SXM",
                       plan_rule=PlanRule(error_budget=1.0), **kwargs)
    assert chosen.device == "H100 SXM" and {p.precision for p in chosen.layers} <= {"rowwise", "bf16"}


def test_the_plugin_takes_one_candidate_only_as_its_recipe(monkeypatch):
    """The plugin runs its recipe: a single other candidate would be measured and never run, so it is refused (the
    Trainer class and the Fabric class alike, a list as a tuple); the recipe itself, a budget, or several candidates
    are taken. Transformer Engine (its stand-in here) runs one recipe per model: its one candidate is the recipe."""
    for cls in (FP8Precision, lp_fabric.FP8Precision):
        for candidates in (("rowwise",), ["rowwise"]):
            with pytest.raises(ValueError, match=r"one candidate and no error budget .*'tensorwise'.*`recipe='rowwise'`"):
                cls(layers="auto", candidates=candidates, emulate=True)
        with pytest.raises(ValueError, match=r"recipe \('rowwise'\).*`recipe='tensorwise'`"):
            cls(layers="auto", recipe="rowwise", candidates=("tensorwise",), emulate=True)
        assert cls(layers="auto", recipe="rowwise", candidates=["rowwise"], emulate=True).candidates == ("rowwise",)
        assert cls(layers="auto", candidates=("tensorwise",), emulate=True).candidates == ("tensorwise",)
        assert cls(layers="auto", candidates=("tensorwise", "rowwise"), emulate=True)._choosing

    te_standin.install(monkeypatch)
    te = FP8Precision(backend="transformer_engine", layers="auto", candidates=("delayed",))
    assert te.candidates == ("delayed",) and not te._choosing
    with pytest.raises(ValueError, match=r"this plugin's recipe is 'current'"):
        FP8Precision(backend="transformer_engine", recipe="current", layers="auto", candidates=("delayed",))
    budgeted = FP8Precision(backend="transformer_engine", layers="auto", candidates=("delayed",),
                            plan_rule=PlanRule(error_budget=0.1))
    assert budgeted._choosing
    assert NVFP4Precision(layers="auto").candidates == lp_fabric.NVFP4Precision(layers="auto").candidates == ("nvfp4",)


def test_the_plan_command_weighs_savings_for_a_device_only_when_it_chooses(monkeypatch, capsys):
    """``--device`` with one candidate and no budget (or an infinite one) has nothing to weigh: a usage error, before
    anything is measured. One candidate alone is measured in its own format, a decision."""
    from lightning_precision.cli import plan

    calls = []

    def measured(*args, **kwargs):
        calls.append(kwargs)
        raise KeyboardInterrupt  # stop at the measuring: the arguments are what is checked

    monkeypatch.setattr(plan, "make_plan", measured)
    for budget in ([], ["--budget", "inf"]):
        assert plan.main(["--recipe", "vit", "--emulate", "--candidates", "rowwise", "--device", "H100 SXM",
                          *budget]) == 2
        assert "--device 'H100 SXM': savings are weighed when choosing among formats" in capsys.readouterr().err
    assert not calls
    with pytest.raises(KeyboardInterrupt):
        plan.main(["--recipe", "vit", "--emulate", "--batches", "1", "--candidates", "rowwise"])
    (kwargs,) = calls
    assert kwargs["candidates"] == ("rowwise",) and kwargs["device"] is None
    assert math.isinf(kwargs["plan_rule"].error_budget)
