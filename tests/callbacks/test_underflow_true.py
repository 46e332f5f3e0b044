"""GradientUnderflowMonitor under the true-precision plugins, on real fits: gradients that are already 16-bit (and, in
fp16, still at the loss scale when the hooks see them), and what rounding the new weights loses."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_precision import BF16TruePrecision, FP16TruePrecision
from lightning_precision import fabric as lp_fabric
from lightning_precision.callbacks import GradientUnderflowMonitor
from lightning_precision.functional import underflow_stats
from tests.callbacks.test_underflow_monitor import GradCapture, TinyGrads
from tests.helpers import LitNet, count_host_reads, loader, make_data, trainer


@pytest.mark.parametrize("plugin", [FP16TruePrecision, BF16TruePrecision], ids=["fp16", "bf16"])
def test_true_gradients_are_measured_unscaled(plugin):
    """fp16 gradients at the loss scale S: the figures are those of g / S (in fp32), the fp16 question of g / S * S (the
    gradients as they are, which no fp16 cast flushes), never of g * S * S. bf16 gradients are bf16 already: casting
    them to bf16 flushes nothing; what the bf16 backward flushed is an exact zero."""
    monitor = GradientUnderflowMonitor(top_k=0, warn_threshold=1.0, probe_factor=None)
    capture = GradCapture()
    t = trainer(plugin(), max_steps=4, log_every_n_steps=4, callbacks=[monitor, capture])
    t.fit(TinyGrads(), loader(make_data(4)))

    grads, scale = capture.grads[-1], capture.scales[-1]  # step 4 is the logging step
    assert all(g.dtype == (torch.float16 if plugin is FP16TruePrecision else torch.bfloat16) for g in grads.values())
    unscaled = {n: g.float() / (scale or 1.0) for n, g in grads.items()}
    logged = t.callback_metrics
    for fmt in ("fp16", "bf16", "e4m3fn", "e5m2"):
        direct = underflow_stats(unscaled, fmt).total
        assert float(logged[f"precision/underflow/{fmt}"]) == pytest.approx(float(direct.underflow_fraction))
        assert float(logged[f"precision/overflow/{fmt}"]) == pytest.approx(float(direct.overflow_fraction))
    assert float(logged["precision/exact_zero"]) == pytest.approx(float(underflow_stats(unscaled, "fp16").total
                                                                        .exact_zero_fraction))
    # The case is not vacuous: unscaled, a good share of these gradients would flush in fp16.
    assert float(logged["precision/underflow/fp16"]) > 0.01
    assert float(logged["precision/underflow/bf16"]) == 0.0
    if plugin is FP16TruePrecision:
        assert scale is not None and scale > 1
        # At the scale they carry, the fp16 gradients are what they are: nothing flushes, nothing overflows.
        assert float(logged["precision/underflow/fp16/scaled"]) == 0.0
        assert float(logged["precision/overflow/fp16/scaled"]) == 0.0
    else:
        assert scale is None and "precision/underflow/fp16/scaled" not in logged


class SmallLoss(LitNet):
    """The loss times 1e-5: at a loss scale of 1, fp16's backward flushes about 30% of the gradients."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-5


def test_fp16_true_flushed_gradients_are_underflow_not_exact_zeros():
    """The loss of a true fp16 model is fp16 itself: the probe's scale must fit fp16 at the root (2**16 is inf there),
    or every probe overflows, what the backward flushed counts as exact zeros and the advice lowers the scale."""
    figures = {}
    for name, plugin in (("fp32", None), ("fp16", FP16TruePrecision(init_scale=1.0))):
        monitor = GradientUnderflowMonitor(top_k=0, warn_threshold=1.0)
        t = trainer(plugin, max_steps=1, log_every_n_steps=1, callbacks=[monitor])
        t.fit(SmallLoss(), loader(make_data(1)))
        figures[name] = ({k: float(v) for k, v in t.callback_metrics.items()}, monitor.recommend_loss_scale().scale)
    (fp32, _), (fp16, advice) = figures["fp32"], figures["fp16"]
    assert fp16["precision/underflow/fp16/lost"] > 0.2
    assert fp16["precision/underflow/fp16/scaled"] >= fp16["precision/underflow/fp16/lost"]
    assert fp16["precision/exact_zero"] == pytest.approx(fp32["precision/exact_zero"], abs=0.01)
    assert advice > 1  # raise the scale, not lower it


