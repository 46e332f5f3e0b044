"""``eval_precision=`` with Fabric (``plugin.eval_context()``) and what each kind of plugin changes for an evaluation
(issue 39): fp8 layers computing as plain linear layers, a true-precision model on fp32 stand-ins one layer at a time,
all of it put back, also when the forward raises; and every plugin's ``repr``."""

from __future__ import annotations

import pickle
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import lightning_precision as lp
from lightning_precision import fabric as lpf
from tests import te_standin
from tests.helpers import assert_same_bits, make_net

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FABRIC: dict[str, Any] = {
    "BF16MixedPrecision": lambda e: lpf.BF16MixedPrecision(eval_precision=e),
    "FP16MixedPrecision": lambda e: lpf.FP16MixedPrecision(eval_precision=e),
    "XPUPrecision": lambda e: lpf.XPUPrecision(device="cpu", eval_precision=e),  # no XPU here: its logic on the CPU
    "FP8Precision": lambda e: lpf.FP8Precision(emulate=True, skip_small_layers=False, eval_precision=e),
    "BF16TruePrecision": lambda e: lpf.BF16TruePrecision(eval_precision=e),
    "FP16TruePrecision": lambda e: lpf.FP16TruePrecision(eval_precision=e),
}


def _setup(plugin: Any, steps: int = 2) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).float().square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return model, net, optimizer


def _fp32_twin(net: nn.Module) -> nn.Module:
    """The same weights in fp32, as plain linear layers (an fp8 model's converted layers included)."""
    twin = make_net()
    twin.load_state_dict({k: v.float() for k, v in net.state_dict().items() if not k.endswith("_extra_state")})
    return twin


