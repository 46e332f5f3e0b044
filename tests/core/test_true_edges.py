"""Edges of BF16TruePrecision and FP16TruePrecision found by attacking them: an optimizer step taken a chunk at a
time (its hooks, a Ctrl-C or an exception in the middle of it), optimizers and settings beyond the common ones, and
how the plugins meet the rest of Lightning."""

from __future__ import annotations

import importlib.util
import os
import signal
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import lightning_precision as lp
import lightning_precision.fabric as lpf
from lightning_precision._core.true.step import RoundingMeter
from tests.helpers import LitNet, loader, make_data, trainer

PLUGINS = [lpf.BF16TruePrecision, lpf.FP16TruePrecision]


def _fabric_step_setup(plugin: Any, optimizer_class: Any = torch.optim.AdamW,
                       **optimizer_kwargs: Any) -> tuple[nn.Module, Any, L.Fabric]:
    """Two linear layers (144 elements) under ``plugin``, set up by Fabric with ``optimizer_class``."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    optimizer = optimizer_class(model.parameters(), lr=1e-2, **optimizer_kwargs)
    model, optimizer = fabric.setup(model, optimizer)
    return model, optimizer, fabric


def _backward(model: nn.Module, fabric: L.Fabric, seed: int = 1) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    fabric.backward(model(x).float().pow(2).mean())


def _snapshot(model: nn.Module, optimizer: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    import copy

    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


# ---- the step, a chunk at a time -----------------------------------------------------------------------------------


@pytest.mark.usefixtures("stepped_per_chunk")
@pytest.mark.parametrize("cls", PLUGINS)
def test_step_hooks_run_once_a_step_on_the_real_parameters(cls):
    """A step of several chunks calls the optimizer once a chunk on fp32 stand-ins; the user's step hooks (and torch's
    global ones) still run once a step, pre-hooks before any weight moved and post-hooks after all did, and see the
    model's own 16-bit parameters in the optimizer's groups."""
    model, optimizer, fabric = _fabric_step_setup(cls(step_chunk=80))  # 144 elements: two chunks
    params = list(model.parameters())
    seen: list[tuple[str, bool, bool]] = []

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        current = [p for group in opt.param_groups for p in group["params"]]
        seen.append(("pre", all(a is b for a, b in zip(current, params, strict=False)) and len(current) == 4,
                     all(torch.equal(p, w) for p, w in zip(params, before, strict=True))))

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        current = [p for group in opt.param_groups for p in group["params"]]
        seen.append(("post", all(a is b for a, b in zip(current, params, strict=False)) and len(current) == 4,
                     all(not torch.equal(p, w) for p, w in zip(params, before, strict=True))))

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
    global_post = register_optimizer_step_post_hook(lambda *_: seen.append(("global", True, True)))
    try:
        for step in range(2):
            before = [p.detach().clone() for p in params]
            _backward(model, fabric, seed=step)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        global_post.remove()
    assert seen == [("pre", True, True), ("post", True, True), ("global", True, True)] * 2


@pytest.fixture
def stepped_per_chunk(monkeypatch):
    """``_RaisesOnChunk`` overrides ``step`` only to count its calls and interrupt one: stepped a chunk at a time, as
    the AdamW it is (an optimizer of unknown kind is stepped once a step, on the whole model)."""
    from lightning_precision._core.true import step as true_step

    monkeypatch.setattr(true_step, "steps_each_parameter_apart", lambda optimizer: True)


class _RaisesOnChunk(torch.optim.AdamW):
    """AdamW whose ``step`` raises ``error`` on its ``on``-th call (a call a chunk under a true plugin), or sends this
    process SIGINT ``signals`` times there."""

    def __init__(self, params: Any, lr: float, error: BaseException | None = None, on: int = 2,
                 signals: int = 0, after: bool = False) -> None:
        super().__init__(params, lr=lr)
        self.error, self.on, self.signals, self.after, self.calls = error, on, signals, after, 0

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        if self.calls == self.on:
            for _ in range(self.signals):
                os.kill(os.getpid(), signal.SIGINT)
            if self.error is not None:
                if self.after:  # once its states (the step counter too) are updated in place
                    super().step(closure)
                raise self.error
        return super().step(closure)


@pytest.mark.usefixtures("stepped_per_chunk")
@pytest.mark.parametrize("cls", PLUGINS)
def test_ctrl_c_in_the_middle_of_a_step_is_raised_once_it_is_taken(cls):
    """Ctrl-C on the second chunk of a step: KeyboardInterrupt is raised when the whole step has landed (the weights
    and states are those of an uninterrupted step), never between two chunks (some parameters stepped, others not)."""
    reference, ref_optimizer, ref_fabric = _fabric_step_setup(cls(step_chunk=80), _RaisesOnChunk)
    model, optimizer, fabric = _fabric_step_setup(cls(step_chunk=80), _RaisesOnChunk, on=4, signals=1)
    for m, opt, f in ((reference, ref_optimizer, ref_fabric), (model, optimizer, fabric)):
        _backward(m, f)
        opt.step()
        opt.zero_grad()
        _backward(m, f, seed=2)
    ref_optimizer.step()
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()  # calls 3 and 4: the signal arrives in the second chunk
    assert optimizer.optimizer.calls == 4
    _assert_same(_snapshot(model, optimizer), _snapshot(reference, ref_optimizer))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("stepped_per_chunk")
def test_a_second_ctrl_c_stops_a_step_at_once():
    """A second Ctrl-C does not wait for the step (one that hangs can be stopped): raised in the chunk, which is left
    as it was (no stand-in in the optimizer)."""
    model, optimizer, fabric = _fabric_step_setup(lpf.BF16TruePrecision(step_chunk=80), _RaisesOnChunk, on=2,
                                                  signals=2)
    _backward(model, fabric)
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
    params = list(model.parameters())
    assert [p for group in optimizer.param_groups for p in group["params"]] == params
    assert all(any(p is q for q in params) for p in optimizer.state)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("stepped_per_chunk")
@pytest.mark.parametrize(("after", "keep_fp32"), [(False, ()), (True, ()), (True, (nn.Linear,))])
@pytest.mark.parametrize("cls", PLUGINS)
def test_an_error_in_the_optimizer_leaves_its_chunk_and_hooks_as_they_were(cls, after, keep_fp32):
    """The optimizer raising on a chunk, before or after it updated its states in place (the step counter; the
    moments of a layer kept in fp32): that chunk's weights and states are as before (no fp32 stand-in left in the
    state or the groups), the error reaches the caller, the user's hooks stay registered and run at the next step.
    Chunks already landed stay stepped (documented: undoing them would need a copy of the model)."""
    model, optimizer, fabric = _fabric_step_setup(cls(step_chunk=80, keep_fp32=keep_fp32), _RaisesOnChunk, on=3,
                                                  error=RuntimeError("boom"), after=after)
    calls: list[str] = []
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    _backward(model, fabric)
    optimizer.step()  # calls 1 and 2
    optimizer.zero_grad()
    _backward(model, fabric, seed=2)
    weights, state = _snapshot(model, optimizer)
    with pytest.raises(RuntimeError, match="boom") as raised:
        optimizer.step()  # call 3: the first chunk raises, nothing landed
    assert not getattr(raised.value, "__notes__", None)
    _assert_same(_snapshot(model, optimizer), (weights, state))
    params = list(model.parameters())
    assert [p for group in optimizer.param_groups for p in group["params"]] == params
    optimizer.step()
    assert calls == ["post", "post"]
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("cls", PLUGINS)
def test_a_first_step_at_lr_0_is_a_step(cls):
    """A warm-up from lr 0: the first step meets an empty optimizer state at lr 0, as torch's distributed checkpoint's
    layout step does; the step hooks run before the plugin creates the states, and the plugin's own step is not
    taken for that layout step (which would drop the gradients): the states exist after it, and the next step moves
    the weights."""
    model, optimizer, fabric = _fabric_step_setup(cls())
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    _backward(model, fabric)
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert all({"exp_avg", "lp.f16.exp_avg"} & set(optimizer.state[p]) for p in model.parameters())
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    optimizer.step()
    assert all(not torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


# ---- checkpoints across plugins --------------------------------------------------------------------------------------


class _AdamNet(LitNet):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize(("writer", "reader", "kwargs"), [
    (lp.BF16TruePrecision, lp.FP16TruePrecision, {"optimizer_states": "float32"}),
    (lp.FP16TruePrecision, lp.BF16TruePrecision, {"optimizer_states": "float32"}),
    (lp.FP16TruePrecision, lp.BF16TruePrecision, {"update": "nearest"})])  # the plain step, Lightning's
def test_a_checkpoint_of_one_true_plugin_resumed_by_the_other_is_refused(writer, reader, kwargs, tmp_path):
    """The states' 16-bit encodings of one dtype, cast to the other by torch on load, are garbage (the fp32 states'
    halves, the remainders, fp16's states at a power of two read plainly) or flush (a bf16 second moment under fp16's
    range reads as 0: Adam's update divides by eps). Resuming a BF16TruePrecision checkpoint with FP16TruePrecision
    (or back) raises before any weight moves."""
    path = tmp_path / "true.ckpt"
    first = trainer(writer(optimizer_states="float32"), max_steps=2)
    first.fit(_AdamNet(), loader(make_data(2)))
    first.save_checkpoint(path)
    model = _AdamNet()
    with pytest.raises(ValueError, match=f"written by `{writer.__name__}`.*stepped by `{reader.__name__}`"):
        trainer(reader(**kwargs), max_steps=4).fit(model, loader(make_data(2)), ckpt_path=path)
    again = trainer(writer(optimizer_states="float32"), max_steps=4)
    again.fit(_AdamNet(), loader(make_data(2)), ckpt_path=path)  # the plugin that wrote it resumes it
    assert again.global_step == 4


# ---- optimizers and layers -------------------------------------------------------------------------------------------


def _embedding_run(cls: Any, sparse: bool, clip: bool) -> list[torch.Tensor]:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[cls(update="compensated")])
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=sparse)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for step in range(3):
        fabric.backward(model(torch.tensor([step, step + 1])).float().pow(2).sum())
        if clip:
            fabric.strategy.precision.clip_in_step(optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("cls", PLUGINS)
def test_a_sparse_embedding_trains_as_the_dense_one(cls, clip):
    """``nn.Embedding(sparse=True)`` with SGD and momentum (which torch steps on sparse gradients): the step widens the
    sparse gradient to a dense fp32 one (it crashed storing a sparse momentum in 16 bits), and the run is the dense
    embedding's, bit for bit, clipped by norm or not."""
    sparse, dense = _embedding_run(cls, True, clip), _embedding_run(cls, False, clip)
    assert all(torch.equal(a, b) for a, b in zip(sparse, dense, strict=True))
    assert not torch.equal(sparse[0], _embedding_run(cls, False, not clip)[0])  # the clip did something


