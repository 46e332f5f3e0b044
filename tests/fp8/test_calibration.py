"""``FP8Precision(layers="auto")``: what a batch is, what is reported while measuring, a run that ends early, a plugin
used for a second model, and batches with non-finite values.

Real torchao (``emulate=True``), real Trainer and Fabric fits on tests/fp8/test_plan.py's model: ``b`` is fed outlier
channels and ``c``'s output gradients are ~1e-23, so a measured plan keeps both in bf16 and the other three in fp8.
"""

from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_precision import FP8Precision, NoEffectWarning
from lightning_precision import fabric as lp_fabric
from lightning_precision.callbacks import FP8Guard
from tests.fp8.test_plan import FP8_KW, Lit, Outliers, batches, fit, loader

pytest.importorskip("torchao")

LAYERS = ("a", "b", "c", "d", "head")
MEASURED = {"net.a", "net.d", "net.head"}  # the plan tests/fp8/test_plan.py's model gets


def fp8_now(net: nn.Module) -> set[str]:
    return {f"net.{n}" for n in LAYERS if type(getattr(net, n)).__name__ == "Float8Linear"}


class Record(Callback):
    """Per training batch: the layers it runs in fp8 and those the plugin reports fp8 (at its start), and the plugin's
    metrics after it."""

    def __init__(self) -> None:
        self.converted, self.reported, self.metrics, self.reasons = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        plugin = trainer.precision_plugin
        self.converted.append(fp8_now(pl_module.net))
        self.reported.append({d.fqn for d in plugin.layer_decisions if d.fp8})
        self.reasons.append({d.fqn: d.reason for d in plugin.layer_decisions})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.precision_plugin.metrics().items()})


# ---- nothing unmeasured is called fp8 ------------------------------------------------------------------------


def test_while_measuring_no_layer_is_reported_fp8():
    plugin, record = FP8Precision(layers="auto", calibration_batches=3, **FP8_KW), Record()
    fit(plugin, 5, callbacks=[record])
    assert record.converted == [set()] * 3 + [MEASURED] * 2
    assert record.reported == record.converted  # layer_decisions say what runs
    # 0 while measuring; after the conversion (at batch 2's optimizer step), known from the next backward on.
    assert [m.get("precision/fp8_layers") for m in record.metrics] == [0.0, 0.0, None, 3.0, 3.0]
    assert record.reasons[0]["net.a"].startswith("layers='auto': not measured yet")
    assert plugin.plan.batches == 3


def test_a_fit_that_ends_while_measuring_reports_no_fp8_and_the_guard_writes_no_plan(tmp_path):
    plugin, guard = FP8Precision(layers="auto", calibration_batches=4, **FP8_KW), FP8Guard(every_n_steps=1)
    with pytest.warns(NoEffectWarning, match="ended after 2 of the 4 batches to measure"):
        fit(plugin, 2, callbacks=[guard], default_root_dir=tmp_path)
    assert plugin.plan is None and plugin.plan_in_force() is None
    assert not any(d.fp8 for d in plugin.layer_decisions)
    assert {d.reason for d in plugin.layer_decisions if d.fqn in MEASURED} == {
        "layers='auto': training ended after 2 of the 4 batches to measure; not measured, not fp8"}
    assert float(plugin.metrics()["precision/fp8_layers"]) == 0
    assert guard.plan_file is None and list(tmp_path.glob("*.yaml")) == []  # no unmeasured plan saved


def test_between_fits_the_model_carries_no_measuring_hooks_and_a_later_fit_measures_on():
    """A fit that ends while measuring (and a validate before any fit) left the probe's forward hooks on the layers:
    `torch.save(model)` failed on them (local functions do not pickle), and every later forward with gradients (a loop
    of the user's) was measured, into the plugin's sums. They are removed at teardown and put back when training goes
    on: the next fit measures the remaining batches and decides."""
    import io

    class Validated(Lit):
        def validation_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]).float(), batch[1])

    plugin, module = FP8Precision(layers="auto", calibration_batches=4, **FP8_KW), Validated()
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.validate(module, loader(1))
    assert all(not m._forward_hooks for m in module.net.children())
    with pytest.warns(NoEffectWarning, match="ended after 2 of the 4 batches to measure"):
        fit(plugin, 2, module)
    assert all(not m._forward_hooks for m in module.net.children())
    torch.save(module.net, io.BytesIO())
    staged = plugin._calibration.probe.state["staged"].clone()
    module.net(torch.randn(4, 64)).sum().backward()  # the user's own forward and backward between fits
    assert torch.equal(plugin._calibration.probe.state["staged"], staged)
    fit(plugin, 4, module)
    assert plugin.plan.batches == 4 and plugin.plan.fp8_layers == MEASURED
    assert fp8_now(module.net) == MEASURED


