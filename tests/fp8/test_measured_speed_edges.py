"""The edges of ``FP8Precision`` timing its layers on a CUDA GPU: several models on one plugin, a timing that fails,
layers idle in the measured batch, formats this GPU does not run, evaluation forwards, checkpoints. There is no CUDA GPU
here: what is mocked is a CUDA GPU's timings (``fp8._timing.cuda_timer``, the one seam, returns a fake timer for this
CPU's emulated fp8); the fits, the plugin, torchao (``emulate=True``) and the cache are real."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import fabric as lp_fabric
from lightning_precision._warnings import NoEffectWarning
from lightning_precision.fp8 import _timing
from tests.fp8.test_measured_speed import LitOver, on_fake_gpu
from tests.fp8.test_timing import FakeTimer

pytest.importorskip("torchao")

KW = {"emulate": True, "skip_small_layers": False, "skip_first_last": False}


class BigFaster(FakeTimer):
    """fp8 measured faster on layers of 1024 outputs or more, slower on the others."""

    def seconds(self, shape, fmt, dtype, compiled):
        self.calls.append((shape, fmt, compiled))
        return 1.0 if fmt is None else (0.5 if shape.out_features >= 1024 else 2.0)


@pytest.fixture
def gpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> BigFaster:
    return on_fake_gpu(BigFaster(), tmp_path, monkeypatch)


def mlp(out: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, out))


def kinds(model: nn.Module) -> list[str]:
    return [type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)]


def train(fabric: L.Fabric, forward, optimizers, steps: int = 2, rows: int = 16) -> None:
    for _ in range(steps):
        fabric.backward(forward(torch.randn(rows, 32)).float().square().mean())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def setup(fabric: L.Fabric, net: nn.Module):
    return fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))


def test_two_models_on_one_plugin_are_each_timed_and_converted(gpu: BigFaster) -> None:
    """A GAN's generator and discriminator set up on one plugin: the discriminator's setup no longer drops the
    generator's timing (it stayed in bf16, unconverted)."""
    plugin = lp_fabric.FP8Precision(**KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    g_net, d_net = mlp(), mlp(16)
    g, opt_g = setup(fabric, g_net)
    d, opt_d = setup(fabric, d_net)
    with pytest.warns(UserWarning, match="without torch.compile"):
        train(fabric, lambda x: d(g(x)), (opt_g, opt_d), steps=1)
    assert kinds(g_net) == kinds(d_net) == ["Float8Linear", "Linear"]


def test_layers_auto_with_a_second_model_says_the_first_is_not_measured(gpu: BigFaster) -> None:
    plugin = lp_fabric.FP8Precision(layers="auto", calibration_batches=1, **KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    setup(fabric, mlp())
    with pytest.warns(NoEffectWarning, match=r"measures one model at a time.*so that Sequential is not measured"):
        setup(fabric, mlp(16))
    plugin.teardown()  # the second model's probe closes (it holds torch.compile's eager stance while open)


def test_a_timing_that_fails_is_said_and_the_shape_rules_decide(gpu: BigFaster,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA OOM (or an inductor error) while timing stopped the fit at its first optimizer step; a Ctrl-C still
    stops it."""
    def oom(self, shape, fmt, dtype, compiled):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(BigFaster, "seconds", oom)
    plugin = lp_fabric.FP8Precision(**KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = mlp()
    model, optimizer = setup(fabric, net)
    with pytest.warns(UserWarning, match=r"timing the layers' shapes on this GPU failed \(OutOfMemoryError: CUDA out"):
        train(fabric, model, (optimizer,), steps=2)
    assert kinds(net) == ["Float8Linear", "Float8Linear"]  # the shape rules' choice, as without a GPU
    assert all(d.reason == "fp8" for d in plugin.layer_decisions)

    def interrupted(self, shape, fmt, dtype, compiled):
        raise KeyboardInterrupt

    monkeypatch.setattr(BigFaster, "seconds", interrupted)
    plugin = lp_fabric.FP8Precision(**KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = setup(fabric, mlp())
    with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(fabric, model, (optimizer,), steps=1)


def test_idle_layers_are_timed_at_their_shape_peers_rows_or_kept_high(gpu: BigFaster) -> None:
    """An expert no token reached in the first batch was converted untimed ("fp8"): now it is timed at the rows of the
    expert of its shape that ran; a layer with no such peer stays in high precision, saying why."""

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(32, 1024), nn.Linear(32, 1024)])
            self.late = nn.Linear(32, 2048)  # fp8 would be measured faster, had it run

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.experts[0](x).sum() + self.experts[1](x[:0]).sum()  # expert 1: no token

    plugin = lp_fabric.FP8Precision(**KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = MoE()
    model, optimizer = setup(fabric, net)
    with pytest.warns(UserWarning, match="without torch.compile"):
        train(fabric, model, (optimizer,), steps=1)
    decisions = {d.fqn: d for d in plugin.layer_decisions}
    assert decisions["experts.1"].reason.startswith("measured faster on NVIDIA H200")
    assert "idle in the measured batch, timed at the rows of a layer of its shape" in decisions["experts.1"].reason
    assert not decisions["late"].fp8 and decisions["late"].reason.startswith("not timed: idle in the measured batch")
    assert [type(m).__name__ for m in (*net.experts, net.late)] == ["Float8Linear", "Float8Linear", "Linear"]
    assert {call[0].tokens for call in gpu.calls} == {16}


def test_layers_auto_times_and_chooses_only_the_formats_this_gpu_runs(gpu: BigFaster) -> None:
    """MXFP8 needs compute capability 10.0: on an H200 (the fake's 9.0) it is neither timed nor chosen, where the
    speed model's prediction (for a B200) made it the choice of a plan "measured on NVIDIA H200"."""
    plugin = lp_fabric.FP8Precision(layers="auto", calibration_batches=1, candidates=("tensorwise", "mxfp8"), **KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = mlp()
    model, optimizer = setup(fabric, net)
    with pytest.warns(UserWarning, match="without torch.compile"):
        train(fabric, model, (optimizer,), steps=1)
    assert {fmt for _, fmt, _ in gpu.calls} == {None, "tensorwise"}
    assert "mxfp8" not in {p.precision for p in plugin.plan.layers}
    options = {o.format: o for o in plugin.plan.get("2").alternatives}
    assert options["mxfp8"].verdict == "the NVIDIA H200 does not run mxfp8 (not timed)"


def test_an_evaluation_forward_with_gradients_on_is_not_a_training_row(gpu: BigFaster) -> None:
    """A Fabric loop's ``model.eval()`` forward without ``torch.no_grad`` before the first backward: its 4096 rows
    were timed instead of the training batch's 16."""
    plugin = lp_fabric.FP8Precision(**KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = setup(fabric, mlp())
    model.eval()
    model(torch.randn(4096, 32))
    model.train()
    with pytest.warns(UserWarning, match="without torch.compile"):
        train(fabric, model, (optimizer,), steps=1)
    assert {call[0].tokens for call in gpu.calls} == {16}


def test_a_resumed_fit_converts_as_timed_without_timing_again(gpu: BigFaster, tmp_path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed decisions are in the checkpoint: a resumed fit converts as the run did before its first step, even
    where a new timing would say otherwise (a cleared cache, a busier GPU), and times nothing."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_precision import FP8Precision
    from tests.helpers import trainer

    data = DataLoader(TensorDataset(torch.randn(32, 32)), batch_size=16)
    with pytest.warns(UserWarning, match="without torch.compile"):
        run = trainer(FP8Precision(**KW), max_steps=1)
        run.fit(LitOver(mlp()), data)
    run.save_checkpoint(tmp_path / "run.ckpt")
    slower = FakeTimer()  # every layer measured slower at 16 rows
    monkeypatch.setattr(_timing, "cuda_timer", lambda emulate: slower)
    monkeypatch.setattr(_timing, "_MEMORY", {})
    resumed, lit = FP8Precision(**KW), LitOver(mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(resumed, max_steps=2).fit(lit, data, ckpt_path=tmp_path / "run.ckpt")
    assert kinds(lit) == ["Float8Linear", "Linear"] and not slower.calls
    assert resumed.plan.speed_source == "measured on NVIDIA H200"


def test_a_compiled_model_whose_first_layer_is_idle_is_timed_compiled(gpu: BigFaster) -> None:
    """Only the first eligible layer was watched for ``torch.compile``: idle in the first batch (a branch taken later),
    the compiled model was timed eager. Any eligible layer's first forward tells now (dynamo's ``eager`` backend: the
    same tracing, without inductor's seconds of codegen)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.aux, self.body = nn.Linear(32, 32), mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)  # `aux` (first in module order) does not run

    torch._dynamo.reset()
    plugin = lp_fabric.FP8Precision(**KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    model, optimizer = setup(fabric, torch.compile(net, backend="eager"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without torch.compile")
        train(fabric, model, (optimizer,), steps=1)
    assert gpu.calls and all(compiled for _, _, compiled in gpu.calls)
