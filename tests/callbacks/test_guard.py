"""FP8Guard: a layer whose fp8 numerics degrade mid-run is moved back to bf16, and training recovers.

Real torchao (``emulate=True``), real Trainer and Fabric fits. The injected degradation: from step ``INJECT`` on, the
gradient reaching layer ``b``'s output is multiplied by 1e-21 and the one leaving its input by 1e21 (identity in the
forward), as where a layer sits in a tiny stretch of the gradient's range. bf16 holds 1e-21 gradients (8 exponent bits)
and ``a`` gets its usual gradient; torchao's dynamic e5m2 scale cannot lift them (it clamps amax at 1e-12), so in fp8
``b``'s output gradients all flush to zero and nothing reaches ``a``.
"""

from __future__ import annotations

import csv
import itertools
import math
import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import BF16MixedPrecision, FP8Precision, PlanRule, PrecisionPlan
from lightning_precision import fabric as lp_fabric
from lightning_precision.callbacks import FP8Guard

pytest.importorskip("torchao")

FP8_KW = {"emulate": True, "skip_small_layers": False, "skip_first_last": False}
INJECT, EVERY, STEPS = 30, 10, 200


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``s``."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.s, None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        self.grad_scale = 1.0  # 1e-21 from INJECT on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = ScaleGrad.apply(self.b(ScaleGrad.apply(h, 1 / self.grad_scale)), self.grad_scale)
        return self.head(torch.relu(h))


class Lit(L.LightningModule):
    def __init__(self, inject_at: int = INJECT) -> None:
        super().__init__()
        self.net, self.inject_at = Net(), inject_at
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.global_step >= self.inject_at:
            self.net.grad_scale = 1e-21
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader(steps: int, size: int = 64) -> torch.utils.data.DataLoader:
    """A learnable task: labels from a fixed random two-layer teacher."""
    g = torch.Generator().manual_seed(1)
    t1, t2 = torch.randn(32, 32, generator=g), torch.randn(32, 16, generator=g)
    x = torch.randn(steps * size, 32, generator=g)
    y = (torch.tanh(x @ t1) @ t2).argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=size)


def fit(plugin, steps: int, callbacks=(), module=None, **kwargs) -> tuple[L.Trainer, Lit]:
    module = module or Lit()
    kwargs = {"logger": False, "enable_checkpointing": False, **kwargs}
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], callbacks=list(callbacks), max_steps=steps,
                        enable_progress_bar=False, enable_model_summary=False, **kwargs)
    trainer.fit(module, loader(steps))
    return trainer, module


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_the_guard_demotes_the_degraded_layer_and_training_recovers(tmp_path):
    """200 steps from the same seed, degradation injected at step 30, guard measuring every 10th step. Measured
    (torch 2.13, torchao 0.18, CPU), mean loss over steps 180-199: bf16 1.553; fp8 with the guard 1.566 (``b``
    demoted at step 39, the first measured step after the injection; ``a`` and ``head`` stay fp8); fp8 without it
    2.294 (``a`` stops learning; chance is ln 16 = 2.77)."""
    _, bf16 = fit(BF16MixedPrecision(), STEPS)
    _, unguarded = fit(FP8Precision(**FP8_KW), STEPS)
    plugin, guard = FP8Precision(**FP8_KW), FP8Guard(every_n_steps=EVERY)
    trainer, guarded = fit(plugin, STEPS, [guard], default_root_dir=tmp_path)

    assert [(e.step, e.fqn) for e in guard.events] == [(39, "net.b")]
    assert "grad_output underflow 1.00e+00" in guard.events[0].reason
    net = guarded.net
    assert (type(net.a).__name__, type(net.b), type(net.head).__name__) == ("Float8Linear", nn.Linear, "Float8Linear")
    # Same Parameter objects, still the optimizer's, with their momentum: nothing restarted.
    optimizer = trainer.optimizers[0]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in net.parameters()}
    assert "momentum_buffer" in optimizer.state[net.b.weight]
    assert [d.fqn for d in plugin.layer_decisions if d.fp8] == ["net.a", "net.head"]

    late = slice(STEPS - 20, STEPS)
    before = slice(20, 30)  # the runs are alike until the injection
    assert abs(mean(guarded.losses[before]) - mean(bf16.losses[before])) < 0.02
    assert abs(mean(guarded.losses[late]) - mean(bf16.losses[late])) < 0.1
    assert mean(unguarded.losses[late]) > mean(bf16.losses[late]) + 0.5
    assert all(math.isfinite(v) for v in guarded.losses)

    # The final plan is written, with the reason and the numbers behind it.
    saved = PrecisionPlan.load(tmp_path / "fp8_plan.yaml")
    assert saved == plugin.plan and saved.fp8_layers == {"net.a", "net.head"}
    assert saved.get("net.b").reason.startswith("FP8Guard, step 39: ")
    assert saved.get("net.b").numbers["grad_output_underflow"] == 1.0