# ---- a batch is a training step, whatever the optimizers and accumulation ------------------------------------


class TwoOptimizers(Lit):
    """Manual optimization, one backward and two optimizers per batch (one for ``a``/``b``, one for the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.fp8_at_start: list[set[str]] = []

    def training_step(self, batch, batch_idx):
        self.fp8_at_start.append(fp8_now(self.net))
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        self.losses.append(loss.item())
        first, second = self.optimizers()
        self.manual_backward(loss)
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()

    def configure_optimizers(self):
        ab = [*self.net.a.parameters(), *self.net.b.parameters()]
        rest = [p for n, p in self.net.named_parameters() if not n.startswith(("a.", "b."))]
        return torch.optim.SGD(ab, lr=0.01), torch.optim.SGD(rest, lr=0.01)


def test_two_optimizers_per_batch_measure_every_batch_asked_for():
    """Counting optimizer steps stopped after 2 of 4 batches (and recorded 4)."""
    plugin, module = FP8Precision(layers="auto", calibration_batches=4, **FP8_KW), TwoOptimizers()
    L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=12, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False).fit(module, loader(6))
    # Batches 0-3 start in bf16; the plan is made at the first optimizer step of batch 3, when 4 were measured.
    assert module.fp8_at_start == [set()] * 4 + [MEASURED] * 2
    assert plugin.plan.batches == 4 and plugin.plan.fp8_layers == MEASURED


@pytest.mark.parametrize(("asked", "measured"), [(8, 8), (6, 8), (2, 4)])
def test_gradient_accumulation_measures_the_batches_asked_and_records_what_it_measured(asked, measured):
    """4 batches per optimizer step. Counting optimizer steps measured 32 batches for 8 asked (and recorded 8). The plan
    is made at an optimizer step, never mid-accumulation: asking 6 measures 8, asking 2 measures 4, and the plan says
    so."""
    plugin, record = FP8Precision(layers="auto", calibration_batches=asked, **FP8_KW), Record()
    L.Trainer(accelerator="cpu", plugins=[plugin], callbacks=[record], max_steps=3, accumulate_grad_batches=4,
              logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
              ).fit(Lit(), loader(12))
    assert plugin.plan.batches == measured and plugin.plan.fp8_layers == MEASURED
    assert record.converted == [set()] * measured + [MEASURED] * (12 - measured)


def test_fabric_counts_each_backward_as_a_batch():
    """Fabric has no training-step hook: a backward pass is a batch. Two accumulated backward passes per step, 3 asked:
    the plan is made at the second optimizer step, from the 4 batches measured."""
    plugin = lp_fabric.FP8Precision(layers="auto", calibration_batches=3, **FP8_KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Outliers()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    data = batches(8)
    for step in range(4):
        for x, y in data[2 * step : 2 * step + 2]:
            fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            assert plugin.plan is None
    assert plugin.plan.batches == 4 and plugin.plan.fp8_layers == {"a", "d", "head"}


# ---- a plugin used for a second model ------------------------------------------------------------------------


class NoOutliers(Outliers):
    """The same layers without the outlier channels: ``b`` measures well here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h))
        return self.head(torch.relu(self.d(h))) + self.c(x)[:, :16] * 1e-21


class Validated(Lit):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x).float(), y))


