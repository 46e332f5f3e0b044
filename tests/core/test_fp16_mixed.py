"""FP16MixedPrecision: overflow handling, counters, schedulers, hooks, logging and checkpoints, on real fits."""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_precision
from lightning_precision import FP16MixedPrecision, ScalerConfig
from lightning_precision import fabric as lp_fabric
from tests.helpers import (
    LitNet,
    assert_params_equal,
    device_reads_per_step,
    fabric_loop,
    loader,
    make_data,
    params,
    trainer,
)


class Recorder(Callback):
    """Records weights before/after each batch, the learning rate, and what the hooks see."""

    def __init__(self):
        self.before, self.after, self.lrs, self.hook_loss, self.grad_norms = [], [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(params(pl_module))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(params(pl_module))

    def on_before_backward(self, trainer, pl_module, loss):
        self.hook_loss.append(float(loss))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def test_overflow_batch_is_skipped_and_training_continues():
    plugin = FP16MixedPrecision(init_scale=1024.0)
    rec = Recorder()
    model = LitNet()
    trainer(plugin, max_steps=6, callbacks=[rec]).fit(model, loader(make_data(6, overflow_batches=(2,))))

    assert not math.isfinite(model.losses[2])
    assert_params_equal(rec.before[2], rec.after[2])  # the skipped step changed nothing
    for step in (1, 3, 4, 5):  # the others did train
        assert not torch.equal(rec.before[step][0], rec.after[step][0])
    assert plugin.skipped_steps == 1
    assert plugin.loss_scale == 512.0  # backed off once by 0.5
    assert all(math.isfinite(loss) for i, loss in enumerate(model.losses) if i != 2)


def test_hooks_see_unscaled_loss_and_gradients():
    """Same fit in fp32 and fp16: the hooks must see values of the same magnitude, not 65536 times larger."""
    recs = {}
    for name, plugin in [("fp32", None), ("fp16", FP16MixedPrecision())]:
        recs[name] = Recorder()
        trainer(plugin, max_steps=3, callbacks=[recs[name]]).fit(LitNet(), loader(make_data(3)))
    torch.testing.assert_close(recs["fp16"].hook_loss, recs["fp32"].hook_loss, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(recs["fp16"].grad_norms, recs["fp32"].grad_norms, rtol=2e-2, atol=1e-3)


def test_gradient_clipping_sees_unscaled_gradients():
    """Clipping at 1e-3 must clip the real gradients: if it clipped scaled ones, the update would be 65536x smaller."""
    updates = {}
    for name, plugin in [("fp32", None), ("fp16", FP16MixedPrecision())]:
        model = LitNet()
        start = params(model)
        trainer(plugin, max_steps=1, gradient_clip_val=1e-3).fit(model, loader(make_data(1)))
        updates[name] = torch.cat([(a - b).flatten() for a, b in zip(params(model), start, strict=True)])
    torch.testing.assert_close(updates["fp16"], updates["fp32"], rtol=2e-2, atol=1e-7)


@pytest.mark.parametrize("skip", [True, False])
def test_schedulers_are_not_advanced_on_a_skipped_step(skip):
    rec = Recorder()
    plugin = FP16MixedPrecision(skip_schedulers_on_overflow=skip)
    trainer(plugin, max_steps=5, callbacks=[rec]).fit(LitNet(scheduler=True), loader(make_data(5, overflow_batches=(1,))))
    # StepLR halves every step; the overflow at batch 1 holds it for one batch when `skip` is on.
    expected = [0.1, 0.05, 0.05, 0.025, 0.0125] if skip else [0.1, 0.05, 0.025, 0.0125, 0.00625]
    assert rec.lrs == pytest.approx(expected)


def test_logs_at_the_logger_cadence(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    plugin = FP16MixedPrecision(growth_interval=2)
    t = trainer(plugin, max_steps=6, log_every_n_steps=3, logger=CSVLogger(tmp_path, name="run"))
    t.fit(LitNet(), loader(make_data(6, overflow_batches=(4,))))
    import csv

    rows = list(csv.DictReader(open(t.logger.experiment.metrics_file_path)))
    logged = {int(r["step"]): (float(r["precision/loss_scale"]), float(r["precision/skipped_steps"])) for r in rows}
    # Steps are 0-based: logged after the 3rd and the 6th optimizer step only.
    assert logged == {2: (2.0**17, 0.0), 5: (2.0**17, 1.0)}
    assert t.callback_metrics["precision/skipped_steps"] == 1


def test_resume_equals_uninterrupted(tmp_path):
    """4 steps, save, resume to 8 == 8 steps straight: weights, scale, growth tracker and counters.

    Epochs of 4 batches, stopped by ``max_epochs``: Lightning does not replay a data loader mid-epoch."""
    ds = make_data(4, overflow_batches=(1,))

    def plugin():
        return FP16MixedPrecision(init_scale=256.0, growth_interval=3)

    straight_plugin, straight = plugin(), LitNet(scheduler=True)
    trainer(straight_plugin, max_epochs=2).fit(straight, loader(ds))

    first = trainer(plugin(), max_epochs=1)
    first.fit(LitNet(scheduler=True), loader(ds))
    first.save_checkpoint(tmp_path / "half.ckpt")

    resumed_plugin, resumed = plugin(), LitNet(scheduler=True)
    trainer(resumed_plugin, max_epochs=2).fit(resumed, loader(ds), ckpt_path=tmp_path / "half.ckpt")

    assert_params_equal(params(resumed), params(straight))
    assert resumed_plugin.state_dict() == straight_plugin.state_dict()
    assert straight_plugin.skipped_steps == 2 and straight_plugin.state_dict()["optimizer_steps"] == 8


def test_resumes_a_checkpoint_of_lightnings_mixed_precision(tmp_path):
    """A run started with Lightning's MixedPrecision('16-mixed') continues under our plugin, scaler state included."""
    ds = make_data(4, overflow_batches=(1,))
    config = dict(init_scale=256.0, growth_interval=3)

    lightning_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **config))
    first = trainer(lightning_plugin, max_epochs=1)
    first.fit(LitNet(), loader(ds))
    first.save_checkpoint(tmp_path / "lightning.ckpt")
    saved = torch.load(tmp_path / "lightning.ckpt", weights_only=False)
    assert "MixedPrecision" in saved and "FP16MixedPrecision" not in saved

    ours, model = FP16MixedPrecision(**config), LitNet()
    trainer(ours, max_epochs=2).fit(model, loader(ds), ckpt_path=tmp_path / "lightning.ckpt")

    straight_plugin, straight = FP16MixedPrecision(**config), LitNet()
    trainer(straight_plugin, max_epochs=2).fit(straight, loader(ds))
    assert_params_equal(params(model), params(straight))
    assert ours.loss_scale == straight_plugin.loss_scale
    # Lightning never counted the skip before the switch; from the switch on, ours counts.
    assert ours.skipped_steps == straight_plugin.skipped_steps - 1


def test_fabric_state_round_trips_through_fabric_save_and_load(tmp_path):
    ds = make_data(4, overflow_batches=(1,))
    plugin = lp_fabric.FP16MixedPrecision(init_scale=256.0, growth_interval=2)
    _, net, fabric = fabric_loop(plugin, ds, 4)
    fabric.save(tmp_path / "state.ckpt", {"model": net, "precision": plugin})
    assert plugin.skipped_steps == 1

    other = lp_fabric.FP16MixedPrecision(init_scale=256.0, growth_interval=2)
    fabric2 = L.Fabric(accelerator="cpu", devices=1, plugins=[other])
    fabric2.load(tmp_path / "state.ckpt", {"model": net, "precision": other})
    assert other.state_dict() == plugin.state_dict()
    assert other.loss_scale == plugin.loss_scale and other.skipped_steps == 1


def test_fabric_reports_skipped_step_and_metrics():
    plugin = lp_fabric.FP16MixedPrecision(init_scale=1024.0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = torch.nn.Linear(4, 4)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, expect_skip in [(torch.ones(2, 4), False), (torch.full((2, 4), 1e6), True)]:
        fabric.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
        assert plugin.step_was_skipped is expect_skip
    metrics = plugin.metrics()
    assert {k: float(v) for k, v in metrics.items()} == {"precision/loss_scale": 512.0, "precision/skipped_steps": 1.0}


def test_lbfgs_is_rejected_with_a_clear_error():
    class LBFGSNet(LitNet):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match="LBFGS.*BF16MixedPrecision"):
        trainer(FP16MixedPrecision(), max_steps=1).fit(LBFGSNet(), loader(make_data(1)))


def test_trainer_plugin_handed_to_fabric_says_which_class_to_use():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FP16MixedPrecision()])
    net = torch.nn.Linear(4, 4)
    model = fabric.setup(net)
    with pytest.raises(TypeError, match=r"Trainer plugin.*from lightning_precision.fabric import FP16MixedPrecision"):
        fabric.backward(model(torch.ones(2, 4)).sum())


