"""The true-precision step on flat buffers (issue 35): the same bits as the per-parameter path, a constant number of
aten ops and no host read per step, whatever the number of parameters, and the edges of the step it closed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_precision._core.true.step import TrueStep
from lightning_precision._upstream.torch import DispatchCounter
from tests.helpers import assert_same_bits

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
    assert_same_bits(flat, loose)


@pytest.mark.parametrize(("update", "states"), DRAWLESS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_checkpoint_of_the_per_parameter_step_resumes_on_the_flat_one(dtype, update, states):
    """The per-parameter path is the step before issue 35: its optimizer state (2 steps), loaded into a fresh
    optimizer stepped on the flat path, trains on (2 more steps) to the bits the per-parameter path reaches."""
    def run(flat_after: bool) -> tuple[list[torch.Tensor], dict[str, Any]]:
        net = _net(dtype)
        opt = OPTIMIZERS["adamw"](net.parameters())
        before = TrueStep(dtype, update, states, seed=0, step_chunk=2**24)
        before.flat = False
        for i in range(2):
            _loss(net, i).backward()
            before.step(opt, None, None)
            opt.zero_grad()
        saved = copy.deepcopy(opt.state_dict())
        resumed = OPTIMIZERS["adamw"](net.parameters())
        resumed.load_state_dict(saved)
        after = TrueStep(dtype, update, states, seed=0, step_chunk=2**24)
        after.flat = flat_after
        for i in range(2, 4):
            _loss(net, i).backward()
            after.step(resumed, None, None)
            resumed.zero_grad()
        return [p.detach().clone() for p in net.parameters()], resumed.state_dict()

    assert_same_bits(run(True), run(False))


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
    assert_same_bits(flat, loose)
    assert all(torch.isfinite(p).all() for p in flat)


@pytest.mark.parametrize("update", ["stochastic", "compensated", "nearest"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overflow", [False, True])
def test_the_landing_an_accelerator_takes_equals_the_cpus(monkeypatch, update, dtype, overflow):
    """On an accelerator every weight lands through the element-wise check (no host read); on a CPU a chunk whose new
    values all fit skips it. Both land the same bits, with and without values the format cannot hold."""

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).to(dtype)
        if overflow:
            with torch.no_grad():
                net[0].weight.mul_(3000)
        optimizer = torch.optim.SGD(net.parameters(), lr=3e3 if overflow else 1e-2, momentum=0.9)
        step = TrueStep(dtype, update, "weight", seed=0, step_chunk=300)  # several chunks
        for _ in range(3):
            net(torch.randn(8, 16, dtype=dtype)).float().square().mean().backward()
            step.step(optimizer, None, None)
            optimizer.zero_grad()
        return [p.detach().clone() for p in net.parameters()]

    cpu = run()
    from lightning_precision._core.true import flat as true_flat

    monkeypatch.setattr(true_flat, "reads_are_free", lambda device: False)
    accelerator = run()
    assert_same_bits(cpu, accelerator)
    assert all(torch.isfinite(p).all() for p in cpu)


def test_stochastic_rounding_repeats():
    """Stochastic rounding on the flat path: the same run twice lands the same bits; other seeds, other bits."""
    a = _train(torch.bfloat16, "stochastic", "weight", "adamw", flat=True)
    b = _train(torch.bfloat16, "stochastic", "weight", "adamw", flat=True)
    assert_same_bits(a, b)
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
def test_the_step_adds_a_constant_number_of_ops_and_reads_nothing(dtype, update, states, monkeypatch):
    """Counted with a TorchDispatchMode over one step after the states exist, against the same foreach AdamW stepped
    plainly (torch's own ops: a constant number per group, and a host read of each CPU step count): what our step
    adds is the same number of aten ops for 4 and 32 layers, and no host read, as on an accelerator (where a read
    would wait for the device; on a CPU the step reads one flag a chunk to skip the element-wise check)."""
    from lightning_precision._core.true import flat as true_flat

    monkeypatch.setattr(true_flat, "reads_are_free", lambda device: False)
    added = []
    for layers in (4, 32):
        ours = _counted_step(dtype, update, states, layers)
        plain = _counted_step(dtype, update, states, layers, ours=False)
        assert ours.host_reads == plain.host_reads
        added.append(len(ours.names) - len(plain.names))
    assert added[0] == added[1], added


# ---- the edges of the step (issue 35) -------------------------------------------------------------------------------

import lightning as L  # noqa: E402

import lightning_precision as lp  # noqa: E402
from tests.helpers import LitNet, loader, make_data, trainer  # noqa: E402

PLUGINS = [lp.BF16TruePrecision, lp.FP16TruePrecision]


class _WithOptimizer(LitNet):
    def __init__(self, make: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self.parameters())


def _one_batch(steps: int) -> torch.utils.data.DataLoader:
    """The same batch every step: a run resumed mid-epoch (its loader starts over) sees what the whole run sees."""
    x, y = make_data(1)[:]
    return torch.utils.data.DataLoader([(x, y)] * steps, batch_size=None)


def _fit_and_resume(plugin: Any, make: Any, tmp_path: Any) -> Any:
    """4 steps in one fit against 2 + a checkpoint + 2 resumed: the same weights, bit for bit."""
    whole = _WithOptimizer(make)
    trainer(plugin(), max_steps=4).fit(whole, _one_batch(4))
    first = _WithOptimizer(make)
    run = trainer(plugin(), max_steps=2)
    run.fit(first, _one_batch(4))
    run.save_checkpoint(tmp_path / "half.ckpt")
    resumed = _WithOptimizer(make)
    again = trainer(plugin(), max_steps=4)
    again.fit(resumed, _one_batch(4), ckpt_path=tmp_path / "half.ckpt")
    assert_same_bits([p.detach() for p in resumed.parameters()], [p.detach() for p in whole.parameters()])
    return again.optimizers[0]


RESUMED = {
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
    "nadam": lambda params: torch.optim.NAdam(params, lr=1e-2),
    "asgd": lambda params: torch.optim.ASGD(params, lr=1e-2, t0=1),
}


@pytest.mark.parametrize("name", sorted(RESUMED))
@pytest.mark.parametrize("plugin", PLUGINS)
def test_an_optimizers_own_fp32_values_resume_exactly(plugin, name, tmp_path):
    """Adafactor's factored moments, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``: fp32 values that are not
    per-element states, which torch's load casts to the weight dtype. Kept as their two 16-bit halves, they come back
    exact: the resumed run is the uninterrupted one (Adafactor crashed at the first resumed step; NAdam and ASGD
    drifted), and the optimizer sees them in fp32 again."""
    optimizer = _fit_and_resume(plugin, RESUMED[name], tmp_path)
    found = 0
    for p, state in optimizer.state.items():
        own = [k for k, v in state.items() if isinstance(k, str) and not k.startswith("lp.") and k != "step"
               and v.dtype == torch.float32 and v.shape != p.shape]
        assert all(f"lp.hi.{k}" in state and f"lp.lo.{k}" in state for k in own)
        found += len(own)
    assert found


@pytest.mark.parametrize("plugin", PLUGINS)
def test_sparse_adam_trains_over_a_sparse_embedding(plugin, tmp_path):
    """``SparseAdam`` over ``nn.Embedding(sparse=True)`` (it takes sparse gradients only): the step keeps the gradient
    sparse, widened; the run trains (finite, the loss falls) and resumes exactly, as Lightning's ``bf16-true``
    trains it."""

    class Embedded(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embedding = nn.Embedding(50, 8, sparse=True)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids, target = batch
            loss = (self.embedding(ids).float().sum((-1, -2)) - target).square().mean()
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SparseAdam(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 50, (8, 4), generator=g), torch.randn(8, generator=g))

    def fit(steps: int, model: Any, **kwargs: Any) -> L.Trainer:
        run = trainer(plugin(), max_steps=steps)  # one batch every step: the resumed loader starts over
        run.fit(model, torch.utils.data.DataLoader([batch] * steps, batch_size=None), **kwargs)
        return run

    whole = Embedded()
    fit(16, whole)
    assert torch.isfinite(whole.embedding.weight).all()
    assert sum(whole.losses[-4:]) < sum(whole.losses[:4])
    first = Embedded()
    fit(8, first).save_checkpoint(tmp_path / "half.ckpt")
    resumed = Embedded()
    fit(16, resumed, ckpt_path=tmp_path / "half.ckpt")
    assert_same_bits(resumed.embedding.weight.detach(), whole.embedding.weight.detach())


class _Counting(torch.optim.Optimizer):
    """SGD of its own (not torch's class: stepped once a step, on the whole model), recording what each call saw."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.seen: list[int] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.seen.append(sum(p.numel() for p in params))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("plugin", PLUGINS)
def test_an_optimizer_not_known_to_step_each_parameter_apart_is_stepped_once_a_step(plugin):
    """An optimizer of unknown kind (a group-level counter, a global norm inside ``step``) at ``step_chunk=64``, far
    under the model's size: one ``step()`` a training step, seeing every parameter."""
    model = _WithOptimizer(lambda params: _Counting(params, lr=0.1))
    trainer(plugin(step_chunk=64), max_steps=3).fit(model, loader(make_data(3)))
    total = sum(p.numel() for p in model.parameters())
    assert model.optimizers().optimizer.seen == [total] * 3


def test_fp16_true_clips_for_a_fused_optimizer():
    """``FP16TruePrecision`` + ``Adam(fused=True)`` + ``gradient_clip_val``: clipped in fp32 inside the step (it
    refused, as for a fused optimizer under a mixed plugin, which never applies here: the optimizer steps fp32
    stand-ins)."""
    def run(clip: float | None) -> list[torch.Tensor]:
        model = _WithOptimizer(lambda params: torch.optim.Adam(params, lr=1e-2, fused=True))
        trainer(lp.FP16TruePrecision(), max_steps=3, gradient_clip_val=clip).fit(model, loader(make_data(3)))
        return [p.detach().clone() for p in model.parameters()]

    clipped, free = run(1e-3), run(None)
    assert all(torch.isfinite(p).all() for p in clipped)
    assert not all(torch.equal(a, b) for a, b in zip(clipped, free, strict=True))


class _GradNorms(L.Callback):
    def __init__(self, clip: float | None = None) -> None:
        self.norms: list[float] = []
        self.clip = clip

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))))
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(pl_module.parameters(), self.clip)