def test_a_second_model_is_measured_not_given_the_first_models_plan(tmp_path):
    """The plan of one model says nothing of another (its weights, its batches): the plugin measures again. The model
    it converted stays as it is (validate after fit), and a resumed run still applies its checkpoint's plan."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    plugin = FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
    trainer, first = fit(plugin, 3, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path,
                                                                                          filename="last")])
    first_plan = plugin.plan
    assert first_plan.fp8_layers == MEASURED

    second, record = Validated(), Record()
    second.net = NoOutliers()
    L.Trainer(accelerator="cpu", plugins=[plugin], callbacks=[record], max_steps=3, logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False).fit(second, loader(3))
    assert record.converted == [set(), set(), MEASURED | {"net.b"}]  # measured for 2 batches, then its own plan
    assert plugin.plan.fp8_layers == MEASURED | {"net.b"} and plugin.plan.get("net.b").numbers

    # The model already converted is left as it is: validating it neither measures nor converts again.
    trainer.validate(second, loader(1), verbose=False)
    assert plugin._calibration is None and fp8_now(second.net) == MEASURED | {"net.b"}

    # Resuming the first run, with this same plugin: the checkpoint's plan is applied at once, not measured again.
    resumed, record = Lit(), Record()
    L.Trainer(accelerator="cpu", plugins=[plugin], callbacks=[record], max_steps=4, logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
              ).fit(resumed, loader(4), ckpt_path=str(tmp_path / "last.ckpt"))
    assert plugin.plan == first_plan and record.converted == [MEASURED]


# ---- a batch with a non-finite value is a data fault --------------------------------------------------------


class SkipsNonFinite(Lit):
    """Puts an inf into batch ``bad``'s input and, as a careful user does, skips the step whose loss is not finite
    (returning None): the weights stay finite, and only the measurement sees the inf."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == self.bad:
            x = x.clone()
            x[0, 0] = math.inf
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss if torch.isfinite(loss) else None


def test_auto_leaves_a_batch_with_an_inf_out_of_the_measurement():
    """One inf used to count as overflow in every layer it reached: every layer failed the rule, nothing ran in fp8."""
    plugin = FP8Precision(layers="auto", calibration_batches=4, **FP8_KW)
    with pytest.warns(UserWarning, match=r"1 of the 4 batches measured .* non-finite .* plan is made from the other 3"):
        fit(plugin, 6, module=SkipsNonFinite(bad=1))
    assert plugin.plan.fp8_layers == MEASURED and plugin.plan.batches == 3
    assert all(p.numbers["input_overflow"] == 0 for p in plugin.plan.layers if p.numbers)


def test_auto_with_every_batch_non_finite_measures_nothing_and_says_so():
    class AllBad(SkipsNonFinite):
        def training_step(self, batch, batch_idx):
            self.bad = batch_idx
            return super().training_step(batch, batch_idx)

    plugin = FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
    with pytest.warns(UserWarning, match="2 of the 2 batches measured"):
        fit(plugin, 3, module=AllBad(bad=0))
    assert plugin.plan.fp8_layers == set() and plugin.plan.batches == 0
    assert plugin.plan.get("net.a").reason == "not measured: all 2 batches measured had non-finite values"


def test_fp16_compute_measures_again_the_batches_whose_step_the_loss_scaler_skipped():
    """With fp16 compute the loss scaler's first steps overflow until the scale has backed off (6 here, from 2**24):
    routine, not a fault of the data. Those batches used to be measured as non-finite and counted, so 3 asked were
    all spent on them, the warning blamed the data, and the plan kept every layer in high precision for the whole run.
    Now a batch whose step the scaler skipped is measured again, and the plan is made after 3 more."""
    from lightning_precision import ScalerConfig

    plugin = FP8Precision(layers="auto", calibration_batches=3, compute_dtype=torch.float16,
                          scaler=ScalerConfig(init_scale=2.0**24), **FP8_KW)
    record = Record()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning blames the data
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # Lightning's own, on this torch
        fit(plugin, 12, callbacks=[record])
    # 3 batches after the 6 skipped steps; the plan also keeps what the skipped ones measured with finite values
    assert plugin.skipped_steps == 6 and plugin.plan.batches >= 3
    assert plugin.plan.fp8_layers and plugin.plan.fp8_layers <= MEASURED | {"net.c"}
    assert record.converted == [set()] * 9 + [plugin.plan.fp8_layers] * 3