def test_each_event_and_the_fp8_layer_count_reach_the_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    trainer, _ = fit(FP8Precision(**FP8_KW), 50, [FP8Guard(every_n_steps=EVERY)],
                     logger=CSVLogger(tmp_path, name="run"))
    rows = list(csv.DictReader(open(trainer.logger.experiment.metrics_file_path)))
    layers = [(int(r["step"]), float(r["precision/fp8_layers"])) for r in rows if r.get("precision/fp8_layers")]
    assert layers == [(9, 3.0), (19, 3.0), (29, 3.0), (39, 2.0), (49, 2.0)]
    demoted = [(int(r["step"]), r["precision/fp8_demoted/net.b"]) for r in rows if r.get("precision/fp8_demoted/net.b")]
    assert demoted == [(39, "39.0")]
    assert (trainer.logger.log_dir and (tmp_path / "run" / "version_0" / "fp8_plan.yaml").is_file())


def test_nothing_is_demoted_while_the_numerics_hold_and_steps_between_are_not_measured(tmp_path):
    guard = FP8Guard(every_n_steps=4)
    started = []
    watch = guard._start
    guard._start = lambda plugin: started.append(plugin) or watch(plugin)  # records the steps it measured
    plugin = FP8Precision(**FP8_KW)
    _, module = fit(plugin, 12, [guard], module=Lit(inject_at=10**9), default_root_dir=tmp_path)
    assert guard.events == [] and list(plugin.fp8_modules()) == ["net.a", "net.b", "net.head"]
    assert [d.fqn for d in plugin.layer_decisions if d.fp8] == ["net.a", "net.b", "net.head"]
    assert len(started) == 3  # steps 3, 7, 11: one forward each, no gradient accumulation
    assert PrecisionPlan.load(tmp_path / "fp8_plan.yaml").fp8_layers == {"net.a", "net.b", "net.head"}


