"""The edges of the true-precision step on flat buffers (``_true_step``/``_true_flat``/``_workspace``): the flat path
against the per-parameter one (``TrueStep.flat = False``, the reference), its cached stand-ins and workspaces, and the
plugins around it (Trainer and Fabric, on the CPU). Each test says what it guards."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import lightning_precision as lp
import lightning_precision.fabric as lpf
from lightning_precision._core.true.rounding_meter import RoundingMeter
from lightning_precision._core.true.step import TrueStep
from tests.helpers import assert_same_bits, trainer


def _held_bytes(step: TrueStep) -> int:
    return sum(b.flat.untyped_storage().nbytes() for w in step._works.values() for b in w._buffers.values())


class _Odd(nn.Module):
    """Every odd parameter at once: an idle expert (never used: no gradient), a layer used every other step (chunk
    membership changes), an empty parameter, a transposed (non-contiguous) weight, a 0-dim and a 1-element one, an
    embedding tied to the output (one Parameter used twice), and a layer kept in fp32."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.a = nn.Linear(8, 8)
        self.sometimes = nn.Linear(8, 8)
        self.idle = nn.Linear(8, 8)
        self.empty = nn.Parameter(torch.empty(0))
        self.t = nn.Parameter(torch.randn(8, 8).t())
        self.scalar = nn.Parameter(torch.tensor(0.5))
        self.one = nn.Parameter(torch.tensor([0.3]))
        self.kept = nn.Linear(8, 8)
        self.to(dtype)
        self.kept.float()

    def forward(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        h = self.a(self.emb(ids))
        if step % 2 == 0:
            h = self.sometimes(h)
        h = self.kept(h.to(self.kept.weight.dtype)).to(h.dtype)
        h = (h @ self.t) * self.scalar * self.one
        return (h @ self.emb.weight.t()).float().square().mean() * 1e-2 + self.empty.float().sum()


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(step))


OPTIMIZERS = {
    "adamw-amsgrad": lambda params: torch.optim.AdamW(params, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2, centered=True, momentum=0.5),
    "adamax": lambda params: torch.optim.Adamax(params, lr=1e-2),
    "rprop": lambda params: torch.optim.Rprop(params, lr=1e-2),
}


def _groups(net: _Odd) -> list[dict[str, Any]]:
    first = [net.a.weight, net.t, net.scalar]
    return [{"params": first, "lr": 3e-2, "weight_decay": 0.0},
            {"params": [p for p in net.parameters() if all(p is not q for q in first)]}]


def _direct(dtype: torch.dtype, update: str, states: str, optimizer: str, flat: bool, step_chunk: int) -> Any:
    net = _Odd(dtype)
    opt = OPTIMIZERS[optimizer](_groups(net))
    step = TrueStep(dtype, update, states, seed=0, step_chunk=step_chunk)
    step.flat = flat
    for i in range(4):
        net(_ids(i), i).backward()
        step.step(opt, torch.tensor(0.5), None)
        opt.zero_grad()
        assert _held_bytes(step) == 0  # no fp32 buffer kept between steps
    return [p.detach().clone() for p in net.parameters()], copy.deepcopy(opt.state_dict())


# ---- guards: what held ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("update", "states"), [("nearest", "float32"), ("compensated", "float32"),
                                                ("nearest", "weight")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_odd_parameters_land_the_per_parameter_bits(dtype, update, states, optimizer):
    """Idle experts, changing chunk membership, empty/0-dim/non-contiguous/tied parameters, fp32 layers, two param
    groups, several chunks: the flat path lands the reference's bits, weights and states, and frees its buffers."""
    for step_chunk in (2**24, 100):
        flat = _direct(dtype, update, states, optimizer, True, step_chunk)
        assert_same_bits(flat, _direct(dtype, update, states, optimizer, False, step_chunk))
        assert all(torch.isfinite(p).all() for p in flat[0])


class _RaisesAfterUpdating(torch.optim.AdamW):
    boom = False

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        if self.boom:
            raise RuntimeError("boom")
        return out


@pytest.mark.parametrize("kwargs", [{}, {"update": "compensated"}, {"optimizer_states": "float32"},
                                    {"keep_fp32": (nn.Linear,)}])