def test_fp16_true_probe_without_headroom_reports_no_loss():
    """At a loss scale of 2**15 no larger probe fits an fp16 loss: what was lost is unknown (not logged, not 0), and
    that is no overflow (the probe factor stays)."""
    monitor = GradientUnderflowMonitor(top_k=0, warn_threshold=1.0)
    t = trainer(FP16TruePrecision(init_scale=2.0**15), max_steps=2, log_every_n_steps=1, callbacks=[monitor])
    t.fit(TinyGrads(), loader(make_data(2)))
    assert "precision/underflow/fp16/scaled" in t.callback_metrics
    assert "precision/underflow/fp16/lost" not in t.callback_metrics
    assert monitor.probe_factor == 2.0**16


class Regression(L.LightningModule):
    """The stall of a plain 16-bit step, small: a 16x16 linear map with weights near 1.0 fitted by AdamW at lr 1e-4.
    Each update (about 1e-4) is under half a bf16 ulp of its weight (2**-9 at 1.0): rounding to nearest drops all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            self.layer.weight.copy_(1.0 + 0.01 * torch.randn(16, 16))
        self.target = torch.randn(16, 16)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return torch.nn.functional.mse_loss(self.layer(x), x @ self.target.to(x))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def regression_data(steps):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(steps * 8, 16)), batch_size=8)


class ArmedAt(Callback):
    """After the monitor: whether the plugin's step is counting at each optimizer step."""

    def __init__(self):
        self.armed = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.armed.append(trainer.precision_plugin.true_step.meter is not None)


@pytest.mark.parametrize("update", ["nearest", "stochastic", "compensated"])
def test_update_lost_to_nearest_on_the_stalling_regression(update):
    """What rounding to nearest loses is reported whatever the plugin's own rounding (near 1 here, as Lightning's
    bf16-true loses every update); `update_moved` says what the plugin's rounding kept in the bf16 weight."""
    # optimizer_states="float32": update="nearest" then goes through the fp32 step (with "weight" states it is
    # Lightning's own bf16 step, which has no fp32 update to measure: test_parity_step_reports_no_update below).
    plugin = BF16TruePrecision(update=update, optimizer_states="float32")
    monitor, armed = GradientUnderflowMonitor(top_k=0, warn_threshold=1.0), ArmedAt()
    model = Regression()
    initial = model.layer.weight.detach().to(torch.bfloat16).clone()
    t = trainer(plugin, max_steps=4, log_every_n_steps=2, callbacks=[monitor, armed])
    t.fit(model, regression_data(4))

    logged = {k: float(v) for k, v in t.callback_metrics.items()}
    assert armed.armed == [False, True, False, True]  # the measuring steps only
    assert plugin.true_step.meter is None  # left as found
    assert logged["precision/update_lost/bf16"] > 0.99
    moved = logged["precision/update_moved/bf16"]
    changed = (model.layer.weight.detach() != initial).float().mean().item()
    if update == "nearest":
        assert moved == pytest.approx(1 - logged["precision/update_lost/bf16"])
        assert changed < 0.01  # it stalls
    elif update == "stochastic":
        assert 0 < moved < 0.2 and changed > 0.01  # same updates, yet its weights move (unbiased, a few at a time)
    else:  # the bf16 weight rarely changes; its remainder holds the rest of each update
        assert moved < 0.2


def test_parity_step_reports_no_update():
    """bf16 + "nearest" + "weight" states steps as Lightning's bf16-true does, in bf16, with no fp32 update to compare:
    nothing is logged rather than a number that was not measured."""
    t = trainer(BF16TruePrecision(update="nearest"), max_steps=2, log_every_n_steps=1,
                callbacks=[GradientUnderflowMonitor(top_k=0, warn_threshold=1.0)])
    t.fit(Regression(), regression_data(2))
    assert "precision/underflow/bf16" in t.callback_metrics
    assert not [k for k in t.callback_metrics if k.startswith("precision/update_")]


def test_fp16_update_with_large_steps_is_not_lost():
    """SGD at lr 0.1 moves fp16 weights by far more than half an ulp: little is lost, and it is keyed fp16."""
    t = trainer(FP16TruePrecision(init_scale=2.0**10), max_steps=3, log_every_n_steps=3,
                callbacks=[GradientUnderflowMonitor(top_k=0, warn_threshold=1.0)])
    t.fit(LitNet(), loader(make_data(3)))
    logged = {k: float(v) for k, v in t.callback_metrics.items()}
    assert logged["precision/update_lost/fp16"] < 0.5
    assert logged["precision/update_moved/fp16"] > 0.5
    assert "precision/update_lost/bf16" not in logged