def test_a_resumed_run_keeps_the_demoted_layer_in_bf16(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    first = FP8Precision(**FP8_KW)
    fit(first, 40, [FP8Guard(every_n_steps=EVERY), ModelCheckpoint(dirpath=tmp_path, filename="last")],
        enable_checkpointing=True, default_root_dir=tmp_path)
    assert first.plan.get("net.b").precision == "bf16"
    resumed, guard = FP8Precision(**FP8_KW), FP8Guard(every_n_steps=EVERY)
    module = Lit()
    trainer = L.Trainer(accelerator="cpu", plugins=[resumed], callbacks=[guard], max_steps=45, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    trainer.fit(module, loader(45), ckpt_path=str(tmp_path / "last.ckpt"))
    assert type(module.net.b) is nn.Linear and type(module.net.a).__name__ == "Float8Linear"
    assert resumed.plan == first.plan
    assert [(e.step, e.fqn) for e in guard.events] == [(39, "net.b")]  # the callback's record came back too
    assert len(module.losses) == 5 and all(math.isfinite(v) for v in module.losses)


def test_fabric_uses_the_same_three_calls(tmp_path):
    plugin = lp_fabric.FP8Precision(**FP8_KW)
    guard = FP8Guard(every_n_steps=EVERY, plan_path=tmp_path / "plan.json")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    lit = Lit()
    model, optimizer = fabric.setup(lit.net, torch.optim.SGD(lit.net.parameters(), lr=0.05, momentum=0.9))
    with pytest.warns(UserWarning, match=r"FP8Guard: step 39: 1 layer\(s\) moved one rung down: b tensorwise -> bf16"):
        for step, (x, y) in enumerate(loader(45)):
            lit.net.grad_scale = 1e-21 if step >= INJECT else 1.0
            guard.watch(plugin, step)
            fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
            guard.check(plugin, step)
            optimizer.step()
            optimizer.zero_grad()
    assert guard.save(plugin) == tmp_path / "plan.json"
    assert [(e.step, e.fqn) for e in guard.events] == [(39, "b")]
    assert type(lit.net.b) is nn.Linear and PrecisionPlan.load(tmp_path / "plan.json").fp8_layers == {"a", "head"}


def test_demote_keeps_the_module_its_hooks_and_parameters():
    from lightning_precision.fp8._torchao import demote_torchao_layer

    plugin = lp_fabric.FP8Precision(**FP8_KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    model = fabric.setup_module(net)
    layer, weight = net.b, net.b.weight
    calls = []
    layer.register_forward_hook(lambda m, i, o: calls.append(1))
    assert plugin.demote({"b": "by hand"}) == ["b"] and plugin.demote({"b": "again", "nope": "x"}) == []
    assert net.b is layer and type(layer) is nn.Linear and layer.weight is weight
    x = torch.randn(4, 32)
    with torch.inference_mode():  # validation: a plain Linear now, without the fp8 layers' inference-mode hooks
        out = model(x)
    assert calls == [1] and not out.requires_grad
    assert plugin.plan.get("b") .reason == "by hand" and plugin.plan.fp8_layers == {"a", "head"}
    with pytest.raises(TypeError, match="not torchao's Float8Linear"):
        demote_torchao_layer(layer)


def test_bad_arguments_and_setups_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps=0"):
        FP8Guard(every_n_steps=0)
    with pytest.raises(ValueError, match="pass a `lightning_precision.PlanRule`"):
        FP8Guard(rule={"min_sqnr_db": 10})
    with pytest.raises(ValueError, match="name a .yaml, .yml or .json file"):
        FP8Guard(plan_path=tmp_path / "plan.txt")
    with pytest.raises(ValueError, match="this Trainer's precision plugin is BF16MixedPrecision"):
        fit(BF16MixedPrecision(), 1, [FP8Guard()])
    assert FP8Guard(rule=PlanRule(min_sqnr_db=10)).rule.min_sqnr_db == 10


def test_while_auto_measures_there_is_nothing_to_guard(tmp_path):
    """``layers='auto'`` trains its first steps in bf16 while measuring: the guard starts with the converted layers."""
    plugin, guard = FP8Precision(layers="auto", calibration_batches=12, **FP8_KW), FP8Guard(every_n_steps=EVERY)
    fit(plugin, 45, [guard], default_root_dir=tmp_path)
    # Steps 0-11 measured by the plugin (before the injection: all pass); the guard's first measured step is 19.
    assert plugin.plan.fp8_layers == {"net.a", "net.head"}
    assert [(e.step, e.fqn) for e in guard.events] == [(39, "net.b")]


class RankInjected(Lit):
    """The degradation on rank 1 only; each rank reports which layers it demoted and which are fp8."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        if self.global_rank == 0:
            self.inject_at = 10**9
        return super().training_step(batch, batch_idx)

    def on_train_end(self):
        import json

        guard = next(c for c in self.trainer.callbacks if isinstance(c, FP8Guard))
        report = {"events": [[e.step, e.fqn] for e in guard.events],
                  "fp8": sorted(f"net.{n}" for n, m in self.net.named_children() if type(m).__name__ == "Float8Linear")}
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump(report, f)


def test_under_ddp_every_rank_demotes_the_same_layer_at_the_same_step(tmp_path):
    """The measurements are summed across ranks before the rule decides: rank 0's gradients are healthy, rank 1's
    flush, and both demote ``b`` at step 39 (half of its gradients underflow). A rank deciding alone would train
    different numerics on the same Parameters, which DDP would not notice."""
    from tests.distributed import fit_spawned

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", plugins=[FP8Precision(**FP8_KW)],
                        callbacks=[FP8Guard(every_n_steps=EVERY)], max_steps=40, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    reports = fit_spawned(trainer, RankInjected(str(tmp_path)), loader(80), tmp_path)
    assert reports[0] == reports[1] == {"events": [[39, "net.b"]], "fp8": ["net.a", "net.head"]}


def test_a_measured_step_that_saw_no_layer_is_said_not_watched():
    """When none of the probe's hooks run with gradients on (here the measured step's forward runs under no_grad), the
    guard would watch nothing and report nothing: it says so, once. (Under torch.compile the measured step runs
    eagerly, so the hooks always run there: tested below.)"""
    from lightning_precision import NoEffectWarning

    plugin, guard = lp_fabric.FP8Precision(**FP8_KW), FP8Guard(every_n_steps=1)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(Net())
    x = torch.randn(8, 32)
    with pytest.warns(NoEffectWarning, match="none of the 3 fp8 layers' forward hooks ran"):
        for step in range(3):
            guard.watch(plugin, step)
            with torch.no_grad():
                model(x)
            assert guard.check(plugin, step) == []
    assert guard.events == [] and guard._blind


def test_layers_that_could_not_move_back_are_refused_before_training():
    """fp8 all-gather's weights are torchao tensor subclasses: demoting them in place is impossible, so the guard
    refuses them at its first call (Trainer: at fit start), not with a crash at the first demotion mid-run."""
    plugin = lp_fabric.FP8Precision(fsdp_float8_all_gather=True, **FP8_KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    try:
        fabric.setup_module(Net())
    except RuntimeError as err:  # torch < 2.8: the plugin itself refuses float8 all-gather here
        pytest.skip(f"float8 all-gather unavailable here: {err}")
    assert plugin._float8_all_gather
    with pytest.raises(ValueError, match="all-gather their weights in fp8"):
        FP8Guard().watch(plugin, 0)


# ---- where the plan is written ---------------------------------------------------------


def test_the_default_plan_file_never_replaces_a_file_this_run_did_not_write(tmp_path, monkeypatch, caplog):
    """``Trainer(logger=False)`` logs into ``default_root_dir``, the working directory by default, where a user keeps
    their own ``fp8_plan.yaml``: the guard creates its own file beside it (``fp8_plan-1.yaml``), says where, and
    rewrites only that one. A second run there gets the next name; a link named like the default is not written
    through."""
    import logging

    monkeypatch.chdir(tmp_path)
    (tmp_path / "fp8_plan.yaml").write_text("# my hand-made plan\n")
    (tmp_path / "fp8_plan-2.yaml").symlink_to(tmp_path / "elsewhere.yaml")  # a dangling link: not ours either
    runs = []
    for _ in range(2):
        plugin, guard = FP8Precision(**FP8_KW), FP8Guard(every_n_steps=EVERY)
        with caplog.at_level(logging.INFO):
            fit(plugin, 12, [guard])  # logger=False, no default_root_dir: the working directory
        runs.append((plugin, guard))
    assert (tmp_path / "fp8_plan.yaml").read_text() == "# my hand-made plan\n"
    assert not (tmp_path / "elsewhere.yaml").exists()
    assert [g.plan_file for _, g in runs] == [tmp_path / "fp8_plan-1.yaml", tmp_path / "fp8_plan-3.yaml"]
    for plugin, guard in runs:
        assert PrecisionPlan.load(guard.plan_file) == plugin.plan_in_force()
        assert f"plan in force is written to {guard.plan_file}" in caplog.text


def test_an_unwritable_plan_path_fails_at_setup_before_any_step(tmp_path):
    (tmp_path / "a_file").write_text("")
    module = Lit()
    with pytest.raises(ValueError, match=r"FP8Guard\(plan_path=.*a_file/plan.yaml'\).*not a folder"):
        fit(FP8Precision(**FP8_KW), 4, [FP8Guard(plan_path=tmp_path / "a_file" / "plan.yaml")], module=module)
    assert module.losses == []  # refused before the first step, not after training
    (tmp_path / "plan.yaml").mkdir()
    with pytest.raises(ValueError, match="is a folder; name a file"):
        fit(FP8Precision(**FP8_KW), 4, [FP8Guard(plan_path=tmp_path / "plan.yaml")], module=module)
    assert module.losses == []
    # With Fabric, at the first `watch`: before the first forward.
    plugin, guard = lp_fabric.FP8Precision(**FP8_KW), FP8Guard(plan_path=tmp_path / "a_file" / "plan.json")
    L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(Net())
    with pytest.raises(ValueError, match="not a folder"):
        guard.watch(plugin, 0)


def test_the_default_plan_directory_is_checked_at_setup(tmp_path):
    (tmp_path / "a_file").write_text("")
    module = Lit()
    with pytest.raises(ValueError, match=r"FP8Guard \(the plan file goes in the log directory"):
        fit(FP8Precision(**FP8_KW), 4, [FP8Guard()], module=module, default_root_dir=tmp_path / "a_file")
    assert module.losses == []


def test_runs_starting_together_in_one_directory_get_a_file_each(tmp_path):
    """The default file is created exclusively (O_EXCL): writers racing for the same name (8 threads here; processes
    race the same way at the file system) never share one."""
    from concurrent.futures import ThreadPoolExecutor

    from lightning_precision._io import create_new_file

    with ThreadPoolExecutor(8) as pool:
        names = list(pool.map(lambda _: create_new_file(tmp_path, "fp8_plan.yaml").name, range(8)))
    assert sorted(names) == sorted(["fp8_plan.yaml"] + [f"fp8_plan-{i}.yaml" for i in range(1, 8)])


def test_a_plan_file_that_cannot_be_written_after_setup_warns_and_the_fit_finishes(tmp_path):
    """The plan's folder goes away after the setup check (a file takes its place, as a full disk or a removed mount
    would fail the write): the write after the demotion stopped the fit mid-run, and the one at the end a finished fit,
    with a bare OSError naming neither the guard nor the file. Each failed write now warns with the file, the error and
    how to save the plan from the plugin, and the fit runs to its end."""

    class TakeTheFolder(L.Callback):
        def on_train_start(self, trainer, pl_module):
            (tmp_path / "plans").rmdir()
            (tmp_path / "plans").write_text("")

    plugin, module = FP8Precision(**FP8_KW), Lit(inject_at=0)
    guard = FP8Guard(every_n_steps=2, plan_path=tmp_path / "plans" / "plan.yaml")
    demoted = pytest.warns(UserWarning, match=r"FP8Guard: step 1: 1 layer\(s\) moved one rung down: net.b")
    with demoted, pytest.warns(UserWarning, match=r"FP8Guard: could not write the fp8 plan to '.*plans/plan.yaml' \(.*"
                                                  r"File exists.*trainer.precision_plugin.plan_in_force\(\).save") as record:
        fit(plugin, 4, [guard, TakeTheFolder()], module=module)
    assert len(module.losses) == 4
    assert [(e.step, e.fqn) for e in guard.events] == [(1, "net.b")]
    assert "net.b" not in plugin.plan.fp8_layers
    assert sum("could not write the fp8 plan" in str(w.message) for w in record) == 2  # at the demotion, at the end


def test_a_measured_step_with_no_tokens_is_not_taken_for_hooks_that_never_ran():
    """An empty batch on a measured step: the fp8 layers ran, on no tokens, so there was nothing to measure.
    The guard said their hooks never ran and blamed torch.compile, and, warning only once, then stayed silent
    when a later step really was not watched (here: the layers run without gradients)."""

    class EmptyThenBlind(Lit):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 1:
                x, y = x[:0], y[:0]
            if batch_idx == 3:
                with torch.no_grad():
                    out = self.net(x)
                return nn.functional.cross_entropy(out.float(), y) + 0 * sum(p.sum() for p in self.parameters())
            return super().training_step((x, y), batch_idx)

    guard = FP8Guard(every_n_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(FP8Precision(**FP8_KW), 4, [guard], module=EmptyThenBlind(inject_at=10**6))
    blind = [str(w.message) for w in record if "forward hooks ran with gradients" in str(w.message)]
    assert len(blind) == 1 and blind[0].startswith("FP8Guard: step 3 was measured"), blind


# ---- compiled models, and hooks that replace a layer's output ------------------------------------


class Deep(nn.Module):
    """Nine fp8 layers of nine shapes (more than dynamo's recompile limit of 8), the middle one degraded from the first
    step as ``Net.b`` is (its output gradients 1e-21: fp8 flushes them)."""

    DIMS = (32, 48, 64, 80, 96, 112, 128, 144, 160, 16)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(self.DIMS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i == 4:
                x = ScaleGrad.apply(layer(ScaleGrad.apply(x, 1e21)), 1e-21)
            else:
                x = layer(x)
            x = torch.relu(x) if i < len(self.layers) - 1 else x
        return x


class Compiled(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Deep()

    def on_fit_start(self) -> None:
        # As docs/plugins/fp8.md says: compile after the plugin converted the model. The eager backend: dynamo's
        # guards and recompiles are the same as inductor's, without its minutes of code generation.
        self.net = torch.compile(self.net, backend="eager")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_compiled_model_is_guarded_without_recompiling_and_the_degraded_layer_is_found(tmp_path):
    """Compiled, the probe's hooks broke the graph at every fp8 layer on a measured step, and dynamo compiled each
    layer's forward and the hook once per layer shape: this model's nine shapes hit ``recompile_limit`` (8) at the
    first measured step (here made an error, ``fail_on_recompile_limit_hit``). The measured steps now run eagerly and
    leave the compiled graph alone: two frames compiled in all on torch 2.13 (the graph, and its recompile once the
    plugin's first-step watch hooks go), the degraded layer demoted at the first measured step, the stance
    restored."""
    import torch._dynamo
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: frames an earlier test compiled would count here
    x = torch.randn(6 * 16, 32, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.randint(0, 16, (6 * 16,))),
                                       batch_size=16)
    guard = FP8Guard(every_n_steps=2)
    # torch >= 2.8 can make hitting the limit an error; before, it is a warning and the frame count tells.
    strict = {"fail_on_recompile_limit_hit": True} if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit") else {}
    try:
        with torch._dynamo.config.patch(**strict):
            L.Trainer(accelerator="cpu", plugins=[FP8Precision(**FP8_KW)], callbacks=[guard], max_steps=6,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=tmp_path).fit(Compiled(), data)
        frames = dict(torch._dynamo.utils.counters["frames"])
    finally:
        torch._dynamo.reset()
    assert [(e.step, e.fqn) for e in guard.events] == [(1, "net.layers.4")]
    assert frames["total"] == frames["ok"] <= 3, frames  # 2 on torch 2.13
    assert torch._dynamo.eval_frame._stance.stance == "default"  # the eager stance ends with the measured step


def test_the_guard_measures_what_the_layer_produced_not_what_a_later_hook_made_of_it():
    """A forward hook of the user's replaces ``b``'s output with one whose backward scales the gradient by 1e-21 on its
    way into ``b`` (and a pre-hook undoes it for ``a``): ``b``'s fp8 backward gets gradients that flush. The guard's
    hook used to run after the user's and measure the replaced output's gradient (healthy): ``b`` stayed in fp8. Its
    hook now runs first and measures the layer's own output, whose gradient is the one fp8 casts."""
    plugin, guard = lp_fabric.FP8Precision(**FP8_KW), FP8Guard(every_n_steps=1)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    net.b.register_forward_pre_hook(lambda module, args: (ScaleGrad.apply(args[0], 1e21),))
    net.b.register_forward_hook(lambda module, args, output: ScaleGrad.apply(output, 1e-21))
    x, y = torch.randn(16, 32), torch.randint(0, 16, (16,))
    guard.watch(plugin, 0)
    fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
    with pytest.warns(UserWarning, match=r"FP8Guard: step 0: 1 layer\(s\) moved one rung down: b tensorwise -> bf16"):
        events = guard.check(plugin, 0)
    assert [e.fqn for e in events] == ["b"] and "grad_output" in events[0].reason