def test_no_extra_device_reads_on_steps_that_log_nothing(monkeypatch):
    """Lightning's MixedPrecision reads found_inf once per step (inside GradScaler.step); ours reads no more, even
    with logging every 3 steps and scheduler holding on: logged values stay tensors until the logger writes."""
    lightning = device_reads_per_step(MixedPrecision("16-mixed", "cpu"), monkeypatch, log_every_n_steps=3)
    ours = device_reads_per_step(FP16MixedPrecision(), monkeypatch, log_every_n_steps=3)
    assert lightning == [1] * 6
    assert ours == lightning


def test_lr_find_sweeps_the_same_learning_rates_as_with_lightnings_plugin(tmp_path):
    """The hold applies to the schedulers the user configured, never to the sweep `Tuner.lr_find` swaps in: at high
    learning rates the loss overflows and steps are skipped, and a held sweep would repeat learning rates."""
    from lightning.pytorch.tuner import Tuner

    found = {}
    for name, plugin in [("ours", FP16MixedPrecision()), ("lightning", MixedPrecision("16-mixed", "cpu"))]:
        L.seed_everything(0)
        t = trainer(plugin, max_epochs=1, default_root_dir=tmp_path / name)
        found[name] = Tuner(t).lr_find(LitNet(scheduler=True), train_dataloaders=loader(make_data(60)), min_lr=1e-6,
                                       max_lr=100.0, num_training=60, early_stop_threshold=None)
    ours, theirs = found["ours"].results, found["lightning"].results
    assert len(set(ours["lr"])) == len(ours["lr"]) == 60  # a sweep: no learning rate repeated
    assert ours["lr"] == pytest.approx(theirs["lr"]) and ours["lr"][-1] == pytest.approx(100.0)
    assert found["ours"].suggestion() == found["lightning"].suggestion()


