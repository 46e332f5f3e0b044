"""Edges of the fp8 plan (issue 38): a resumed run reports the layers the run stepped down as the run did, and a batch
whose loss is not finite is left out of ``layers="auto"``'s measuring. Real torchao (``emulate=True``), real Trainer
and Fabric fits."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import FP8Precision, PrecisionPlan
from lightning_precision import fabric as lp_fabric
from lightning_precision.fp8._plan_types import LayerPlan
from tests.callbacks.test_guard_ladder import Net  # dims and tokens multiples of 32: every layer runs MXFP8
from tests.fp8.test_plan import FP8_KW, Lit, batches, loader
from tests.helpers import has_mxfp8

pytest.importorskip("torchao")


@pytest.mark.skipif(not has_mxfp8(), reason="this torchao has no MXFP8 training layer (torchao 0.11)")
@pytest.mark.parametrize("load", ["before setup", "after setup"])
def test_a_resumed_run_reports_the_layers_it_stepped_down_as_the_run_did(load):
    """A tensorwise plugin's MXFP8 layer (a plan of mixed formats) stepped down to tensorwise, the recipe's own format:
    the decisions say ``format=None`` (the recipe, as for every other tensorwise layer) in the run and in the run
    resumed from its state, loaded before conversion (the plan to convert with) or after it (the layer is already
    where the checkpoint put it: the plan in force still says why). Before, the resumed run reported another format
    than the run, or (loaded after conversion) lost the stepped-down layer from its plan."""
    plan = PrecisionPlan(tuple(LayerPlan(f, "mxfp8" if f == "b" else "fp8", "given") for f in ("a", "b", "head")))
    x = torch.randn(32, 64)

    models = []  # held: the plugin's layer book holds its model weakly

    def run(plugin: lp_fabric.FP8Precision, state: dict | None = None) -> lp_fabric.FP8Precision:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        if state is not None and load == "before setup":
            plugin.load_state_dict(state)
        model = fabric.setup_module(Net())
        if state is not None and load == "after setup":
            plugin.load_state_dict(state)  # as the Trainer restores: after the conversion
        fabric.backward(model(x).float().mean())
        models.append(model)
        return plugin

    first = run(lp_fabric.FP8Precision(recipe="tensorwise", layers=plan, **FP8_KW))
    assert first.step_down({"b": "by hand"}) == {"b": "tensorwise"}
    resumed = run(lp_fabric.FP8Precision(recipe="tensorwise", **FP8_KW), first.state_dict())

    def seen(p: lp_fabric.FP8Precision) -> tuple:
        return ([(d.fqn, d.fp8, d.format) for d in p.layer_decisions],
                {f: p.plan_in_force().format_of(f) for f in ("a", "b", "head")}, p.plan_in_force().get("b").reason,
                sorted(p.metrics()))

    assert seen(first)[0] == [("a", True, None), ("b", True, None), ("head", True, None)]
    assert seen(resumed) == seen(first)
    assert seen(first)[1:3] == ({"a": "fp8", "b": "tensorwise", "head": "fp8"}, "by hand")


@pytest.mark.parametrize("loop", ["fabric", "trainer"])
def test_a_batch_whose_loss_is_not_finite_is_left_out_of_the_measuring(loop):
    """``layers="auto"``: the first batch's loss is inf (a penalty term no layer's gradient carries: inputs and
    gradients finite), so it is left out with the warning, and the plan rests on the other batch. Before, it was
    measured, silently."""
    inf = torch.tensor(float("inf"))
    if loop == "fabric":
        plugin = lp_fabric.FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = Lit().net
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        with pytest.warns(UserWarning, match=r"1 of the 2 batches measured .* non-finite loss"):
            for i, (x, y) in enumerate(batches(3)):
                fabric.backward(nn.functional.cross_entropy(model(x).float(), y) + (inf if i == 0 else 0))
                optimizer.step()
                optimizer.zero_grad()
    else:
        class InfFirst(Lit):
            def training_step(self, batch, batch_idx):
                return super().training_step(batch, batch_idx) + (inf if batch_idx == 0 else 0)

        plugin = FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
        trainer = L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=3, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False)
        with pytest.warns(UserWarning, match=r"1 of the 2 batches measured .* non-finite loss"):
            trainer.fit(InfFirst(), loader(3))
    assert plugin.plan is not None and plugin.plan.batches == 1
