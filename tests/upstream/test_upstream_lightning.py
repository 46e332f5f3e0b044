"""Canaries of the private Lightning names in ``lightning_precision/_upstream/lightning.py``: each exercises the
behaviour the package relies on against the installed Lightning, so that an upstream change fails here, loudly, with
the name, instead of misbehaving in a run."""

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
from lightning.fabric.utilities import throughput as fabric_throughput
from lightning.pytorch.callbacks import throughput_monitor as trainer_throughput
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

import lightning_precision
from lightning_precision import fabric as lp_fabric
from lightning_precision._upstream import lightning as upstream
from tests.helpers import LitNet, loader, make_data, trainer


def test_logging_cadence_and_step_counter_are_readable_from_a_real_fit():
    seen = []

    class Probe(LitNet):
        def on_before_optimizer_step(self, optimizer):
            seen.append((upstream.should_update_logs(self.trainer), upstream.batches_that_stepped(self.trainer)))

    trainer(None, max_steps=4, log_every_n_steps=2).fit(Probe(), loader(make_data(4)))
    assert seen == [(False, 0), (True, 1), (False, 2), (True, 3)]


def test_fused_optimizers_are_told_apart():
    params = [nn.Parameter(torch.zeros(2))]
    assert upstream.optimizer_handles_unscaling(torch.optim.Adam(params, fused=True))
    assert not upstream.optimizer_handles_unscaling(torch.optim.Adam(params))
    assert not upstream.optimizer_handles_unscaling(torch.optim.SGD(params, lr=0.1))


def test_outputs_are_cast_floating_only():
    out = upstream.convert_fp_tensor(torch.ones(2, dtype=torch.bfloat16), torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, torch.ones(2))
    assert upstream.convert_fp_tensor(torch.ones(2, dtype=torch.int64), torch.float32).dtype == torch.int64


@pytest.mark.parametrize("module", [fabric_throughput, trainer_throughput], ids=["fabric", "trainer"])
def test_throughput_monitors_count_our_plugins_at_their_dtype_and_others_as_before(module):
    """The dispatch both ThroughputMonitors ask is replaced once (however many plugins are built), answers our
    plugins' ``peak_flops_dtype`` and leaves every other plugin's answer to Lightning. The replacement lives while a
    plugin does (``_core/process_effects.py``): two are kept alive here (alone in its process, nothing else holds one)."""
    held = [lightning_precision.BF16MixedPrecision(), lightning_precision.BF16MixedPrecision()]
    dispatch = module._plugin_to_compute_dtype
    assert dispatch(lightning_precision.BF16MixedPrecision()) == torch.bfloat16
    assert dispatch(lp_fabric.FP16MixedPrecision()) == torch.float16
    assert dispatch(FabricMixed("bf16-mixed", "cpu")) == torch.bfloat16  # Lightning's own answer, untouched
    assert dispatch.__wrapped__(lightning_precision.BF16MixedPrecision()) == torch.float32  # what it would count
    assert not hasattr(dispatch.__wrapped__, "__wrapped__")  # not wrapped twice
    if module is trainer_throughput:
        assert dispatch(MixedPrecision("16-mixed", "cpu")) == torch.float16
    assert len(held) == 2


def test_the_fabric_monitor_measures_a_fabric_plugin_at_its_dtype(monkeypatch):
    """A real ``ThroughputMonitor`` on a real launched Fabric asks the peak FLOPs for the plugin's dtype. The peak
    table itself is Lightning's and knows no CPU: its lookup is recorded, not replaced."""
    asked = []
    monkeypatch.setattr(fabric_throughput, "get_available_flops", lambda device, dtype: asked.append(dtype))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[lp_fabric.BF16MixedPrecision()])
    fabric.launch()
    fabric_throughput.ThroughputMonitor(fabric)
    assert asked == [torch.bfloat16]


def test_fabric_wrapper_prefix_is_what_named_parameters_gives():
    model = L.Fabric(accelerator="cpu", devices=1).setup(nn.Sequential(nn.Linear(2, 2)))
    names = [n for n, _ in model.named_parameters()]
    assert names == [f"{upstream.FABRIC_MODULE_PREFIX}0.weight", f"{upstream.FABRIC_MODULE_PREFIX}0.bias"]
    assert [upstream.unwrapped_name(n) for n in names] == ["0.weight", "0.bias"]


def test_published_metrics_reach_the_loggers_and_callback_metrics_and_stay():
    """`publish_metrics` writes into the dict `trainer.callback_metrics` returns, the logger connector's own: values
    put there during a fit are still there at its end, beside what `self.log` put."""
    from tests.helpers import RecordingLogger

    class Publishing(LitNet):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx == 1:
                upstream.publish_metrics(self.trainer, {"published": 2.5}, upstream.batches_that_stepped(self.trainer),
                                         callback_metrics=True)

    logger = RecordingLogger()
    run = trainer(None, max_steps=4, log_every_n_steps=2, logger=logger)
    run.fit(Publishing(), loader(make_data(4)))
    assert float(run.callback_metrics["published"]) == 2.5 and "loss" in run.callback_metrics
    assert float(run.logged_metrics["published"]) == 2.5 and "loss" in run.logged_metrics
    steps = {key: step for step, metrics in logger.logged for key in metrics}
    assert steps["published"] == 1 and [s for s, m in logger.logged if "loss" in m][0] == 1  # the same step


def test_after_closure_runs_the_before_step_hooks_then_clips():
    """`after_closure` (Lightning's private `Precision._after_closure`): the callbacks' and the module's
    `on_before_optimizer_step` see the gradients before clipping, which clips at the Trainer's `gradient_clip_val`."""
    seen = []

    class Hooked(LitNet):
        def on_before_optimizer_step(self, optimizer):
            seen.append(max(p.grad.abs().max().item() for p in self.parameters()))

    class Scaled(LitNet):  # gradients far above the clip value, so clipping is visible
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * 1e4

    model = type("Both", (Scaled, Hooked), {})()
    run = trainer(None, max_steps=1, gradient_clip_val=1e-3, gradient_clip_algorithm="value")
    run.fit(model, loader(make_data(2)))  # a real fit: the Trainer the hooks and the clip value are read from
    loss = model.training_step(next(iter(loader(make_data(2)))), 0)
    loss.backward()
    before = max(p.grad.abs().max().item() for p in model.parameters())
    upstream.after_closure(run.precision_plugin, model, run.optimizers[0])
    after = max(p.grad.abs().max().item() for p in model.parameters())
    assert seen[-1] == before > 1e-3 and after == pytest.approx(1e-3)