def test_measuring_changes_no_weight():
    """The same stochastic fit with and without the monitor (which measures every step): bit-identical weights (the
    count draws no random number and writes nothing)."""
    weights = []
    for callbacks in ([], [GradientUnderflowMonitor(top_k=0, warn_threshold=1.0, measure_every_n_steps=1)]):
        model = Regression()
        trainer(BF16TruePrecision(), max_steps=3, callbacks=callbacks).fit(model, regression_data(3))
        weights.append(model.layer.weight.detach().clone())
    assert torch.equal(*weights)


def test_fabric_measures_the_update_it_is_told_to():
    """Fabric: `with monitor.measuring_update(plugin): optimizer.step()`, then `compute()` holds what rounding lost;
    fp16 gradients at the loss scale go in with `carries_scale=True` (asked for without a scale: a clear error)."""
    plugin = lp_fabric.BF16TruePrecision()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = Regression()
    model, optimizer = fabric.setup(module.layer, torch.optim.AdamW(module.layer.parameters(), lr=1e-4))
    monitor = GradientUnderflowMonitor(formats="fp16", top_k=0, warn_threshold=1.0)
    for step, (x,) in enumerate(regression_data(2)):
        fabric.backward(torch.nn.functional.mse_loss(model(x), x @ module.target.to(x)))
        if step == 1:
            monitor.measure_gradients({n: p.grad for n, p in model.named_parameters()})
            with monitor.measuring_update(plugin):
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad()
    metrics = monitor.compute()
    assert float(metrics["precision/update_lost/bf16"]) > 0.99 and "precision/underflow/fp16" in metrics
    with monitor.measuring_update(lp_fabric.BF16MixedPrecision()):  # no rounding of weights there: nothing counted
        pass
    assert not [k for k in monitor.compute() if k.startswith("precision/update_")]
    with pytest.raises(ValueError, match=r"measure_gradients\(carries_scale=True\).*loss_scale="):
        monitor.measure_gradients({}, carries_scale=True)


class ReadsPerStep(Callback):
    """Host reads (item, float, int, bool) between each batch's start and end, the optimizer step included."""

    def __init__(self, reads):
        self.reads, self.per_step = reads, []

    def on_train_batch_start(self, *args):
        self.reads[0] = 0

    def on_train_batch_end(self, *args):
        self.per_step.append(self.reads[0])


def test_measuring_steps_that_log_nothing_read_nothing(monkeypatch):
    """Measuring every step (the meter in the optimizer step each time), logging every 3rd: the steps that log nothing
    read the device no more often than a fit without the monitor does (the plugin's own inf/nan check; on a CPU the
    unmeasured step also reads whether its new weights all fit, which a measured step checks element-wise)."""
    reads = count_host_reads(monkeypatch)
    runs = []
    for monitor in ([], [GradientUnderflowMonitor(top_k=0, warn_threshold=1.0, measure_every_n_steps=1,
                                                  log_every_n_steps=3)]):
        recorder = ReadsPerStep(reads)
        trainer(BF16TruePrecision(), max_steps=6, callbacks=[*monitor, recorder]).fit(Regression(), regression_data(6))
        runs.append(recorder.per_step)
    monkeypatch.undo()
    plain, measured = runs
    # Step 0 is left out: the first measurement builds the formats' constant tables from Python numbers, once (CPU
    # tensors read on the host; nothing of the model's).
    assert all(measured[i] <= plain[i] for i in (1, 3, 4)), (measured, plain)
    assert measured[2] > plain[2] and measured[5] > plain[5]  # the logging steps do read: the test is not vacuous


class FailingAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        raise RuntimeError("the optimizer failed")


class FailingStep(Regression):
    def configure_optimizers(self):
        return FailingAdamW(self.parameters(), lr=1e-4)


def test_a_fit_that_raises_in_the_step_takes_the_meter_back():
    """Teardown does not run when a fit raises: the meter is taken back on the exception, so the plugin (which may be
    fitted again) counts nothing for a monitor that no longer reads it."""
    plugin = BF16TruePrecision()
    with pytest.raises(RuntimeError, match="the optimizer failed"):
        trainer(plugin, max_steps=2, log_every_n_steps=1,
                callbacks=[GradientUnderflowMonitor(top_k=0, warn_threshold=1.0)]).fit(FailingStep(), regression_data(2))
    assert plugin.true_step.meter is None
