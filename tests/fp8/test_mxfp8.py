"""FP8Precision(recipe="mxfp8") with the real torchao MXFP8 training layer, emulated on CPU (torchao's EMULATED kernels
run the same MXFP8 casts with torch ops), against a hand-written loop calling torchao directly."""

import warnings

import lightning as L
import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="the torchao backend needs `pip install 'lightning-precision[fp8]'`")
from lightning_precision import FP8Precision, NoEffectWarning  # noqa: E402
from lightning_precision import fabric as lp_fabric  # noqa: E402
from lightning_precision import fp8 as lp_fp8  # noqa: E402
from lightning_precision.fp8 import _torchao  # noqa: E402
from tests.helpers import Classifier, assert_params_equal, params, trainer  # noqa: E402

try:
    mx = _torchao.mxfp8_linear_module()
except ImportError as err:  # torchao before its moe_training MXFP8 layer (0.11 has another API): the plugin says so
    pytest.skip(f"this torchao has no MXFP8 training layer: {err}", allow_module_level=True)
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.quantization.quantize_.common import KernelPreference  # noqa: E402

STEPS, ROWS = 6, 32  # MXFP8's backward casts the tokens in blocks of 32


def net_of(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def data(steps=STEPS, rows=ROWS):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * rows, 32, generator=g)
    y = (x @ torch.randn(32, 16, generator=g)).argmax(dim=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=rows)


def hand_loop():
    """bf16 autocast, the middle layer through torchao's MXFP8 matmul on bf16 copies of input and weight."""
    net = net_of()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    mid = net[2]
    losses = []
    for x, y in data():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = net[1](net[0](x))
            with torch.autocast("cpu", enabled=False):
                h = mx._to_mxfp8_then_scaled_mm(h.bfloat16(), mid.weight.bfloat16(), KernelPreference.EMULATED,
                                                ScaleCalculationMode.RCEIL) + mid.bias.bfloat16()
            loss = nn.functional.cross_entropy(net[4](net[3](h)), y)
        losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, net


class Net(Classifier):
    def __init__(self):
        super().__init__(net_of(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))


def test_trainer_matches_a_hand_written_torchao_mxfp8_loop():
    expected_losses, expected_net = hand_loop()
    plugin, model = FP8Precision(recipe="mxfp8", emulate=True, skip_small_layers=False), Net()
    trainer(plugin, max_steps=STEPS).fit(model, data())
    assert isinstance(model.net[2], mx.MXFP8Linear) and type(model.net[0]) is nn.Linear
    assert plugin.scaling_family == "mxfp8" and plugin.peak_flops_dtype == torch.bfloat16  # emulated: the bf16 peak
    torch.testing.assert_close(model.losses, expected_losses)
    assert_params_equal(params(model.net), params(expected_net))


def test_fabric_keeps_the_parameters_the_optimizer_holds_and_a_short_batch_falls_back():
    """Fabric builds the optimizer before converting: the layer changes class in place, its Parameters stay. A batch
    whose tokens are not a multiple of 32 (an epoch's last) runs that layer in bf16 with one warning, not a crash."""
    expected_losses, expected_net = hand_loop()
    plugin = lp_fabric.FP8Precision(recipe="mxfp8", emulate=True, skip_small_layers=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = net_of()
    before = [id(p) for p in net.parameters()]
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    assert [id(p) for p in net.parameters()] == before
    for x, y in data():
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
    assert_params_equal(params(net), params(expected_net))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            fabric.backward(model(torch.randn(5, 32)).sum())
    messages = [str(w.message) for w in caught if issubclass(w.category, NoEffectWarning)]
    assert len(messages) == 1 and "5 tokens" in messages[0]
    assert torch.isfinite(net[2].weight.grad).all()


def test_block_rules_demotion_and_refusals():
    decisions = lp_fp8.select_fp8_layers(nn.Sequential(nn.Linear(48, 48), nn.Linear(64, 64), nn.Linear(64, 48)),
                                         "mxfp8", module_filter=lambda m, fqn: True)
    assert [d.fp8 for d in decisions] == [False, True, False]
    assert "not divisible by 32" in decisions[0].reason
    # The in-place move back to high precision (FP8Precision.demote) works on an MXFP8 layer too.
    layer = nn.Linear(64, 64)
    weight = layer.weight
    _torchao.to_mxfp8_linear(layer, lp_fp8.MXFP8Recipe(emulate=True))
    _torchao.demote_torchao_layer(layer)
    assert type(layer) is nn.Linear and layer.weight is weight and not hasattr(layer, "kernel_preference")
    # layers="auto" measures MXFP8's own blocks (the probe casts each block at its scale): allowed, one candidate
    assert FP8Precision(recipe="mxfp8", emulate=True, layers="auto").candidates == ("mxfp8",)
    with pytest.raises(ValueError, match="tensorwise scaling only"):
        FP8Precision(recipe="mxfp8", emulate=True, fsdp_float8_all_gather=True)


def test_mxfp8_needs_compute_capability_10(monkeypatch):
    # No CUDA device here: torch.cuda's answers are stubbed to an H100's (9.0), which has fp8 but not MXFP8.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    with pytest.raises(RuntimeError, match=r"mxfp8\) needs CUDA compute capability >= 10.0.*H100.*9.0"):
        lp_fp8.check_fp8_hardware("cuda", "torchao", "mxfp8", emulate=False)