def test_checkpoints_pass_between_lightnings_bf16_true_and_ours(tmp_path):
    """Lightning's ``precision="bf16-true"`` checkpoint resumed by ``BF16TruePrecision`` (its bf16 Adam states are read
    as ours are), and ours (default: bf16 states, which Lightning's optimizer reads as its own; our extra keys ride
    along unused) resumed by Lightning's: both train on, finite."""
    theirs, ours = tmp_path / "theirs.ckpt", tmp_path / "ours.ckpt"
    for path, kwargs in ((theirs, {"precision": "bf16-true"}), (ours, {"plugin": lp.BF16TruePrecision()})):
        first = trainer(max_steps=2, **kwargs)
        first.fit(_AdamNet(), loader(make_data(2)))
        first.save_checkpoint(path)
    for path, kwargs in ((theirs, {"plugin": lp.BF16TruePrecision()}), (ours, {"precision": "bf16-true"})):
        model = _AdamNet()
        again = trainer(max_steps=4, **kwargs)
        again.fit(model, loader(make_data(2)), ckpt_path=path)
        assert again.global_step == 4 and all(torch.isfinite(p).all() for p in model.parameters())
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("cls", [lp.BF16TruePrecision, lp.FP16TruePrecision])
@pytest.mark.parametrize(("saved", "resumed"), [
    ({"optimizer_states": "float32"}, {}), ({}, {"optimizer_states": "float32"}), ({"update": "compensated"}, {})])
