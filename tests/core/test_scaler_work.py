"""What the loss scaler does per step beyond torch's ``GradScaler``: on an ordinary step, nothing on the device and no
hook registered; the bound where the scale can move (a growth, a backoff); and what that needs kept right (copies,
resuming mid-run). The numbers themselves are pinned in ``test_scaler_numbers.py``."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_precision import ScalerConfig
from lightning_precision import fabric as lp_fabric
from lightning_precision._core.scaling.scaler import TrackingGradScaler
from tests.core.test_scaler_numbers import CONFIG, FACTORS, GOLDEN, _batch, _fabric_run, _loss, _net, _state


class TensorCalls(TorchFunctionMode):
    """The torch functions and tensor methods called while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def _update_calls(update: Any) -> list[str]:
    with TensorCalls() as calls:
        update()
    return calls.names


def test_update_does_on_the_device_what_torchs_does_and_bounds_only_a_moving_scale():
    """Step by step, the tensor calls of the plugin's scale update against torch's own ``GradScaler.update`` on the same
    losses: equal on ordinary steps; one more (the bound) on a growth or a backoff."""
    config = ScalerConfig(init_scale=2.0**10, growth_interval=3)
    factors = [1, 1, 1, 1, math.inf, 1, 1, 1]  # a growth after the third step, a backoff at the fifth
    plugin = lp_fabric.FP16MixedPrecision(scaler=config)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net, ref = _net(), _net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=config.init_scale, growth_interval=config.growth_interval)
    extra = []
    for step, factor in enumerate(factors):
        x, y = _batch(step)
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x).float(), y) * factor)
        opt.step()
        ours = _update_calls(plugin.update_after_every_step)
        ref_opt.zero_grad()
        with torch.autocast("cpu", torch.float16):
            loss = nn.functional.mse_loss(ref(x).float(), y) * factor
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        theirs = _update_calls(scaler.update)
        assert ours[:len(theirs)] == theirs, step
        extra.append(ours[len(theirs):])
        assert plugin.loss_scale == scaler.get_scale()
    assert extra == [[], [], ["clamp_"], [], ["clamp_"], [], [], ["clamp_"]]



def test_the_step_hook_is_registered_once_per_optimizer(monkeypatch):
    """Registering a post-hook and removing it every step cost as much as the rest of the bookkeeping."""
    plugin = lp_fabric.FP16MixedPrecision(scaler=CONFIG)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _net()
    a = torch.optim.SGD(net[0].parameters(), lr=0.01)
    b = torch.optim.SGD(net[2].parameters(), lr=0.01)
    registered = []
    for opt in (a, b):
        register = opt.register_step_post_hook
        monkeypatch.setattr(opt, "register_step_post_hook",
                            lambda hook, _register=register, _opt=opt: registered.append(_opt) or _register(hook))
    model, a_, b_ = fabric.setup(net, a, b)
    for step in range(6):
        x, y = _batch(step)
        fabric.backward(_loss(net, model(x), y, step))
        a_.step()
        b_.step()
        a_.zero_grad()
        b_.zero_grad()
    assert registered == [a, b]
    assert len(a._optimizer_step_post_hooks) == len(b._optimizer_step_post_hooks) == 1


def test_a_copy_of_the_plugin_after_steps_pickles_and_detects_skips():
    """The plugin is pickled by ddp_spawn and deep-copied by tools: its scaler's per-optimizer hooks are not copied,
    and the copy, stepping its own optimizer, still tells skipped steps from the others."""
    plugin = lp_fabric.FP16MixedPrecision(scaler=CONFIG)
    _fabric_run(plugin, read="end", steps=6)
    for clone in (pickle.loads(pickle.dumps(plugin)), copy.deepcopy(plugin)):
        trace = _fabric_run(clone, read="every", steps=12)
        # Same config, fresh optimizer and model: the same skips as the first run's steps (the scale goes on from the
        # copied state, so only the skip pattern is compared).
        assert [entry[0] for entry in trace[:-1]] == [entry[0] for entry in GOLDEN["fabric-sgd-every"][:12]]


def test_resuming_mid_run_gives_the_numbers_of_an_uninterrupted_run():
    """The host follows the growth tracker from a checkpoint's value: a run resumed between two growths grows (and is
    bounded) at the same step as one never interrupted."""
    for cut in (7, 13, 26):  # mid-interval, after a backoff, within the streak at min_scale
        first = lp_fabric.FP16MixedPrecision(scaler=CONFIG)
        head = _fabric_run(first, read="every", steps=cut)
        resumed = lp_fabric.FP16MixedPrecision(scaler=CONFIG)
        resumed.load_state_dict(first.state_dict())
        tail = _resumed_run(resumed, cut)
        assert head[:-1] + tail == GOLDEN["fabric-sgd-every"][:-1], cut


def _resumed_run(plugin: Any, start: int) -> list[Any]:
    """Steps ``start`` onwards of ``_fabric_run(read="every")``, from the checkpointed scaler (the weights are not
    what the scale depends on: the forced overflows are)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    trace = []
    for step in range(start, len(FACTORS)):
        opt.zero_grad()
        x, y = _batch(step)
        fabric.backward(_loss(net, model(x), y, step))
        opt.step()
        trace.append((plugin.step_was_skipped, _state(plugin)))
    return trace


class _NoWeakRef:
    """An optimizer-like wrapper without weak references (``__slots__``) nor hooks."""

    __slots__ = ("inner",)

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner

    @property
    def param_groups(self) -> Any:
        return self.inner.param_groups

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.step(*args, **kwargs)


def test_an_optimizer_without_weak_references_or_hooks_steps_and_counts_the_same():
    traces = []
    for wrap in (False, True):
        plugin = lp_fabric.FP16MixedPrecision(scaler=CONFIG)
        net = plugin.convert_module(_net())
        opt: Any = torch.optim.SGD(net.parameters(), lr=0.01)
        opt = _NoWeakRef(opt) if wrap else opt
        trace = []
        for step in range(16):
            net.zero_grad()
            x, y = _batch(step)
            with plugin.forward_context():
                out = net(x)
            plugin.backward(_loss(net, out, y, step), net)
            plugin.optimizer_step(opt)
            trace.append((plugin.step_was_skipped, _state(plugin)))
        traces.append(trace)
    assert traces[0] == traces[1]
    assert [t[0] for t in traces[0]] == [t[0] for t in GOLDEN["fabric-sgd-every"][:16]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch disables a cuda scaler only where CUDA is absent")
def test_a_scaler_torch_disabled_is_built_and_steps_the_optimizer():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = TrackingGradScaler("cuda", CONFIG)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    before = net[0].weight.detach().clone()
    nn.functional.mse_loss(net(torch.ones(2, 4)), torch.zeros(2, 2)).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, net[0].weight) and not scaler.step_was_skipped(opt)