@pytest.mark.parametrize("cls", [lpf.BF16TruePrecision, lpf.FP16TruePrecision])
def test_an_error_inside_the_step_leaves_weights_states_and_memory_as_they_were(cls, kwargs):
    extra = {"init_scale": 1.0} if cls is lpf.FP16TruePrecision else {}
    plugin = cls(**kwargs, **extra)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _Odd(torch.float32)
    model, optimizer = fabric.setup(net, _RaisesAfterUpdating(net.parameters(), lr=1e-2))
    for i in range(2):
        fabric.backward(model(_ids(i), i))
        optimizer.step()
        optimizer.zero_grad()
    assert not plugin.step_was_skipped and _held_bytes(plugin.true_step) == 0
    fabric.backward(model(_ids(2), 2))
    weights, state = [p.detach().clone() for p in net.parameters()], copy.deepcopy(optimizer.optimizer.state_dict())
    optimizer.optimizer.boom = True
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step()
    assert_same_bits(([p.detach().clone() for p in net.parameters()], optimizer.optimizer.state_dict()), (weights, state))
    assert all(any(k is p for p in net.parameters()) for k in optimizer.optimizer.state)
    assert _held_bytes(plugin.true_step) == 0


@pytest.mark.parametrize("cls", [lpf.BF16TruePrecision, lpf.FP16TruePrecision])
def test_a_non_finite_gradient_or_an_overflowing_update_writes_nothing_non_finite(cls):
    plugin = cls(update="compensated")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = nn.Linear(8, 8)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    before = [p.detach().clone() for p in net.parameters()]
    fabric.backward(model(torch.full((2, 8), float("nan"))).float().sum())
    optimizer.step()
    optimizer.zero_grad()
    assert plugin.step_was_skipped
    assert_same_bits([p.detach() for p in net.parameters()], before)
    for group in optimizer.param_groups:
        group["lr"] = 1e36  # fp32 values far beyond fp16's (and, times the weights, bf16's) range
    fabric.backward(model(torch.randn(2, 8)).float().sum() * 1e-3)
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in net.parameters())


class _Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.m = _Odd(torch.float32)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.m(batch, self.global_step)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(_groups(self.m), lr=1e-2, amsgrad=True, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("cls", [lp.BF16TruePrecision, lp.FP16TruePrecision])
def test_a_resumed_run_with_groups_a_scheduler_and_accumulation_is_the_whole_run(cls, tmp_path):
    def batches() -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader([_ids(0)] * 24, batch_size=None)  # the same batch every step

    kwargs = {"step_chunk": 100, **({"init_scale": 4.0} if cls is lp.FP16TruePrecision else {})}
    whole = _Lit()
    trainer(cls(**kwargs), max_steps=4, accumulate_grad_batches=2).fit(whole, batches())
    run = trainer(cls(**kwargs), max_steps=2, accumulate_grad_batches=2)
    run.fit(_Lit(), batches())
    run.save_checkpoint(tmp_path / "half.ckpt")
    resumed = _Lit()
    trainer(cls(**kwargs), max_steps=4, accumulate_grad_batches=2).fit(resumed, batches(),
                                                                       ckpt_path=tmp_path / "half.ckpt")
    assert_same_bits([p.detach() for p in resumed.parameters()], [p.detach() for p in whole.parameters()])
    assert all(torch.isfinite(p).all() for p in whole.parameters())


@pytest.mark.parametrize("cls", [lp.BF16TruePrecision, lp.FP16TruePrecision])
def test_the_plugin_pickles_and_copies_after_a_fit_and_the_copy_trains(cls):
    plugin = cls()
    trainer(plugin, max_steps=2).fit(_Lit(), torch.utils.data.DataLoader([_ids(0)] * 2, batch_size=None))
    for twin in (pickle.loads(pickle.dumps(plugin)), copy.deepcopy(plugin)):
        assert twin.true_step._works == {}
        model = _Lit()
        trainer(twin, max_steps=2).fit(model, torch.utils.data.DataLoader([_ids(0)] * 2, batch_size=None))
        assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- FP16TruePrecision's hooks and sparse gradients ----------------------------------------------------------------


class _SparseNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.lin = nn.Linear(8, 1)
        self.start: torch.Tensor | None = None

    def on_train_start(self) -> None:
        self.start = self.emb.weight.detach().float().clone()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, target = batch
        return (self.lin(self.emb(ids)).float().squeeze(-1).sum(-1) - target).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def moved(self) -> float:
        assert self.start is not None
        return float((self.emb.weight.detach().float() - self.start).norm())


class _SeeAndTouch(L.Callback):
    """Records the sparse gradient's norm in ``on_before_optimizer_step``; ``touch``: then changes a dense gradient in
    place by a no-op (as a clip that does not bite does)."""

    def __init__(self, touch: bool) -> None:
        self.touch, self.norms = touch, []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.norms.append(float(pl_module.emb.weight.grad.coalesce().values().float().norm()))
        if self.touch:
            pl_module.lin.weight.grad.mul_(1.0)


def _sparse_run(cls: Any, touch: bool) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 20, (8, 4), generator=g), torch.randn(8, generator=g))
    extra = {"init_scale": 256.0} if cls is lp.FP16TruePrecision else {}
    model, seen = _SparseNet(), _SeeAndTouch(touch)
    plugin = cls(update="compensated", optimizer_states="float32", **extra)
    trainer(plugin, max_steps=1, callbacks=[seen]).fit(model, torch.utils.data.DataLoader([batch], batch_size=None))
    assert not plugin.step_was_skipped
    return seen.norms[0], model.moved()