def test_a_resume_with_other_settings_keeps_no_stale_encoding(cls, saved, resumed, tmp_path):
    """A checkpoint resumed with another ``optimizer_states`` (or ``update`` away from "compensated"): the states are
    read from the old encoding, then kept in the new one alone, as a fresh run keeps them (the old encoding stayed
    beside them for good: 16 bytes a parameter instead of 8 after a float32 -> weight resume, and the stale one could
    be read again in place of the state)."""
    path = tmp_path / "saved.ckpt"
    first = trainer(cls(**saved), max_steps=2)
    first.fit(_AdamNet(), loader(make_data(2)))
    first.save_checkpoint(path)
    model = _AdamNet()
    again = trainer(cls(**resumed), max_steps=4)
    again.fit(model, loader(make_data(2)), ckpt_path=path)
    fresh_model = _AdamNet()
    fresh = trainer(cls(**resumed), max_steps=2)
    fresh.fit(fresh_model, loader(make_data(2)))
    keys = [sorted(map(str, state)) for state in again.optimizers[0].state.values()]
    assert keys == [sorted(map(str, state)) for state in fresh.optimizers[0].state.values()]
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _InterruptedMeter(RoundingMeter):
    """A rounding meter (GradientUnderflowMonitor's hook in the step) through which a KeyboardInterrupt arrives while
    the ``on``-th chunk lands, before it writes anything."""

    def __init__(self, on: int) -> None:
        super().__init__()
        self.on, self.calls = on, 0

    def add(self, *args: Any) -> None:
        self.calls += 1
        if self.calls == self.on:
            raise KeyboardInterrupt
        super().add(*args)