def _snapshot(net: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    params = list(net.parameters())
    return ([p.detach().clone() for p in params], params, [(p.dtype, p.requires_grad) for p in params],
            [b.clone() for b in net.buffers()], [type(m) for m in net.modules()], optimizer.state_dict())


def _assert_unchanged(net: nn.Module, optimizer: torch.optim.Optimizer, before: tuple[Any, ...]) -> None:
    values, params, kinds, buffers, classes, state = before
    assert_same_bits([p.detach() for p in net.parameters()], values)
    assert all(a is b for a, b in zip(net.parameters(), params, strict=True))
    assert [(p.dtype, p.requires_grad) for p in net.parameters()] == kinds
    assert_same_bits([b for b in net.buffers()], buffers)
    assert [type(m) for m in net.modules()] == classes
    assert_same_bits(optimizer.state_dict(), state)


@pytest.mark.parametrize("name", sorted(FABRIC))
def test_fabric_evaluates_in_fp32_as_the_fp32_model_does_and_leaves_everything_as_it_was(name):
    plugin = FABRIC[name]("32-true")
    model, net, optimizer = _setup(plugin)
    before = _snapshot(net, optimizer)
    x = torch.randn(8, 16)
    with torch.no_grad(), plugin.eval_context():
        with plugin.eval_context():  # re-entrant: the inner one changes nothing more
            inner = model(x)
        out = model(x)
    with torch.no_grad():
        expected = _fp32_twin(net)(x)
    assert torch.equal(out, expected) and torch.equal(inner, expected)  # an fp8 layer too: the fp32 linear, bit for bit
    _assert_unchanged(net, optimizer, before)
    with torch.no_grad():
        trained = model(x)  # training's precision again
    assert not torch.equal(trained, expected)


@pytest.mark.parametrize("name", sorted(FABRIC))
def test_a_forward_that_raises_inside_the_context_leaves_the_model_as_it_was(name):
    plugin = FABRIC[name]("32-true")
    model, net, optimizer = _setup(plugin, steps=1)
    before = _snapshot(net, optimizer)
    with pytest.raises(RuntimeError), torch.no_grad(), plugin.eval_context():
        model(torch.randn(8, 5))  # the wrong width: the first layer raises
    _assert_unchanged(net, optimizer, before)
    assert plugin._eval_depth == 0


def test_eval_precision_none_changes_nothing():
    plugin = lpf.BF16MixedPrecision()
    model, _, _ = _setup(plugin, steps=0)
    with torch.no_grad(), plugin.eval_context():
        assert model(torch.randn(2, 16)).dtype == torch.float32  # converted output
        with plugin.forward_context():
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


@pytest.mark.parametrize("eval_precision, dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_fp8_evaluates_without_fp8_in_a_16_bit_autocast(eval_precision, dtype):
    plugin = FABRIC["FP8Precision"](eval_precision)
    model, net, _ = _setup(plugin, steps=1)
    fp8 = plugin.fp8_modules()
    (layer,) = fp8.values()
    seen = []
    layer.register_forward_hook(lambda m, a, o: seen.append((type(m), o.dtype)))
    with torch.no_grad(), plugin.eval_context():
        model(torch.randn(8, 16))
    with torch.no_grad():
        model(torch.randn(8, 16))
    assert seen == [(nn.Linear, dtype), (type(layer), torch.bfloat16)]
    assert plugin.fp8_modules() == fp8


def test_fp8_refuses_evaluation_without_fp8_beside_an_fp8_all_gather():
    with pytest.raises(ValueError, match=r"fsdp_float8_all_gather=True, eval_precision='32-true'.*eval_precision=None"):
        lp.FP8Precision(emulate=True, fsdp_float8_all_gather=True, eval_precision="32-true")


def test_transformer_engine_evaluates_outside_its_fp8_autocast(monkeypatch):
    """Transformer Engine needs CUDA: its stand-in (tests/te_standin.py) records each ``te.autocast``."""
    te_standin.install(monkeypatch)
    plugin = lpf.FP8Precision(backend="transformer_engine", eval_precision="32-true")
    with plugin.forward_context():
        pass
    assert len(te_standin.AUTOCAST_CALLS) == 1
    with plugin.eval_context(), plugin.forward_context():
        assert not torch.is_autocast_enabled("cpu")
    assert len(te_standin.AUTOCAST_CALLS) == 1  # none in evaluation


class _Tied(nn.Module):
    """One Parameter in two modules, a buffer, a layer kept in fp32, and a module called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.LayerNorm(16)
        self.b.weight = self.a.weight
        self.register_buffer("shift", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(self.a(x) + self.shift)) + self.a(x)


def test_true_precision_widens_one_layer_at_a_time_and_restores_tied_weights_and_buffers():
    plugin = lpf.BF16TruePrecision(keep_fp32=(nn.LayerNorm,), eval_precision="32-true")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _Tied()
    model = fabric.setup(net)
    widened = []
    for module in (net.a, net.b, net.norm):
        module.register_forward_hook(lambda m, a, o: widened.append(
            (o.dtype, sum(p.dtype == torch.float32 for _, p in net.named_parameters(remove_duplicate=False)))))
    params, shift = list(net.parameters()), net.shift
    x = torch.randn(4, 16)
    with torch.inference_mode(), plugin.eval_context():
        out = model(x)
    assert out.dtype == torch.float32
    # each layer's output in fp32 (the kept LayerNorm's too); the fp32 parameters meanwhile: the kept LayerNorm's two,
    # and the running layer's two (a, b, then a again)
    assert widened == [(torch.float32, 4), (torch.float32, 4), (torch.float32, 2), (torch.float32, 4)]
    assert all(a is b for a, b in zip(net.parameters(), params, strict=True))
    assert net.b.weight is net.a.weight and net.shift is shift and net.shift.dtype == torch.bfloat16
    twin = _Tied()
    twin.load_state_dict({k: v.float() for k, v in net.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(out, twin(x))


def test_true_precision_refuses_fp32_evaluation_with_gradients_on():
    plugin = lpf.BF16TruePrecision(eval_precision="32-true")
    model, net, optimizer = _setup(plugin, steps=0)
    before = _snapshot(net, optimizer)
    with pytest.raises(RuntimeError, match=r"eval_precision='32-true'.*torch.no_grad\(\)"), plugin.eval_context():
        model(torch.randn(2, 16))
    _assert_unchanged(net, optimizer, before)


def test_a_copy_made_mid_evaluation_starts_outside_it():
    plugin = lpf.BF16MixedPrecision(eval_precision="32-true")
    with plugin.eval_context():
        copy = pickle.loads(pickle.dumps(plugin))
    assert copy._eval_depth == 0 and copy.eval_precision == "32-true"


@pytest.mark.parametrize("plugin, shown", [
    (lambda: lp.BF16MixedPrecision(), "BF16MixedPrecision()"),
    (lambda: lpf.BF16TruePrecision(update="compensated", eval_precision="32-true"),
     "BF16TruePrecision(update='compensated', eval_precision='32-true')"),
    (lambda: lp.FP16MixedPrecision(init_scale=1024.0, matmul_precision="high"),
     "FP16MixedPrecision(scaler=ScalerConfig(init_scale=1024.0), matmul_precision='high')"),
    (lambda: lp.FP16TruePrecision(keep_fp32=(nn.LayerNorm,)), "FP16TruePrecision(keep_fp32=(LayerNorm,))"),
    (lambda: lp.XPUPrecision(dtype="fp16", device="cpu"), "XPUPrecision(dtype='fp16', device='cpu')"),
    (lambda: lp.BF16MixedPrecision(skip_nonfinite=True, eval_precision="bf16-mixed"),
     "BF16MixedPrecision(skip_nonfinite=True, eval_precision='bf16-mixed')"),
    (lambda: lp.FP8Precision(recipe="rowwise", emulate=True, skip_small_layers=False),
     "FP8Precision(recipe='rowwise', emulate=True, layer_policy=FP8LayerPolicy(skip_small_layers=False))"),
])
def test_repr_shows_the_arguments_that_differ_from_their_defaults(plugin, shown):
    assert repr(plugin()) == shown


def test_repr_of_a_half_built_plugin_is_its_class_name():
    half = lpf.FP8Precision.__new__(lpf.FP8Precision)
    assert repr(half) == "FP8Precision"


class _ReadsChildren(nn.Module):
    """Modules that read a child's weight without calling the child: ``nn.MultiheadAttention`` (``out_proj``),
    ``nn.TransformerEncoderLayer`` (its fast path in evaluation reads every sublayer's weights), and one by hand; and
    a 16-bit buffer written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        x = self.encoder(x)
        x = self.attention(x, x, x, need_weights=False)[0]
        return nn.functional.linear(x, self.head.weight, self.head.bias)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_true_precision_evaluates_modules_that_read_their_children_weights_in_fp32(grad_mode):
    plugin = lpf.BF16TruePrecision(eval_precision="32-true")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = _ReadsChildren()
    model = fabric.setup(net).eval()
    twin = _ReadsChildren().eval()
    twin.load_state_dict({k: v.float() for k, v in net.state_dict().items()})
    params, calls = list(net.parameters()), net.calls
    x = torch.randn(2, 4, 16)
    with grad_mode(), plugin.eval_context():
        out = model(x)
    with torch.no_grad():
        expected = twin(x)
    with torch.no_grad():
        trained = model(x)  # as it trains: in bf16
    # fp32 compute, though not bit for bit: under the widening mode torch's fused fast paths step aside (they refuse
    # arguments with a torch function) for the same computation op by op
    error, bf16_error = (out - expected).abs().max().item(), (trained.float() - expected).abs().max().item()
    assert out.dtype == torch.float32 and error < 1e-5 and bf16_error > 100 * error
    assert all(a is b and a.dtype == torch.bfloat16 for a, b in zip(net.parameters(), params, strict=True))
    assert net.calls is calls and calls.dtype == torch.bfloat16 and calls.item() == 2  # written in place, kept 16-bit