def test_fp16_true_shows_the_hooks_a_sparse_gradient_unscaled():
    """``on_before_optimizer_step`` under ``FP16TruePrecision`` sees a sparse gradient (``nn.Embedding(sparse=True)``)
    unscaled too, as the dense ones (it saw it at the loss scale)."""
    assert _sparse_run(lp.FP16TruePrecision, False)[0] == pytest.approx(_sparse_run(lp.BF16TruePrecision, False)[0],
                                                                        rel=2e-2)


def test_fp16_true_a_hook_that_touches_a_dense_gradient_leaves_the_sparse_update_alone():
    """A hook that changes a dense gradient (a no-op ``mul_(1.0)``) makes the step take every gradient as the hooks
    saw it, unscaled: the sparse one included (it was never unscaled, and stepped 256 times too large)."""
    untouched = _sparse_run(lp.FP16TruePrecision, False)[1]
    assert untouched == pytest.approx(_sparse_run(lp.BF16TruePrecision, False)[1], rel=5e-2)
    assert _sparse_run(lp.FP16TruePrecision, True)[1] == pytest.approx(untouched, rel=5e-2)


class _Replace(L.Callback):
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad = p.grad.clone()


def test_fp16_true_a_hook_that_replaces_the_gradients_steps_them_unscaled():
    """Held: new gradient tensors from ``on_before_optimizer_step`` are stepped as they are (unscaled)."""

    class Dense(_SparseNet):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(20, 8)

    def moved(callbacks: list[Any]) -> float:
        g = torch.Generator().manual_seed(0)
        batch = (torch.randint(0, 20, (8, 4), generator=g), torch.randn(8, generator=g))
        model = Dense()
        trainer(lp.FP16TruePrecision(update="compensated", optimizer_states="float32", init_scale=256.0),
                max_steps=1, callbacks=callbacks).fit(model, torch.utils.data.DataLoader([batch], batch_size=None))
        return model.moved()

    assert moved([_Replace()]) == pytest.approx(moved([]), rel=2e-2)


# ---- cached stand-ins and workspaces -------------------------------------------------------------------------------


class _PlainSGD(torch.optim.Optimizer):
    """SGD that frees each gradient once used (``p.grad = None``, as memory-saving optimizers do), or that writes
    ``p.data = p.data - lr * p.grad`` (a new tensor, not in place)."""

    rebinds = False

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.rebinds:
                    p.data = p.data - group["lr"] * p.grad
                else:
                    p.add_(p.grad, alpha=-group["lr"])
                    p.grad = None


class _DropsGradients(_PlainSGD):
    pass


class _RebindsData(_PlainSGD):
    rebinds = True


