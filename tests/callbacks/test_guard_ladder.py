"""FP8Guard's ladder (MXFP8 -> per-tensor/row fp8 -> high precision, one rung per measured step), FP8Precision.step_down,
and the early divergence signals (input kurtosis, amax growth). Real torchao (``emulate=True``), real Trainer and Fabric
fits, real optimizers."""

from __future__ import annotations

import csv
import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import FP8Precision, NoEffectWarning, PlanRule
from lightning_precision import fabric as lp_fabric
from lightning_precision.callbacks import FP8Guard
from lightning_precision.callbacks.guard import GuardEvent

pytest.importorskip("torchao")

from lightning_precision.fp8._torchao import layer_format, set_layer_format  # noqa: E402  (needs torchao)
from tests.helpers import has_mxfp8, rowwise_emulates_on_cpu  # noqa: E402

FP8_KW = {"emulate": True, "skip_small_layers": False, "skip_first_last": False}
FAIL_ALL = PlanRule(min_sqnr_db=1e9)  # no real cast reaches it: every measured layer fails
# The guard measures MXFP8 layers once the probe measures block casts (MEASURED_BLOCK_FORMATS).
needs_mxfp8 = pytest.mark.skipif(not has_mxfp8(), reason="this torchao has no MXFP8 training layer (torchao 0.11)")
needs_rowwise = pytest.mark.skipif(not rowwise_emulates_on_cpu(),
                                   reason="this torchao cannot emulate rowwise under CPU autocast (torchao 0.11)")