@pytest.mark.usefixtures("stepped_per_chunk")
@pytest.mark.parametrize("update", ["stochastic", "compensated"])
@pytest.mark.parametrize("cls", PLUGINS)
def test_an_interrupt_while_the_weights_land_leaves_each_chunk_whole(cls, update):
    """Interrupted while the second chunk lands: the first chunk is stepped (weights and states), the others as they
    were, no fp32 stand-in stays in the optimizer's state (``state_dict()`` of an optimizer with one fails, and with
    it the checkpoint saved on the way out), and training goes on from there."""
    model, optimizer, fabric = _fabric_step_setup(cls(update=update, step_chunk=80), _RaisesOnChunk)
    _backward(model, fabric)
    optimizer.step()
    optimizer.zero_grad()
    _backward(model, fabric, seed=2)
    weights, state = _snapshot(model, optimizer)
    fabric.strategy.precision.true_step.meter = _InterruptedMeter(on=2)
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
    params = list(model.parameters())
    assert set(optimizer.state) == set(params)
    now = optimizer.state_dict()
    moved = [not torch.equal(p, w) for p, w in zip(params, weights, strict=True)]
    first = moved.index(False)
    assert first > 0 and not any(moved[first:])  # the first chunk stepped, nothing after it
    for i in range(first, len(params)):
        _assert_same(now["state"][i], state["state"][i])
    for i in range(first):
        assert int(now["state"][i]["step"]) == int(state["state"][i]["step"]) + 1
    fabric.strategy.precision.true_step.meter = None
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.usefixtures("stepped_per_chunk")
@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes are Python 3.11+")
def test_an_error_on_a_later_chunk_says_what_was_stepped():
    """The optimizer raising on the second chunk of a step: the first chunk stays stepped (undoing it would take a
    copy of the weights and states, what the chunks bound), and the error says so."""
    model, optimizer, fabric = _fabric_step_setup(lpf.BF16TruePrecision(step_chunk=80), _RaisesOnChunk, on=2,
                                                  error=RuntimeError("boom"))
    _backward(model, fabric)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom") as raised:
        optimizer.step()
    assert "had stepped 2 of its 4 parameters" in " ".join(raised.value.__notes__)
    assert [torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True)] == [False, False, True, True]


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
@pytest.mark.parametrize("optimizer_name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
@pytest.mark.parametrize("cls", PLUGINS)
def test_torchaos_low_bit_optimizers_keep_their_own_states(cls, optimizer_name):
    """A torchao low-bit optimizer the user chose steps on the fp32 stand-ins with its own compact states, kept as it
    keeps them (the step read them into fp32 and failed writing them back: NotImplementedError), and their bytes are
    counted as what they hold."""
    import torchao.optim

    from lightning_precision._bytes import training_bytes

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[cls()])
    torch.manual_seed(0)
    model = nn.Linear(128, 64)  # 8192 weights: quantized by torchao (the bias stays plain)
    model, optimizer = fabric.setup(model, getattr(torchao.optim, optimizer_name)(model.parameters(), lr=1e-3))
    weight = model.weight.detach().clone()
    for step in range(3):
        x = fabric.strategy.precision.convert_input(torch.randn(4, 128, generator=torch.Generator().manual_seed(step)))
        fabric.backward(model(x).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state[model.weight]
    assert type(state["exp_avg"]).__name__.startswith("OptimState")
    assert all(torch.isfinite(p).all() for p in model.parameters()) and not torch.equal(model.weight, weight)
    assert training_bytes(model, [optimizer.optimizer]).optimizer_states < 2 * 2 * 8192  # under two 16-bit states


def test_an_fp16_true_checkpoint_is_not_read_as_plain_adam_states(tmp_path):
    """fp16 states are stored at a power of two (a second moment as its square root): under torch's own key names, an
    optimizer resumed without the plugin would read those as its moments and train on them silently. Under keys of
    the plugin's own, it fails to find them, loudly."""
    from lightning_precision import fabric as plugins

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugins.FP16TruePrecision()])
    net = nn.Linear(8, 8)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    fabric.backward(model(torch.randn(4, 8)).float().square().mean())
    optimizer.step()
    state = optimizer.optimizer.state_dict()
    plain = nn.Linear(8, 8).half()
    adam = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    adam.load_state_dict(state)
    plain(torch.randn(4, 8, dtype=torch.float16)).float().square().mean().backward()
    with pytest.raises(KeyError, match="exp_avg"):
        adam.step()