def _custom_run(make: Any, flat: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Linear(8, 8).to(torch.bfloat16)
    opt = make(net.parameters(), lr=0.1)
    step = TrueStep(torch.bfloat16, "compensated", "float32", seed=0, step_chunk=2**24)
    step.flat = flat
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        net(x).float().square().mean().backward()
        step.step(opt, None, None)
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def test_an_optimizer_that_drops_its_gradients_keeps_stepping_on_the_flat_path():
    """An optimizer that sets ``p.grad = None`` after its step (the stand-ins are kept across steps): the next step
    gives each stand-in its gradient again, and the weights keep moving, as on the per-parameter path."""
    assert_same_bits(_custom_run(_DropsGradients, True), _custom_run(_DropsGradients, False))


def test_an_optimizer_that_rebinds_param_data_lands_its_update_on_the_flat_path():
    """An optimizer that rebinds ``p.data`` (a new tensor, not an in-place update): its update lands, on the flat path
    as on the per-parameter one (the buffer's views are not the stand-ins, and a rebound stand-in is read)."""
    assert_same_bits(_custom_run(_RebindsData, True), _custom_run(_RebindsData, False))


def test_a_state_of_another_dtype_is_stored_in_the_weight_dtype_on_the_flat_path():
    """Adagrad creates its ``sum`` in ``__init__``, in fp32 (before the model is cast to bf16): stored in bf16 after a
    step on the flat path too (it kept the fp32 tensor, twice the memory), the same bits as the per-parameter path."""

    def run(flat: bool) -> Any:
        torch.manual_seed(0)
        net = nn.Linear(8, 8)
        optimizer = torch.optim.Adagrad(net.parameters(), lr=0.1)  # its `sum` made now, in fp32
        net.to(torch.bfloat16)  # (as Fabric's setup casts the model after the optimizer exists)
        step = TrueStep(torch.bfloat16, "nearest", "weight", seed=0, step_chunk=2**24)  # draws nothing
        step.flat = flat
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            net(x).float().square().sum().backward()
            step.step(optimizer, None, None)
            optimizer.zero_grad()
        return optimizer.state_dict()

    flat = run(True)
    assert all(state["sum"].dtype == torch.bfloat16 for state in flat["state"].values())
    assert_same_bits(flat, run(False))


def test_chunks_of_changing_membership_do_not_pile_up_cached_views():
    """A mixture of experts whose routed experts change each step: the workspaces are kept by layout (shapes, dtype,
    device), so the cached views stay bounded (keyed by the chunk's parameters they grew by a workspace a step)."""
    experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(64)).to(torch.bfloat16)
    params = list(experts.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    step = TrueStep(torch.bfloat16, "stochastic", "weight", seed=0, step_chunk=2**24)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        for i in torch.randperm(64, generator=g)[:32].tolist():  # half the experts routed, each step
            for p in experts[i].parameters():
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        step.step(opt, None, None)
        opt.zero_grad()
    views = sum(len(b.views) + len(w.stand_ins) for w in step._works.values() for b in w._buffers.values())
    assert views <= 16 * len(params), f"{len(step._works)} workspaces, {views} views cached for {len(params)} params"


# ---- the edges around the step -------------------------------------------------------------------------------------


def test_a_first_step_that_raises_leaves_the_optimizer_state_empty():
    """An optimizer raising at its first step (no state yet): ``optimizer.state`` stays empty (torch's distributed
    checkpoint and the plugin's state-layout step take a non-empty state for an initialised one)."""
    plugin = lpf.BF16TruePrecision()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = nn.Linear(8, 8)
    optimizer = _RaisesAfterUpdating(net.parameters(), lr=1e-2)
    optimizer.boom = True
    model, optimizer = fabric.setup(net, optimizer)
    fabric.backward(model(torch.randn(4, 8)).float().sum())
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step()
    assert optimizer.optimizer.state_dict()["state"] == {}


def test_the_rounding_meter_counts_the_same_on_both_paths():
    """fp16 values beyond 65504 keep their old weights on both paths, and the rounding meter counts them alike
    (updated, not moved): ``precision/update_lost`` and ``update_moved`` do not depend on the path."""

    def counts(flat: bool) -> list[int]:
        torch.manual_seed(0)
        net = nn.Linear(16, 16).half()
        with torch.no_grad():
            net.weight.mul_(3000)
        opt = torch.optim.SGD(net.parameters(), lr=3e3)
        step = TrueStep(torch.float16, "nearest", "weight", seed=0, step_chunk=2**24)
        step.flat, step.meter = flat, RoundingMeter()
        net(torch.randn(4, 16, dtype=torch.float16)).float().square().mean().backward()
        step.step(opt, None, None)
        return step.meter.take()[torch.float16].tolist()

    assert counts(True) == counts(False)


class _SmallFirst(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(64)  # its parameters come first, under 4096 elements: never 8-bit
        self.lin = nn.Linear(64, 128)  # 8192 weights: 8-bit states

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.lin(self.norm(batch)).float().square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_mixed_plugin_names_a_true_checkpoint_whose_first_state_is_plain(tmp_path):
    """A mixed plugin resuming a ``BF16TruePrecision(optimizer_states="8bit")`` checkpoint whose first parameters
    (a LayerNorm, under 4096 elements) are stored plainly: refused naming the plugin that wrote it, not a bare
    ``KeyError: 'exp_avg'`` at the 8-bit weight."""
    batches = torch.utils.data.DataLoader([torch.randn(4, 64, generator=torch.Generator().manual_seed(0))] * 2,
                                          batch_size=None)
    run = trainer(lp.BF16TruePrecision(optimizer_states="8bit"), max_steps=1)
    run.fit(_SmallFirst(), batches)
    run.save_checkpoint(tmp_path / "true.ckpt")
    with pytest.raises(ValueError, match=r"written by `BF16TruePrecision`"):
        trainer(lp.BF16MixedPrecision(), max_steps=2).fit(_SmallFirst(), batches, ckpt_path=tmp_path / "true.ckpt")
