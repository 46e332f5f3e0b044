"""The true-precision step on flat buffers (issue 35): the same bits as the per-parameter path, a constant number of
aten ops and no host read per step, whatever the number of parameters, and the edges of the step it closed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_precision._true_step import TrueStep
from lightning_precision._upstream.torch import DispatchCounter

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam-amsgrad-maximize": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, maximize=True),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, centered=True),
    "nadam": lambda params: torch.optim.NAdam(params, lr=1e-2),
}


def _net(dtype: torch.dtype, layers: int = 3, width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    net[0].float()  # a layer kept in fp32 beside the 16-bit ones
    for layer in list(net)[1:]:
        layer.to(dtype)
    return net


def _loss(net: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    out = x
    for layer in net:
        out = layer(out.to(layer.weight.dtype))
    return out.float().square().mean()


def _train(dtype: torch.dtype, update: str, states: str, optimizer: str, flat: bool, steps: int = 4,
           step_chunk: int = 2**24, **kwargs: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    net = _net(dtype)
    opt = OPTIMIZERS[optimizer](net.parameters())
    step = TrueStep(dtype, update, states, seed=0, step_chunk=step_chunk)
    step.flat = flat
    for i in range(steps):
        _loss(net, i).backward()
        step.step(opt, kwargs.get("factor"), kwargs.get("clip"))
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()], copy.deepcopy(opt.state_dict())


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# Settings whose rounding draws nothing (stochastic rounding draws once per chunk on the flat path, once per parameter
# on the other: the same distribution, other numbers; see test_stochastic_rounding_repeats).
DRAWLESS = [("nearest", "weight"), ("nearest", "float32"), ("compensated", "float32")]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("update", "states"), DRAWLESS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_flat_path_lands_the_per_parameter_paths_bits(dtype, update, states, optimizer):
    """Weights, states and every key of ours, bit for bit, over steps that create the states and steps that reuse
    them, with a layer kept in fp32 beside the 16-bit ones; unscaled by a factor as under fp16."""
    factor = torch.tensor(0.5)
    flat = _train(dtype, update, states, optimizer, flat=True, factor=factor)
    loose = _train(dtype, update, states, optimizer, flat=False, factor=factor)
    _same(flat, loose)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_value_the_format_cannot_hold_keeps_the_old_weight_on_both_paths(dtype):
    """SGD at lr 1e4: new values beyond fp16's largest (and, under bf16, none): the flat path keeps the old weight
    where the per-parameter path does, and writes nothing non-finite."""
    def run(flat: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Linear(16, 16).to(dtype)
        with torch.no_grad():
            net.weight.mul_(3000)
        opt = torch.optim.SGD(net.parameters(), lr=3e3)
        step = TrueStep(dtype, "compensated", "weight", seed=0, step_chunk=2**24)
        step.flat = flat
        net(torch.randn(4, 16, dtype=dtype)).float().square().mean().backward()
        step.step(opt, None, None)
        return [p.detach().clone() for p in net.parameters()]

    flat, loose = run(True), run(False)
    _same(flat, loose)
    assert all(torch.isfinite(p).all() for p in flat)


def test_stochastic_rounding_repeats():
    """Stochastic rounding on the flat path: the same run twice lands the same bits; other seeds, other bits."""
    a = _train(torch.bfloat16, "stochastic", "weight", "adamw", flat=True)
    b = _train(torch.bfloat16, "stochastic", "weight", "adamw", flat=True)
    _same(a, b)
    net = _net(torch.bfloat16)
    opt = OPTIMIZERS["adamw"](net.parameters())
    other = TrueStep(torch.bfloat16, "stochastic", "weight", seed=1, step_chunk=2**24)
    for i in range(4):
        _loss(net, i).backward()
        other.step(opt, None, None)
        opt.zero_grad()
    assert not all(torch.equal(p, q) for p, q in zip(net.parameters(), a[0], strict=True))


def _counted_step(dtype: torch.dtype, update: str, states: str, layers: int, optimizer: str = "adamw-foreach",
                  ours: bool = True) -> DispatchCounter:
    net = _net(dtype, layers)
    opt = OPTIMIZERS[optimizer](net.parameters())
    step = TrueStep(dtype, update, states, seed=0, step_chunk=2**24)
    for i in range(2):  # the first step creates the states
        _loss(net, i).backward()
        step.step(opt, None, None) if ours else opt.step()
        opt.zero_grad()
    _loss(net, 2).backward()
    with DispatchCounter() as counter:
        step.step(opt, None, None) if ours else opt.step()
    return counter


@pytest.mark.parametrize(("update", "states"), [("stochastic", "weight"), ("compensated", "weight"),
                                                ("nearest", "weight"), ("stochastic", "float32")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_step_adds_a_constant_number_of_ops_and_reads_nothing(dtype, update, states):
    """Counted with a TorchDispatchMode over one step after the states exist, against the same foreach AdamW stepped
    plainly (torch's own ops: a constant number per group, and a host read of each CPU step count): what our step
    adds is the same number of aten ops for 4 and 32 layers, and no host read."""
    added = []
    for layers in (4, 32):
        ours = _counted_step(dtype, update, states, layers)
        plain = _counted_step(dtype, update, states, layers, ours=False)
        assert ours.host_reads == plain.host_reads
        added.append(len(ours.names) - len(plain.names))
    assert added[0] == added[1], added