class Net(nn.Module):
    """Dims and tokens multiples of 32: every layer can run in MXFP8."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(steps: int, size: int = 32) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * size, 64, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.randint(0, 32, (steps * size,),
                                                                                       generator=g)), batch_size=size)


def trainer(plugin, steps: int, callbacks=(), **kwargs) -> L.Trainer:
    kwargs = {"logger": False, "enable_checkpointing": False, **kwargs}
    return L.Trainer(accelerator="cpu", plugins=[plugin], callbacks=list(callbacks), max_steps=steps,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def formats(net: nn.Module) -> dict[str, str | None]:
    return {name: layer_format(m) for name, m in net.named_children()}


def adam_state(optimizer) -> dict[int, dict[str, torch.Tensor]]:
    return {id(p): {k: v for k, v in optimizer.state[p].items()} for g in optimizer.param_groups for p in g["params"]}


@needs_mxfp8
def test_step_down_keeps_the_module_its_parameters_and_the_optimizer_state():
    """mxfp8 -> tensorwise -> bf16 by hand, between real AdamW steps: the same module object and Parameters at each
    rung, the optimizer's state the same tensors with the same values, the plan and the decisions saying the format."""
    plugin = lp_fabric.FP8Precision(recipe="mxfp8", **FP8_KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    x = torch.randn(32, 64)

    def step() -> None:
        fabric.backward(model(x).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()

    step()
    assert formats(net) == {"a": "mxfp8", "b": "mxfp8", "head": "mxfp8"}
    layer, params = net.b, list(net.b.parameters())
    for expected in ("tensorwise", "bf16"):
        state = adam_state(optimizer)
        values = {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()}
        assert plugin.step_down({"b": "by hand"}, {"b": {"output_error": 0.5}}) == {"b": expected}
        assert net.b is layer and list(net.b.parameters()) == params
        assert all(p is q for p, q in zip(net.b.parameters(), params, strict=True))
        after = adam_state(optimizer)
        assert after.keys() == state.keys()
        for i, s in state.items():
            assert all(after[i][k] is v and torch.equal(v, values[i][k]) for k, v in s.items())
        entry = plugin.plan.get("b")
        assert (entry.precision, entry.reason, entry.numbers) == (expected, "by hand", {"output_error": 0.5})
        decision = next(d for d in plugin.layer_decisions if d.fqn == "b")
        assert decision.fp8 == (expected != "bf16") and decision.format == (None if expected == "bf16" else expected)
        step()  # trains on in the new format, with the same optimizer
        with torch.inference_mode():  # validation: the layer's inference-mode hooks are the new format's
            assert not model(x).requires_grad
    assert formats(net) == {"a": "mxfp8", "b": None, "head": "mxfp8"}
    assert plugin.step_down({"b": "again"}) == {}  # high precision is the bottom: nothing moves
    assert {d.fqn for d in plugin.layer_decisions if d.fp8} == {"a", "head"} == set(plugin.fp8_modules())


@needs_mxfp8
@needs_rowwise
def test_the_rung_below_mxfp8_is_the_plugins_own_per_row_recipe():
    """A rowwise plugin's layer put in MXFP8 (as a plan of mixed formats does) steps down to rowwise, not tensorwise."""
    plugin = lp_fabric.FP8Precision(recipe="rowwise", **FP8_KW)
    net = Net()
    L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(net)
    set_layer_format(net.a, "mxfp8", emulate=True)
    assert plugin.step_down({"a": "by hand", "b": "by hand"}) == {"a": "rowwise", "b": "bf16"}
    assert formats(net) == {"a": "rowwise", "b": None, "head": "rowwise"}


@needs_mxfp8
def test_step_down_by_another_name_and_of_a_layer_not_run_yet():
    """A layer registered under two names moves by either; an expert no token has reached yet moves too, stays
    reported not fp8 until it runs, then is reported in the format it stepped to."""

    class Net2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.expert = nn.Linear(64, 64), nn.Linear(64, 64)
            self.alias = self.a
            self.route = False

        def forward(self, x):
            x = self.alias(self.a(x))
            return self.expert(x) if self.route else x

    plugin, net = lp_fabric.FP8Precision(recipe="mxfp8", **FP8_KW), Net2()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(net)
    with pytest.warns(NoEffectWarning, match=r"did not run their forward in the first training step: expert\."):
        fabric.backward(model(torch.randn(32, 64)).float().sum())
    assert plugin.step_down({"alias": "by the other name", "expert": "not run yet"}) == {
        "a": "tensorwise", "expert": "tensorwise"}
    assert layer_format(net.a) == layer_format(net.expert) == "tensorwise"
    assert not next(d for d in plugin.layer_decisions if d.fqn == "expert").fp8  # still not run
    net.route = True
    fabric.backward(model(torch.randn(32, 64)).float().sum())
    expert = next(d for d in plugin.layer_decisions if d.fqn == "expert")
    assert (expert.fp8, expert.format, plugin.plan.get("expert").precision) == (True, "tensorwise", "tensorwise")


def test_demote_and_step_down_refuse_transformer_engine_layers():
    """Transformer Engine's layers (NVFP4 included) cannot change format in place: a clear error naming the call.
    (No Transformer Engine here: the backend is set by hand on a torchao plugin, after conversion.)"""
    plugin, net = lp_fabric.FP8Precision(**FP8_KW), Net()
    L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(net)
    plugin.backend = "transformer_engine"
    with pytest.raises(RuntimeError, match=r"FP8Precision.step_down: Transformer Engine layers cannot return to high precision in place, nor change format \(NVFP4 included\)"):
        plugin.step_down({"a": "x"})
    with pytest.raises(ValueError, match="Transformer Engine layers"):
        FP8Guard().watch(plugin, 0)


@needs_mxfp8
def test_a_failing_layer_steps_down_one_rung_per_measured_step_under_the_trainer(tmp_path):
    plugin, module = FP8Precision(recipe="mxfp8", **FP8_KW), Lit()
    guard = FP8Guard(every_n_steps=2, rule=FAIL_ALL)
    fit = trainer(plugin, 6, [guard], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"FP8Guard: step 1: 3 layer\(s\) moved one rung down: net.a mxfp8 -> tensorwise"), \
            pytest.warns(UserWarning, match=r"FP8Guard: step 3: 3 layer\(s\) moved one rung down: net.a tensorwise -> bf16"):
        fit.fit(module, loader(6))
    assert [(e.step, e.fqn, e.to) for e in guard.events] == [
        *((1, f"net.{n}", "tensorwise") for n in ("a", "b", "head")),
        *((3, f"net.{n}", "bf16") for n in ("a", "b", "head"))]
    assert formats(module.net) == {"a": None, "b": None, "head": None}
    optimizer = fit.optimizers[0]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in module.net.parameters()}
    assert all(math.isfinite(v) for v in module.losses) and len(module.losses) == 6


@needs_mxfp8
def test_without_the_ladder_a_failing_layer_goes_straight_to_high_precision(tmp_path):
    plugin, module = FP8Precision(recipe="mxfp8", **FP8_KW), Lit()
    guard = FP8Guard(every_n_steps=2, rule=FAIL_ALL, ladder=False)
    with pytest.warns(UserWarning, match=r"FP8Guard: step 1: 3 layer\(s\) moved back to torch.bfloat16: net.a mxfp8 -> bf16"):
        trainer(plugin, 4, [guard], default_root_dir=tmp_path).fit(module, loader(4))
    assert [(e.step, e.to) for e in guard.events] == [(1, "bf16")] * 3
    assert formats(module.net) == {"a": None, "b": None, "head": None}


def test_without_the_ladder_the_guard_demotes(tmp_path):
    """``ladder=False`` is the guard as it was: ``demote``, straight to the compute dtype (here from tensorwise, one rung
    either way; the MXFP8 case above is where they differ)."""
    plugin, module = FP8Precision(**FP8_KW), Lit()
    guard = FP8Guard(every_n_steps=2, rule=FAIL_ALL, ladder=False)
    with pytest.warns(UserWarning, match=r"FP8Guard: step 1: 3 layer\(s\) moved back to torch.bfloat16: net.a tensorwise"):
        trainer(plugin, 2, [guard], default_root_dir=tmp_path).fit(module, loader(2))
    assert [(e.step, e.fqn, e.to) for e in guard.events] == [(1, f"net.{n}", "bf16") for n in ("a", "b", "head")]
    assert plugin.plan.fp8_layers == frozenset()


def test_the_signals_reach_the_logger_on_measured_steps_only(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    fit = trainer(FP8Precision(**FP8_KW), 6, [FP8Guard(every_n_steps=3)], logger=CSVLogger(tmp_path, name="run"),
                  log_every_n_steps=1)
    fit.fit(Lit(), loader(6))
    rows = list(csv.DictReader(open(fit.logger.experiment.metrics_file_path)))
    kurtosis = {int(r["step"]): float(r["precision/fp8_kurtosis/net.a"]) for r in rows
                if r.get("precision/fp8_kurtosis/net.a")}
    growth = {int(r["step"]): float(r["precision/fp8_amax_growth/net.b"]) for r in rows
              if r.get("precision/fp8_amax_growth/net.b")}
    assert sorted(kurtosis) == sorted(growth) == [2, 5]  # the measured steps, not the four between
    assert all(abs(k - 3) < 0.5 for k in kurtosis.values())  # net.a reads Gaussian batches
    assert growth[2] == 1.0 and 0.2 < growth[5] < 5
    assert all(r.get(f"precision/fp8_kurtosis/net.{n}") for r in rows if int(r["step"]) in (2, 5)
               and r.get("precision/fp8_kurtosis/net.a") for n in ("b", "head"))


class TwoInputs(nn.Module):
    """``heavy`` reads the first input, ``gauss`` the second: each layer's input is what the test feeds it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heavy, self.gauss = nn.Linear(64, 32), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.heavy(x) + self.gauss(z)


def fabric_loop(guard: FP8Guard, inputs, steps: int = 4):
    """The Fabric loop the docs show: ``watch`` before the forward, ``check`` after the backward."""
    plugin = lp_fabric.FP8Precision(**FP8_KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = TwoInputs()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    signals = []
    for step in range(steps):
        x, z = inputs(step)
        guard.watch(plugin, step)
        fabric.backward(model(x, z).float().square().mean())
        guard.check(plugin, step)
        signals.append(dict(guard.signals))
        optimizer.step()
        optimizer.zero_grad()
    return plugin, net, signals


def test_max_kurtosis_steps_down_a_layer_fed_heavy_tailed_inputs_and_not_one_fed_gaussian_ones():
    g = torch.Generator().manual_seed(2)

    def inputs(step):  # a Gaussian scale mixture: most values small, a few huge (kurtosis in the hundreds)
        heavy = torch.randn(32, 64, generator=g) * torch.exp(1.5 * torch.randn(32, 64, generator=g))
        return heavy, torch.randn(32, 64, generator=g)

    # The rule is loosened for underflow, which such inputs also raise: the signal alone judges here.
    guard = FP8Guard(every_n_steps=2, rule=PlanRule(max_underflow=1.0), max_kurtosis=10)
    with pytest.warns(UserWarning, match=r"FP8Guard: step 1: 1 layer\(s\) moved one rung down: heavy .*input kurtosis"):
        plugin, net, signals = fabric_loop(guard, inputs)
    assert [(e.step, e.fqn, e.to) for e in guard.events] == [(1, "heavy", "bf16")]
    assert guard.events[0].reason.startswith("input kurtosis ") and guard.events[0].reason.endswith(" > 10")
    assert signals[0] == {} and signals[2] == {}  # unmeasured steps: nothing read, nothing logged
    assert signals[1]["precision/fp8_kurtosis/heavy"] > 50 and abs(signals[1]["precision/fp8_kurtosis/gauss"] - 3) < 0.5
    assert list(signals[3]) == ["precision/fp8_kurtosis/gauss", "precision/fp8_amax_growth/gauss"]  # heavy is bf16
    assert type(net.heavy) is nn.Linear and layer_format(net.gauss) == "tensorwise"
    assert plugin.plan.get("heavy").numbers["input_kurtosis"] == signals[1]["precision/fp8_kurtosis/heavy"]


def test_max_amax_growth_steps_down_a_layer_whose_input_grows():
    g = torch.Generator().manual_seed(3)

    def inputs(step):  # the same distribution, 100x larger from step 3 on
        return torch.randn(32, 64, generator=g) * (100.0 if step >= 3 else 1.0), torch.randn(32, 64, generator=g)

    guard = FP8Guard(every_n_steps=2, max_amax_growth=20)
    with pytest.warns(UserWarning, match=r"FP8Guard: step 3: 1 layer\(s\) moved one rung down: heavy .*input amax growth"):
        _, net, signals = fabric_loop(guard, inputs)
    assert [(e.step, e.fqn) for e in guard.events] == [(3, "heavy")]
    assert "input amax growth" in guard.events[0].reason
    assert signals[1]["precision/fp8_amax_growth/heavy"] == 1.0
    assert signals[3]["precision/fp8_amax_growth/heavy"] > 50


def test_a_non_finite_input_is_left_out_of_the_signals():
    def inputs(step):
        x = torch.randn(32, 64)
        if step == 1:
            x[0, 0] = float("nan")  # the measured step: not judged, and no signal of that layer is read from it
        return x, torch.randn(32, 64)

    guard = FP8Guard(every_n_steps=2, max_kurtosis=10, max_amax_growth=2)
    with pytest.warns(UserWarning, match="step 1 is not judged"):
        _, _, signals = fabric_loop(guard, inputs)
    assert "precision/fp8_kurtosis/heavy" not in signals[1] and "precision/fp8_kurtosis/gauss" in signals[1]
    assert guard.events == []


@needs_mxfp8
def test_a_resumed_run_keeps_the_formats_the_run_stepped_down_to(tmp_path):
    """The plugin's plan state holds each layer's format: a run resumed from a checkpoint puts the stepped-down layer
    back in tensorwise (the fresh plugin converts it to MXFP8 first), the others in MXFP8."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class StepDownB(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.precision_plugin.step_down({"net.b": "by hand at step 2"})

    first = FP8Precision(recipe="mxfp8", **FP8_KW)
    trainer(first, 4, [StepDownB(), ModelCheckpoint(dirpath=tmp_path, filename="last")], enable_checkpointing=True,
            default_root_dir=tmp_path).fit(Lit(), loader(4))
    assert first.plan.get("net.b").precision == "tensorwise"
    resumed, module = FP8Precision(recipe="mxfp8", **FP8_KW), Lit()
    trainer(resumed, 6, default_root_dir=tmp_path).fit(
        module, loader(6), ckpt_path=str(tmp_path / "last.ckpt"))
    assert formats(module.net) == {"a": "mxfp8", "b": "tensorwise", "head": "mxfp8"}
    assert resumed.plan == first.plan
    assert len(module.losses) == 2 and all(math.isfinite(v) for v in module.losses)


def test_events_saved_before_the_ladder_load_and_bad_options_fail_clearly():
    guard = FP8Guard()
    guard.load_state_dict({"events": [{"step": 3, "fqn": "net.b", "reason": "old"}]})
    assert guard.events == [GuardEvent(3, "net.b", "old", "high")]
    for bad in ({"ladder": "yes"}, {"max_kurtosis": 0}, {"max_amax_growth": float("inf")}, {"max_kurtosis": True}):
        with pytest.raises(ValueError, match=f"FP8Guard\\({next(iter(bad))}="):
            FP8Guard(**bad)


@needs_mxfp8
def test_stepping_down_a_chosen_layer_keeps_its_alternatives_and_the_saving_of_its_new_format():
    """A plan that chose among formats records what each format saves; a layer stepped down (mxfp8 -> tensorwise ->
    bf16) then saves what its new format saves, not nothing, and keeps the formats weighed, in the plan in force and
    in the file the guard writes."""
    from lightning_precision.fp8 import LayerDecision, LayerSensitivity, PrecisionPlan, TensorNumerics

    n = TensorNumerics(31.0, 1e-5, 0.0)
    measured = {fmt: {fqn: LayerSensitivity(fqn, 4096, 4096, n, n, n, e, e, batches=2, tokens=16384)
                      for fqn in ("a", "b", "head")} for fmt, e in (("tensorwise", 0.04), ("mxfp8", 0.03))}
    chosen = PrecisionPlan.choose([LayerDecision(f, 4096, 4096, True, "fp8") for f in ("a", "b", "head")], measured,
                                  device="B200", high="bf16")
    assert chosen.format_of("b") == "mxfp8"
    saving = {o.format: o.predicted_saving for o in chosen.get("b").alternatives}
    assert saving["tensorwise"] > 0 and saving["mxfp8"] > 0
    plugin = lp_fabric.FP8Precision(layers=chosen, **FP8_KW)
    net = Net()
    L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(net)
    for rung, expected in (("tensorwise", saving["tensorwise"]), ("bf16", 0.0)):
        assert plugin.step_down({"b": "by hand"}) == {"b": rung}
        entry = plugin.plan.get("b")
        assert entry.precision == rung and entry.predicted_saving == expected
        assert [o.format for o in entry.alternatives] == ["tensorwise", "mxfp8"]
        assert [o.verdict == "chosen" for o in entry.alternatives] == [rung == "tensorwise", False]
        assert plugin.plan.predicted_saving == pytest.approx(2 * saving["mxfp8"] + expected)
        assert PrecisionPlan.from_dict(plugin.plan.to_dict()) == plugin.plan


def test_input_kurtosis_is_never_a_wrong_number_for_an_input_far_from_zero_mean():
    """Kurtosis from raw power sums cancels catastrophically when the input's mean dwarfs its spread: a fp32 input of
    mean 0.1 read -2.1e7 (a kurtosis is >= 1), and one of mean 100 a value big enough to trip `max_kurtosis`. What
    fp64 cannot resolve is NaN (not logged, not judged); what it can stays right."""
    from lightning_precision.callbacks.guard import InputSignals

    torch.manual_seed(0)
    layer = nn.Linear(64, 64)
    cases = {"gauss": torch.randn(4096, 64), "shifted": torch.randn(4096, 64) + 5.0,
             "offset": torch.full((4096, 64), 0.1).index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(0.101)),
             "far": 100.0 + 1e-3 * torch.randn(4096, 64)}
    out = {}
    for name, x in cases.items():
        signals = InputSignals({"l": layer})
        layer(x)
        signals.close()
        out[name] = signals.result()["l"][0]
    assert out["gauss"] == pytest.approx(3.0, abs=0.1) and out["shifted"] == pytest.approx(3.0, abs=0.1)
    for name in ("offset", "far"):
        assert math.isnan(out[name]) or out[name] >= 1.0, (name, out[name])
    assert math.isnan(out["far"]) or out["far"] == pytest.approx(3.0, abs=0.5)