def test_the_guard_does_not_demote_for_a_non_finite_batch(tmp_path):
    """A measured step whose input holds an inf used to move every fp8 layer back to bf16 for good
    (tests/callbacks/test_guard.py's model, healthy throughout)."""
    from tests.callbacks import test_guard

    class GuardedSkipsNonFinite(test_guard.Lit):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 3:
                x = x.clone()
                x[0, 0] = math.inf
            loss = nn.functional.cross_entropy(self.net(x).float(), y)
            self.losses.append(loss.item())
            return loss if torch.isfinite(loss) else None

    plugin, guard = FP8Precision(**test_guard.FP8_KW), FP8Guard(every_n_steps=2)
    module = GuardedSkipsNonFinite(inject_at=10**9)
    with pytest.warns(UserWarning, match=r"FP8Guard: step 3 is not judged: a non-finite input, loss or gradient"):
        test_guard.fit(plugin, 6, [guard], module=module, default_root_dir=tmp_path)
    assert guard.events == [] and len(plugin.fp8_modules()) == 3  # steps 1 and 5 judged, step 3 not
    assert all(math.isfinite(v) for i, v in enumerate(module.losses) if i != 3)


def test_fp8_sensitivity_leaves_out_a_non_finite_batch():
    from lightning_precision.fp8._sensitivity import fp8_sensitivity

    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]).float(), b[1])

    data = batches(3)
    clean = fp8_sensitivity(Outliers(), data[:2], loss_fn=loss_fn)
    bad = (data[2][0].clone(), data[2][1])
    bad[0][5, 7] = math.nan
    with pytest.warns(UserWarning, match=r"fp8_sensitivity: 1 of 3 batches had a non-finite"):
        result = fp8_sensitivity(Outliers(), [data[0], bad, data[1]], loss_fn=loss_fn)
    assert result == clean and {s.batches for s in result.values()} == {2}


def test_an_fp8_result_that_overflows_where_fp32_does_not_still_fails():
    """The finite check covers what the layer is given and the fp32 result, not fp8's result: an fp8 output that is
    inf where fp32's is finite is fp8 failing. Two inputs summed, v and 0.97 * v: e4m3 rounds the second up to v, so
    the fp8 sum (2 * v) passes fp32's max while the exact one (1.97 * v) stays below it."""
    from lightning_precision.fp8._sensitivity import fp8_sensitivity

    layer = nn.Linear(16, 16, bias=False)
    v = 3.39e38 / 1.97
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[0, :2] = 1.0
    x = torch.zeros(16, 16)
    x[0, 0], x[0, 1] = v, 0.97 * v
    model = nn.Sequential(layer)
    result = fp8_sensitivity(model, [x], loss_fn=lambda m, b: m(b).clamp(max=1.0).sum(), autocast_dtype=None)
    assert result["0"].batches == 1 and result["0"].output_error == math.inf
    # A nan error (an fp8 inf minus an fp8 inf) would pass every bound (nan > x is False): it counts as inf.
    from lightning_precision.fp8._sensitivity import _relative

    assert _relative(math.nan, 1.0) == math.inf and _relative(math.inf, 1.0) == math.inf


# ---- while measuring, compiled code runs eagerly; a fit that ends restores the stance -------------


def test_a_fit_that_ends_while_measuring_leaves_compiled_code_compiled_and_the_next_fit_measures_on():
    """The probe runs ``torch.compile``d code eagerly while it measures (its hooks would otherwise recompile per layer):
    a fit that ends before the plan closes it, so the process is not left running everything eagerly, and the next fit
    of the same model reopens it and measures the batches still missing."""
    from torch._dynamo import eval_frame

    plugin, module = FP8Precision(layers="auto", calibration_batches=4, **FP8_KW), Lit()
    with pytest.warns(NoEffectWarning, match="ended after 2 of the 4"):
        fit(plugin, 2, module=module)
    assert eval_frame._stance.stance == "default"
    fit(plugin, 3, module=module)  # 2 more batches measured, then the plan at the 4th's optimizer step
    assert plugin.plan is not None and plugin.plan.batches == 4 and plugin.plan.fp8_layers == MEASURED
    assert eval_frame._stance.stance == "default"