def test_fp16_true_shows_the_hooks_unscaled_gradients():
    """``on_before_optimizer_step`` under ``FP16TruePrecision`` sees the gradients unscaled, as under every other
    plugin (it saw them at the loss scale: a norm 2**15 times too large): the norm logged at the first step is the
    bf16 plugin's, to fp16's precision."""
    norms = {}
    for plugin in PLUGINS:
        seen = _GradNorms()
        trainer(plugin(), max_steps=1, callbacks=[seen]).fit(_WithOptimizer(
            lambda params: torch.optim.AdamW(params, lr=1e-3)), loader(make_data(1)))
        norms[plugin] = seen.norms[0]
    assert norms[lp.FP16TruePrecision] == pytest.approx(norms[lp.BF16TruePrecision], rel=2e-2)


def test_a_clip_by_hand_in_the_hook_clips_the_real_update_under_fp16_true():
    """A clip by hand in ``on_before_optimizer_step`` acts on the unscaled gradients, and the step takes what the hook
    left: the update is the one ``gradient_clip_val`` at the same bound gives (it was 2**15 times too small)."""
    def moved(**kwargs: Any) -> float:
        model = _WithOptimizer(lambda params: torch.optim.SGD(params, lr=0.5))
        before = [p.detach().float().clone() for p in model.parameters()]
        run = trainer(lp.FP16TruePrecision(update="compensated", optimizer_states="float32"), max_steps=1, **kwargs)
        run.fit(model, loader(make_data(1)))
        after = [p.detach().float() for p in model.parameters()]
        return float(sum((a - b).square().sum() for a, b in zip(after, before, strict=True)).sqrt())

    by_hand = moved(callbacks=[_GradNorms(clip=0.01)])
    by_trainer = moved(gradient_clip_val=0.01)
    assert by_hand == pytest.approx(by_trainer, rel=2e-2)
    assert by_hand == pytest.approx(0.5 * 0.01, rel=5e-2)  # lr times the clipped norm


