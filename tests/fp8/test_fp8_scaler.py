"""FP8Precision with fp16 compute owns the fp16 plugin's bounded loss scaler: without it, gradients
below fp16's range flushed to zero in the high-precision layers and nothing trained, with no warning. Real torchao
(emulate=True) on real Trainer and Fabric fits."""

import math

import lightning as L
import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="the torchao backend needs `pip install 'lightning-precision[fp8]'`")

from lightning_precision import FP8Precision, ScalerConfig  # noqa: E402
from lightning_precision import fabric as lp_fabric  # noqa: E402
from tests.helpers import assert_params_equal, params, trainer  # noqa: E402

TINY = 1e-8  # times the loss: logit gradients of ~1e-9, below half fp16's smallest subnormal (2**-25): they flush


def fp8_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def fp8_data(n_batches, overflow_batches=(), seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * 8, 32, generator=g)
    y = (x @ torch.randn(32, 16, generator=g)).argmax(dim=1)
    for b in overflow_batches:
        x[b * 8:(b + 1) * 8] *= 1e6  # beyond fp16's 65504 in the first layer: inf, the step is skipped
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class TinyLossNet(L.LightningModule):
    def __init__(self, factor=TINY, lr=1e6):
        super().__init__()
        self.net = fp8_net()
        self.factor, self.lr = factor, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y) * self.factor

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)  # 1e6: the update of a 1e-9 gradient shows in fp32


def fp16_fp8(cls=FP8Precision, **kwargs):
    return cls(emulate=True, skip_small_layers=False, compute_dtype=torch.float16, **kwargs)


def test_tiny_gradients_train_under_fp16_compute_with_the_trainer():
    from torchao.float8.float8_linear import Float8Linear

    model = TinyLossNet()
    before = params(model)
    plugin = fp16_fp8()
    trainer(plugin, max_steps=2).fit(model, fp8_data(2))
    assert isinstance(model.net[2], Float8Linear) and type(model.net[4]) is nn.Linear  # fp16 around an fp8 layer
    changed = [not torch.equal(a, b) for a, b in zip(before, params(model), strict=True)]
    assert all(changed), f"parameters {[i for i, c in enumerate(changed) if not c]} never trained"
    assert plugin.loss_scale == 2.0**16 and plugin.skipped_steps == 0


def test_tiny_gradients_train_under_fp16_compute_with_fabric():
    plugin = fp16_fp8(lp_fabric.FP8Precision)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = fp8_net()
    before = params(net)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e6))
    for x, y in fabric.setup_dataloaders(fp8_data(2)):
        opt.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x), y) * TINY)
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, params(net), strict=True))
    assert plugin.metrics()["precision/loss_scale"].item() == 2.0**16
    assert plugin.metrics()["precision/fp8_layers"].item() == 1.0


def test_the_scale_is_logged_checkpointed_and_resumed(tmp_path):
    """An overflow batch backs the scale off and the growth interval grows it: the scale has moved when it is logged
    and saved, and a resumed fit continues exactly as one that ran straight through."""

    def plugin():
        return fp16_fp8(scaler=ScalerConfig(init_scale=1024.0, growth_interval=3))

    def data():
        return fp8_data(4, overflow_batches=(1,))

    straight_plugin, straight = plugin(), TinyLossNet(factor=1.0, lr=0.1)
    t = trainer(straight_plugin, max_epochs=2, log_every_n_steps=1)
    t.fit(straight, data())
    assert straight_plugin.skipped_steps == 2 and t.callback_metrics["precision/skipped_steps"].item() == 2
    assert t.callback_metrics["precision/loss_scale"].item() == straight_plugin.loss_scale

    first_plugin = plugin()
    first = trainer(first_plugin, max_epochs=1)
    first.fit(TinyLossNet(factor=1.0, lr=0.1), data())
    first.save_checkpoint(tmp_path / "fp8.ckpt")
    checkpoint = torch.load(tmp_path / "fp8.ckpt", weights_only=False)
    saved = checkpoint["FP8Precision"]
    assert saved["scale"] == first_plugin.loss_scale != 1024.0 and saved["skipped_steps"] == 1
    assert checkpoint["MixedPrecision"]["scale"] == saved["scale"]  # Lightning's "16-mixed" can resume it too

    resumed_plugin, resumed = plugin(), TinyLossNet(factor=1.0, lr=0.1)
    trainer(resumed_plugin, max_epochs=2).fit(resumed, data(), ckpt_path=tmp_path / "fp8.ckpt")
    assert (resumed_plugin.loss_scale, resumed_plugin.skipped_steps) == (straight_plugin.loss_scale, 2)
    assert_params_equal(params(resumed), params(straight))
    assert all(math.isfinite(p.sum().item()) for p in resumed.parameters())


@pytest.mark.parametrize("cls", [FP8Precision, lp_fabric.FP8Precision])
def test_a_scaler_with_bf16_compute_is_refused_and_fp16_validates_it(cls):
    with pytest.raises(ValueError, match=r"FP8Precision\(scaler=ScalerConfig\(.*bf16 has fp32's exponent range.*float16"):
        cls(scaler=ScalerConfig())
    with pytest.raises(ValueError, match=r"FP8Precision\(growth_factor=1\.0\)"):
        cls(compute_dtype=torch.float16, scaler=ScalerConfig(growth_factor=1.0))
    assert cls(emulate=True).loss_scale is None
    assert cls(emulate=True, compute_dtype=torch.float16).loss_scale == 2.0**16


def test_a_bf16_run_with_the_non_finite_guard_resumes_in_fp16(tmp_path):
    """One class runs bf16 and fp16 compute, so its checkpoint key is the same: a bf16 run's guard saved its counters
    only, and resuming it with fp16 compute was refused for the missing 'scale' (its fix, deleting the plugin's entry,
    would have dropped the plan beside it). It resumes from init_scale, as a bf16 state without the guard does, with
    the run's counters and its plan."""
    first_plugin = FP8Precision(emulate=True, skip_small_layers=False, skip_nonfinite=True)
    first = trainer(first_plugin, max_epochs=1)
    data = fp8_data(3)
    data.dataset.tensors[0][8] = float("nan")  # batch 1: a NaN loss, its step skipped
    first.fit(TinyLossNet(factor=1.0, lr=0.1), data)
    first.save_checkpoint(tmp_path / "bf16.ckpt")
    assert set(torch.load(tmp_path / "bf16.ckpt", weights_only=False)["FP8Precision"]) == {
        "skipped_steps", "optimizer_steps", "consecutive_skips"}
    assert first_plugin.skipped_steps == 1

    resumed = fp16_fp8(scaler=ScalerConfig(init_scale=1024.0))
    trainer(resumed, max_epochs=2).fit(TinyLossNet(factor=1.0, lr=0.1), fp8_data(3), ckpt_path=tmp_path / "bf16.ckpt")
    assert resumed.skipped_steps == 1 and resumed.state_dict()["optimizer_steps"] == 6
    assert resumed.loss_scale == 1024.0
    # Fabric alike, with a plan beside the counters
    guarded = lp_fabric.FP8Precision(emulate=True, skip_nonfinite=True)
    fp16 = fp16_fp8(lp_fabric.FP8Precision)
    fp16.load_state_dict({**guarded.state_dict(), "plan": {"version": 1, "recipe": "tensorwise", "batches": 0,
                                                             "layers": []}})
    assert fp16.loss_scale == 2.0**16 and fp16.plan is not None
