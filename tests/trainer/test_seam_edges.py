"""Edges of the Trainer's seam (``lightning_precision/_trainer/seam.py``, ``_trainer/scaled.py``) over the step
policies, each on a real fit: a plugin reused for several stages with Lightning's ThroughputMonitor, a fused optimizer
with ``gradient_clip_val``, a copy taken inside a manual-optimization ``training_step`` (its update pending), and what
each policy writes into a checkpoint."""

import copy

import lightning.pytorch.callbacks.throughput_monitor as trainer_monitor
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
from torch import nn

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision, FP16TruePrecision
from lightning_precision import fabric as lp_fabric
from lightning_precision._core.process_effects import FABRIC_THROUGHPUT, STATE_INIT_HOOK, TRAINER_THROUGHPUT
from tests.helpers import LitNet, TwoOptimizers, fabric_loop, loader, make_data, trainer


class _NaNAt(LitNet):
    """LitNet whose loss is NaN at the batches ``bad``; ``fused``: a fused AdamW."""

    def __init__(self, bad: tuple[int, ...] = (), fused: bool = False) -> None:
        super().__init__()
        self.bad, self.fused = bad, fused

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx in self.bad else loss

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self):
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        return super().configure_optimizers()


def test_a_plugin_reused_for_fit_fit_validate_test_keeps_its_dtype_for_the_monitor_and_its_state(monkeypatch):
    """One FP16TruePrecision for four stages, each with Lightning's ThroughputMonitor, which reads the plugin's dtype
    in its ``setup``, before the plugin sees the stage: fp16 every time (not fp32), the step hook released after each
    stage while the monitor's dtype stays, and the scaler's counts carried from one fit to the next."""
    dtypes = []
    monkeypatch.setattr(trainer_monitor, "get_available_flops", lambda device, dtype: dtypes.append(dtype))
    plugin, model = FP16TruePrecision(), _NaNAt(bad=(1,))
    data = loader(make_data(2))
    for stage in ("fit", "fit", "validate", "test"):
        t = trainer(plugin, max_epochs=1, callbacks=[ThroughputMonitor(batch_size_fn=lambda batch: len(batch[0]))])
        getattr(t, stage)(model, data)
        assert not any(h is plugin for h in STATE_INIT_HOOK.holders()), stage  # released at teardown
        assert any(h is plugin for h in TRAINER_THROUGHPUT.holders()), stage
        assert any(h is plugin for h in FABRIC_THROUGHPUT.holders()), stage
    assert dtypes == [torch.float16] * 4
    assert {k: plugin.state_dict()[k] for k in ("optimizer_steps", "skipped_steps")} == {"optimizer_steps": 4,
                                                                                        "skipped_steps": 2}


def test_a_fused_optimizer_cannot_be_clipped_under_a_loss_scale_and_can_under_the_guard():
    """A fused AdamW unscales inside its step: under fp16's loss scale ``gradient_clip_val`` raises the error that
    names the fix (Fabric's ``clip_gradients`` too), and without clipping it trains. Under the bf16 guard (scale 1) it
    clips and the NaN step is skipped."""
    with pytest.raises(RuntimeError, match=r"`AdamW` unscales gradients inside `step\(\)`.*drop `gradient_clip_val`"):
        trainer(FP16MixedPrecision(), max_steps=1, gradient_clip_val=0.5).fit(_NaNAt(fused=True), loader(make_data(1)))
    fp16, model = FP16MixedPrecision(), _NaNAt(fused=True)
    trainer(fp16, max_steps=2).fit(model, loader(make_data(2, overflow_batches=(1,))))
    assert fp16.skipped_steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())

    for algorithm in ("norm", "value"):
        guard, model = BF16MixedPrecision(skip_nonfinite=True), _NaNAt(bad=(1,), fused=True)
        before = [p.detach().clone() for p in model.parameters()]
        trainer(guard, max_steps=3, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm).fit(
            model, loader(make_data(3)))
        assert guard.skipped_steps == 1, algorithm
        assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))

    plugin = lp_fabric.FP16MixedPrecision()
    _, net, fabric = fabric_loop(plugin, make_data(1), 0)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), fused=True))
    fabric.backward(model(torch.randn(2, 16)).sum())
    with pytest.raises(NotImplementedError, match="Use the non-fused optimizer to clip"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)


class _CopiedMidStep(TwoOptimizers):
    """Two optimizers on one backward (manual optimization); after both stepped, inside ``training_step`` (the update
    still pending), the plugin is copied."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Linear(16, 16), nn.Linear(16, 4))
        self.seen: list[tuple[bool, bool]] = []

    def loss(self, x, batch_idx):
        return self.b(self.a(x)).float().pow(2).mean()

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        plugin = self.trainer.precision_plugin
        pending = plugin.step_policy.update_pending
        twin = copy.deepcopy(plugin)
        self.seen.append((pending, twin.state_dict() == plugin.state_dict()))


def test_a_copy_inside_a_manual_training_step_applies_the_update_once():
    """The copy applies the pending update (torch pickles no scaler between a step and its update); the end of the
    ``training_step`` then has none left to apply: one update per training step, the overflow backed off once."""
    plugin = FP16MixedPrecision(init_scale=1024.0, growth_interval=100)
    updates = []
    update = plugin.step_policy.scaler.update
    plugin.step_policy.scaler.update = lambda *a, **k: updates.append(1) or update(*a, **k)
    model = _CopiedMidStep()
    trainer(plugin, max_steps=8).fit(model, loader(make_data(4, overflow_batches=(1,))))
    assert model.seen == [(True, True)] * 4
    assert len(updates) == 4
    assert (plugin.loss_scale, plugin.skipped_steps, plugin.state_dict()["optimizer_steps"]) == (512.0, 1, 4)


_TORCH_SCALER = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
_COUNTERS = {"skipped_steps", "optimizer_steps", "consecutive_skips"}


@pytest.mark.parametrize(("make", "keys"), [
    (BF16MixedPrecision, None),
    (lambda: BF16MixedPrecision(skip_nonfinite=True), _COUNTERS),
    (FP16MixedPrecision, _TORCH_SCALER | _COUNTERS | {"min_scale", "max_scale"}),
], ids=["plain", "guarded", "loss-scaled"])
def test_each_policy_checkpoints_what_it_did_before_and_resumes_it(make, keys, tmp_path):
    """What each policy writes is what ``ScaledPrecision.state_dict`` wrote before the step policies (the scaler's or
    the guard's state; nothing for plain autocast): under the plugin's name, and a real loss scaler's state also under
    Lightning's ``MixedPrecision``; a fresh plugin resumes it."""
    plugin = make()
    t = trainer(plugin, max_steps=3, enable_checkpointing=True, default_root_dir=tmp_path,
                callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="last")])
    t.fit(_NaNAt(bad=(1,)), loader(make_data(3, overflow_batches=(2,))))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    name = type(plugin).__qualname__
    if keys is None:
        assert name not in saved and "MixedPrecision" not in saved and plugin.state_dict() == {}
        return
    assert set(saved[name]) == keys and saved[name] == plugin.state_dict()
    assert saved[name]["skipped_steps"] == (2 if "scale" in keys else 1)
    assert saved.get("MixedPrecision") == (saved[name] if "scale" in keys else None)
    resumed = make()
    trainer(resumed, max_steps=3).fit(LitNet(), loader(make_data(3)), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.state_dict() == saved[name]
