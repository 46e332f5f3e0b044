"""``FP8Precision`` on a CUDA GPU with real fp8 times its layers' shapes and converts only those measured faster. There
is no CUDA GPU here: what is mocked is a CUDA GPU's timings (``fp8._timing.cuda_timer``, the one seam, returns a fake
timer for this CPU's emulated fp8); the fits, the plugin, torchao (``emulate=True``) and the cache are real."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import fabric as lp_fabric
from lightning_precision.fp8 import _timing
from tests.fp8.test_timing import FakeTimer

pytest.importorskip("torchao")

KW = {"emulate": True, "skip_small_layers": False, "skip_first_last": False}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.small, self.big, self.head = nn.Linear(32, 32), nn.Linear(32, 2048), nn.Linear(2048, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.big(torch.relu(self.small(x)))))


class LitOver(L.LightningModule):
    """The Trainer's view of ``net``: its squared output's mean as the loss, SGD."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def on_fake_gpu(timer: FakeTimer, tmp_path, monkeypatch: pytest.MonkeyPatch) -> FakeTimer:
    """``timer`` as this process's CUDA GPU with real fp8 (the one seam, ``_timing.cuda_timer``), with a cache of its
    own in ``tmp_path``."""
    monkeypatch.setenv("LIGHTNING_PRECISION_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_timing, "_MEMORY", {})
    monkeypatch.setattr(_timing, "cuda_timer", lambda emulate: timer)
    return timer


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> FakeTimer:
    return on_fake_gpu(FakeTimer(), tmp_path, monkeypatch)


def fit(plugin, compiled: bool = False, steps: int = 2) -> nn.Module:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        fabric.backward(model(torch.randn(64, 32, generator=g)).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
    return net


def test_layers_measured_slower_stay_high_with_the_reason(fake_gpu: FakeTimer) -> None:
    plugin = lp_fabric.FP8Precision(**KW)
    with pytest.warns(UserWarning, match="without torch.compile"):
        fit(plugin)
    decisions = {d.fqn: d for d in plugin.layer_decisions}
    # 64 rows: the fake GPU's fp8 casts (20 us) outweigh half of every one of these GEMMs
    assert not any(d.fp8 for d in decisions.values())
    assert decisions["big"].reason.startswith("measured slower on NVIDIA H200:")
    assert "ms in tensorwise vs" in decisions["big"].reason
    assert {call[0].tokens for call in fake_gpu.calls} == {64}  # M from the first training batch
    assert len(fake_gpu.calls) == 2 * 3  # three distinct shapes, bf16 and tensorwise each


def test_layers_measured_faster_are_converted(fake_gpu: FakeTimer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeTimer, "seconds", lambda self, shape, fmt, dtype, compiled: 1.0 if fmt is None else 0.5)
    plugin = lp_fabric.FP8Precision(**KW)
    with pytest.warns(UserWarning, match="without torch.compile"):
        net = fit(plugin)
    assert all(d.fp8 for d in plugin.layer_decisions)
    assert all("measured faster on NVIDIA H200" in d.reason for d in plugin.layer_decisions)
    assert set(plugin.fp8_modules()) == {"small", "big", "head"} and net is not None


def test_layers_auto_decides_on_the_measured_savings(fake_gpu: FakeTimer) -> None:
    plugin = lp_fabric.FP8Precision(layers="auto", calibration_batches=1, **KW)
    with pytest.warns(UserWarning, match="without torch.compile"):
        fit(plugin)
    plan = plugin.plan
    assert plan.speed_source == "measured on NVIDIA H200" and plan.benchmarked
    assert plan.fp8_layers == frozenset()  # all measured slower (and within the rule)
    assert all(p.reason.startswith("measured slower on NVIDIA H200") for p in plan.layers)
    assert "speed measured on NVIDIA H200" in plan.table()


def test_without_a_gpu_nothing_is_timed_nor_warned(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    plugin = lp_fabric.FP8Precision(**KW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(plugin)
    assert all(d.fp8 for d in plugin.layer_decisions)  # the shape rules alone, converted at setup


@pytest.mark.slow
def test_a_compiled_model_is_timed_compiled_and_not_warned(fake_gpu: FakeTimer) -> None:
    import warnings

    plugin = lp_fabric.FP8Precision(**KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    model, optimizer = fabric.setup(torch.compile(net), torch.optim.SGD(net.parameters(), lr=0.01))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without torch.compile")
        for _ in range(2):
            fabric.backward(model(torch.randn(64, 32)).float().square().mean())
            optimizer.step()
            optimizer.zero_grad()
    assert fake_gpu.calls and all(compiled for _, _, compiled in fake_gpu.calls)


def test_the_trainer_times_converts_the_faster_and_keeps_the_optimizer(fake_gpu: FakeTimer,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer's plugin, through the seam: the first batch's rows timed, the faster layer converted at the first
    optimizer step with the same Parameter objects (the optimizer steps them on), the slower one kept high."""
    from lightning_precision import FP8Precision
    from tests.helpers import trainer

    def seconds(self, shape, fmt, dtype, compiled):
        self.calls.append((shape, fmt, compiled))
        return 1.0 if fmt is None else (0.5 if shape.out_features == 2048 else 2.0)

    monkeypatch.setattr(FakeTimer, "seconds", seconds)

    plugin = FP8Precision(**KW)
    lit = LitOver(Net())
    big = lit.net.big.weight
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 32)), batch_size=16)
    with pytest.warns(UserWarning, match="without torch.compile"):
        trainer(plugin, max_steps=3).fit(lit, data)
    decisions = {d.fqn: d for d in plugin.layer_decisions}
    assert decisions["net.big"].fp8 and not decisions["net.small"].fp8 and not decisions["net.head"].fp8
    assert decisions["net.small"].reason.startswith("measured slower on NVIDIA H200")
    assert {call[0].tokens for call in fake_gpu.calls} == {16}
    assert lit.net.big.weight is big and not torch.equal(big.detach(), Net().big.weight)  # stepped after converting
    assert [type(m).__name__ for m in (lit.net.small, lit.net.big)] == ["Linear", "Float8Linear"]