def test_held_schedulers_keep_their_class_state_and_work_with_lr_monitor(tmp_path):
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    t = trainer(FP16MixedPrecision(), max_steps=3, logger=CSVLogger(tmp_path), callbacks=[LearningRateMonitor()],
                log_every_n_steps=1)
    t.fit(LitNet(scheduler=True), loader(make_data(3, overflow_batches=(1,))))
    scheduler = t.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert scheduler.state_dict()["last_epoch"] == 2  # 3 steps, one of them skipped and held


def test_a_held_scheduler_copies_and_pickles_like_the_scheduler():
    """Lightning and users deep-copy and pickle schedulers (checkpoint callbacks, LR finders): the stand-in must too."""
    import copy
    import pickle

    from lightning_precision._trainer.schedulers import HeldScheduler

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    held = HeldScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1), lambda o: False)
    for twin in (copy.copy(held), copy.deepcopy(held)):
        assert twin.scheduler.step_size == 1 and twin.get_last_lr() == [0.1]
    assert isinstance(pickle.loads(pickle.dumps(HeldScheduler(held.scheduler, bool))), torch.optim.lr_scheduler.StepLR)


def test_a_trainer_connected_plugins_held_schedulers_pickle_and_still_hold(tmp_path):
    """The stand-ins `connect` hands Lightning must pickle (a checkpoint callback, an LR finder or a user pickling the
    Trainer's scheduler list), not fail on a local lambda; the copy keeps the scheduler's state and still steps."""
    import pickle

    plugin = FP16MixedPrecision(init_scale=1024.0)
    t = trainer(plugin, max_steps=3)
    t.fit(LitNet(scheduler=True), loader(make_data(3, overflow_batches=(1,))))
    configs = t.lr_scheduler_configs
    copies = pickle.loads(pickle.dumps(configs))
    (held,) = [c.scheduler for c in copies]
    assert type(held).__name__ == "HeldScheduler" and isinstance(held, torch.optim.lr_scheduler.StepLR)
    assert held.state_dict() == configs[0].scheduler.state_dict() and held.last_epoch == 2
    held.step()  # the copy's own plugin is not holding (its last step was not skipped)
    assert held.last_epoch == 3
    assert pickle.loads(pickle.dumps(plugin)).skipped_steps == 1


@pytest.mark.parametrize("module", [lightning_precision, lp_fabric], ids=["trainer", "fabric"])
def test_flat_scaler_arguments_are_the_shorthand_and_never_beside_the_config(module):
    """The flat arguments are FP16MixedPrecision's documented shorthand for one ``ScalerConfig``; given with
    ``scaler=`` too, one of them would be silently overridden, so it is a ValueError naming both."""
    assert module.FP16MixedPrecision(init_scale=1024.0, growth_interval=3).scaler_config == ScalerConfig(
        init_scale=1024.0, growth_interval=3)
    for name, value in (("init_scale", 1024.0), ("growth_factor", 4.0), ("backoff_factor", 0.25),
                        ("growth_interval", 3), ("min_scale", 1.0), ("max_scale", 2.0**20),
                        ("max_consecutive_skips", 5)):
        with pytest.raises(ValueError, match=rf"FP16MixedPrecision\(scaler=ScalerConfig\(\.\.\.\), {name}={value!r}\)"
                                            r".*one place.*dataclasses\.replace"):
            module.FP16MixedPrecision(scaler=ScalerConfig(), **{name: value})