def test_a_mixed_plugin_names_a_true_precision_checkpoint(tmp_path):
    """A checkpoint of ``FP16TruePrecision`` (its Adam states stored at a power of two, under keys of its own) resumed
    by a mixed plugin: refused naming the plugin that wrote it and the fix, not a bare ``KeyError: 'exp_avg'``."""
    make = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    run = trainer(lp.FP16TruePrecision(), max_steps=1)
    run.fit(_WithOptimizer(make), loader(make_data(2)))
    run.save_checkpoint(tmp_path / "true.ckpt")
    for plugin in (lp.BF16MixedPrecision(), lp.FP16MixedPrecision()):
        with pytest.raises(ValueError, match=r"written by `FP16TruePrecision`.*'exp_avg'.*lp\.f16\.exp_avg.*Resume"):
            trainer(plugin, max_steps=2).fit(_WithOptimizer(make), loader(make_data(2)),
                                             ckpt_path=tmp_path / "true.ckpt")


def test_the_true_plugins_errors_say_what_they_are():
    """A device the model is not on names no autocast (these plugins cast the model); an invalid ``init_scale`` cites
    ``FP16TruePrecision``'s own default, 2**15."""
    with pytest.raises(ValueError, match=r"e\.g\. 32768\.0 \(the default\)"):
        lp.FP16TruePrecision(init_scale=float("nan"))
    plugin = lp.BF16TruePrecision(device="cuda")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = nn.Linear(2, 2)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters()))
    with pytest.raises(ValueError, match=r"names the device the model trains on, but the model lives on 'cpu'") as e:
        fabric.backward(model(torch.randn(2, 2)).sum())
        optimizer.step()
    assert "autocast" not in str(e.value)


def test_an_explicit_cuda_device_without_cuda_is_refused_in_words_and_builds_no_disabled_scaler(recwarn):
    """torch's scaler built for a device this process lacks warns and disables itself; the bf16 check asked torch for
    a capability it cannot give (a bare AssertionError)."""
    plugin = lp.BF16TruePrecision(device="cuda")
    assert not [w for w in recwarn if "GradScaler" in str(w.message)]
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the device exists")
    with pytest.raises(RuntimeError, match=r"this process has no CUDA GPU.*device=None"):
        plugin.resolve_device()
