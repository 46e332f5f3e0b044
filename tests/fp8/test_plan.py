"""fp8 layers chosen from measured numerics: ``fp8_sensitivity``, ``PrecisionPlan``, ``FP8Precision(layers=...)``.

Real torchao (``emulate=True``), real Trainer and Fabric fits. The test model has one layer fed by outlier channels
(3 of 64 input channels 1000x the rest, as the outlier features of large transformers) and one whose output gradients
are about 1e-23 (its output reaches the logits through a 1e-21 gate): below what torchao's dynamic e5m2 scale can
lift (it clamps amax at 1e-12), so every one of them flushes to zero.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

import lightning_precision
from lightning_precision import FP8Precision, PlanRule, PrecisionPlan
from lightning_precision import fabric as lp_fabric
from lightning_precision.fp8._make_plan import make_plan
from lightning_precision.fp8._plan_types import LayerPlan
from lightning_precision.fp8._sensitivity import TORCHAO_EPS, CastSpec, cast_numerics, fp8_sensitivity
from tests.helpers import LossRecorder

pytest.importorskip("torchao")

FP8_KW = {"emulate": True, "skip_small_layers": False, "skip_first_last": False}


class Outliers(nn.Module):
    """``b`` sees outlier channels; ``c``'s output gradients are ~1e-23; ``a``, ``d`` and ``head`` are ordinary."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = torch.cat([h[:, :3] * 1000, h[:, 3:]], dim=1)  # outlier channels into b
        h = torch.relu(self.b(h) / 100)
        # c: a branch gated by 1e-21 (a no-op in the forward), so its output gradients are ~1e-23
        return self.head(torch.relu(self.d(h))) + self.c(x)[:, :16] * 1e-21


class Lit(LossRecorder):
    def __init__(self) -> None:
        super().__init__(Outliers())


def batches(n: int, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 64, generator=g), torch.randint(0, 16, (size,), generator=g)) for _ in range(n)]


def loader(n: int) -> torch.utils.data.DataLoader:
    x, y = (torch.cat(t) for t in zip(*batches(n), strict=True))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def fit(plugin, steps: int, module=None, **kwargs) -> tuple[L.Trainer, Lit]:
    module = module or Lit()
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, **{"enable_checkpointing": False, **kwargs})
    trainer.fit(module, loader(steps))
    return trainer, module


# ---- measuring -------------------------------------------------------------------------------------------------------


def test_torchaos_amax_floor_is_the_one_we_mirror():
    from torchao.float8 import float8_utils

    assert float8_utils.EPS == TORCHAO_EPS  # a new floor changes which tiny tensors flush: update _upstream/torchao.py


@pytest.mark.parametrize("axiswise", [False, True])
def test_cast_numerics_is_torchaos_cast(axiswise):
    """Our noise power and underflow count are those of torchao's own dynamic cast (dequantized), tiny rows included."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    try:
        from torchao.float8.float8_training_tensor import LinearMMConfig
    except ImportError:  # torchao < 0.12 names the module float8_tensor
        from torchao.float8.float8_tensor import LinearMMConfig

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-30, 2, 8).unsqueeze(1)  # rows from 1e-30 to 1e2
    kwargs = {"scaling_granularity": ScalingGranularity.AXISWISE, "axiswise_dim": -1} if axiswise else {}
    theirs = hp_tensor_to_float8_dynamic(x, torch.float8_e5m2, LinearMMConfig(), **kwargs).to_original_precision()
    signal, noise, nonzero, under, nonfinite, numel = cast_numerics(x, CastSpec(torch.float8_e5m2, axiswise, False))
    assert noise.item() == pytest.approx((theirs - x).double().pow(2).sum().item(), rel=1e-6)
    assert under.item() == ((x != 0) & (theirs == 0)).sum().item() > 0  # the 1e-30 row flushes, scaled or not
    assert (nonzero.item(), nonfinite.item(), numel.item()) == (512, 0, 512)


def test_fp8_sensitivity_measures_without_touching_the_model():
    model = Outliers()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = batches(3)
    result = fp8_sensitivity(model, data, loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert list(result) == ["a", "b", "c", "d", "head"] and {s.batches for s in result.values()} == {3}
    ordinary = [result[f] for f in ("a", "d", "head")]
    # e4m3 keeps 3 mantissa bits (about 30 dB), e5m2 2 (about 25 dB); output errors of a few percent
    assert all(s.input.sqnr_db > 25 and s.weight.sqnr_db > 25 and s.grad_output.sqnr_db > 20 for s in ordinary)
    assert all(s.output_error < 0.06 and s.grad_input_error < 0.1 for s in ordinary)
    assert all(s.input.underflow < 1e-4 for s in ordinary)
    assert result["b"].input.underflow > 1e-3  # outliers squeeze the other channels to the bottom of e4m3's range
    assert result["c"].grad_output.underflow == 1.0 and result["c"].grad_input_error == 1.0


def test_fp8_sensitivity_asks_for_a_loss_when_the_model_gives_none():
    with pytest.raises(ValueError, match="Pass `loss_fn=lambda model, batch"):
        fp8_sensitivity(Outliers(), [torch.randn(4, 64)])
    with pytest.raises(ValueError, match="not nn.Linear layers of the model: nope"):
        fp8_sensitivity(Outliers(), [torch.randn(4, 64)], layers=["nope"])


# ---- the plan --------------------------------------------------------------------------------------------------------


def _plan() -> PrecisionPlan:
    return make_plan(Outliers(), batches(3), loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]),
                     skip_small_layers=False, skip_first_last=False)


def test_make_plan_keeps_exactly_the_outlier_and_tiny_gradient_layers_high():
    plan = _plan()
    assert plan.fp8_layers == {"a", "d", "head"}
    assert "input underflow" in plan.get("b").reason
    assert "grad_output underflow" in plan.get("c").reason and "input-gradient error" in plan.get("c").reason
    table = plan.table()
    assert "3 of 5 linear layers in fp8" in table and "measured within the rule" in table


def test_shape_rules_come_first():
    plan = make_plan(Outliers(), batches(1), loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]))
    assert plan.fp8_layers == set()  # 64x64 is too small to gain, and a/head are the first/last layers
    assert plan.get("b").numbers == {} and "too small to gain" in plan.get("b").reason


def _loss(m, b):
    return nn.functional.cross_entropy(m(b[0]).float(), b[1])


def test_make_plan_takes_the_layer_policy_and_plan_rule_configs_or_the_flat_shorthands_never_both():
    from lightning_precision.fp8 import FP8LayerPolicy

    flat = make_plan(Outliers(), batches(1), loss_fn=_loss, skip_small_layers=False, skip_first_last=False)
    policy = FP8LayerPolicy(skip_small_layers=False, skip_first_last=False)
    assert make_plan(Outliers(), batches(1), loss_fn=_loss, layer_policy=policy) == flat
    with pytest.raises(ValueError, match=r"make_plan\(layer_policy=FP8LayerPolicy\(...\), skip_first_last=False\)"):
        make_plan(Outliers(), batches(1), loss_fn=_loss, layer_policy=FP8LayerPolicy(), skip_first_last=False)
    strict = PlanRule(max_output_error=0.0)
    ruled = make_plan(Outliers(), batches(1), loss_fn=_loss, plan_rule=strict, layer_policy=policy)
    assert ruled.rule == strict and not ruled.fp8_layers
    with pytest.raises(TypeError, match="rule"):
        make_plan(Outliers(), batches(1), loss_fn=_loss, rule=strict)  # the old name is gone
    with pytest.raises(ValueError, match=r"make_plan\(plan_rule=0.1\)"):
        make_plan(Outliers(), batches(1), loss_fn=_loss, plan_rule=0.1)


def test_a_plan_labels_its_high_precision_layers_with_the_dtype_they_run_in():
    """A layer an fp16 plugin keeps in high precision runs in fp16: its plan says so, not "bf16"."""
    policy = dict(skip_small_layers=False, skip_first_last=False)
    for dtype, label in [(torch.float16, "fp16"), (torch.bfloat16, "bf16")]:
        plugin = lp_fabric.FP8Precision(emulate=True, compute_dtype=dtype, module_filter=lambda m, fqn: fqn != "b")
        model = plugin.convert_module(Outliers())
        assert plugin.plan_in_force().get("b").precision == label
        assert plugin.demote({"c": "by hand"}) == ["c"] and model.c.__class__ is nn.Linear
        assert plugin.plan.get("c").precision == label
    assert {p.precision for p in make_plan(Outliers(), batches(1), loss_fn=_loss, autocast_dtype=torch.float16,
                                           plan_rule=PlanRule(max_output_error=0.0), **policy).layers} == {"fp16"}
    assert {p.precision for p in make_plan(Outliers(), batches(1), loss_fn=_loss, **policy).layers} <= {"bf16", "fp8"}


def test_plan_files_written_before_the_rename_still_load(tmp_path):
    """A file saying ``recipe:`` (the field's old name) and ``bf16`` layers reads as it did; a new file says
    ``scaling_family:``."""
    old = tmp_path / "old.yaml"
    old.write_text("version: 1\nrecipe: rowwise\nbatches: 2\nlayers:\n- {fqn: a, precision: bf16}\n"
                   "- {fqn: b, precision: fp8}\n")
    plan = PrecisionPlan.load(old)
    assert plan.scaling_family == "rowwise" and plan.get("a").precision == "bf16" and plan.fp8_layers == {"b"}
    assert not hasattr(plan, "recipe")
    assert plan.to_dict()["scaling_family"] == "rowwise" and "recipe" not in plan.to_dict()
    both = tmp_path / "both.yaml"
    both.write_text("version: 1\nrecipe: rowwise\nscaling_family: rowwise\nlayers: []\n")
    with pytest.raises(ValueError, match="both `scaling_family` and `recipe`"):
        PrecisionPlan.load(both)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_plan_round_trips_through_a_file(tmp_path, suffix):
    plan = _plan().with_layer("a", "bf16", "by hand", {"output_error": math.inf})
    path = plan.save(tmp_path / f"plan{suffix}")
    loaded = PrecisionPlan.load(path)
    assert loaded == plan and loaded.get("a").numbers["output_error"] == math.inf
    assert loaded.diff(_plan()) == ["a: bf16 -> fp8"]
    assert not (tmp_path / f"plan{suffix}.tmp").exists()


def test_bad_plans_and_rules_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match=r"PlanRule\(max_underflow=-1\)"):
        PlanRule(max_underflow=-1)
    with pytest.raises(ValueError, match="'fp4' is not 'fp8' \\(the plugin's recipe\\), a format .* or a high precision \\('high', 'bf16', 'fp16', 'fp32'"):
        LayerPlan("a", "fp4", "")
    with pytest.raises(ValueError, match="name a .yaml, .yml or .json file"):
        _plan().save(tmp_path / "plan.txt")
    (tmp_path / "old.json").write_text('{"version": 99, "layers": []}')
    with pytest.raises(ValueError, match="version 99"):
        PrecisionPlan.load(tmp_path / "old.json")
    (tmp_path / "cut.yaml").write_text("version: 1\nlayers:\n- fqn: a\n")
    with pytest.raises(ValueError, match="each layer needs `fqn` and `precision`"):
        PrecisionPlan.load(tmp_path / "cut.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="not a list"):
        PrecisionPlan.load(tmp_path / "list.yaml")


# ---- FP8Precision(layers=...) -----------------------------------------------------------------------------------------


def test_trainer_auto_measures_the_first_steps_then_converts_the_layers_the_rule_accepts():
    plugin = FP8Precision(layers="auto", calibration_batches=4, **FP8_KW)
    trainer, module = fit(plugin, 8)
    net = module.net
    assert plugin.plan.fp8_layers == {"net.a", "net.d", "net.head"} and plugin.plan.batches == 4
    assert {n: type(getattr(net, n)).__name__ for n in ("a", "b", "c", "d", "head")} == {
        "a": "Float8Linear", "b": "Linear", "c": "Linear", "d": "Float8Linear", "head": "Float8Linear"}
    # Converted in place, with the same Parameter objects: the optimizer trains the fp8 layers' weights.
    optimizer_params = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert {id(p) for p in net.parameters()} == optimizer_params
    assert len(module.losses) == 8 and all(math.isfinite(v) for v in module.losses)
    assert [d.fqn for d in plugin.layer_decisions if d.fp8] == ["net.a", "net.d", "net.head"]
    assert float(plugin.metrics()["precision/fp8_layers"]) == 3


def test_a_resumed_auto_run_applies_its_plan_instead_of_measuring_again(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    first = FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
    fit(first, 4, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="last")])
    resumed = FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
    module = Lit()
    trainer = L.Trainer(accelerator="cpu", plugins=[resumed], max_steps=5, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, loader(5), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.plan == first.plan
    assert type(module.net.a).__name__ == "Float8Linear" and resumed._calibration is None


def test_a_saved_plan_converts_its_layers_at_setup_with_fabric(tmp_path):
    path = _plan().save(tmp_path / "plan.yaml")
    plugin = lp_fabric.FP8Precision(layers=str(path), emulate=True)  # the plan overrides skip_small/skip_first_last
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(Outliers())
    assert {n for n in ("a", "b", "c", "d", "head") if type(getattr(model.module, n)).__name__ == "Float8Linear"} \
        == {"a", "d", "head"}
    assert plugin.layer_decisions[1].reason.startswith("plan: input underflow")


def test_fabric_auto_measures_in_the_loop_too():
    plugin = lp_fabric.FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Outliers()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    for x, y in batches(3):
        loss = nn.functional.cross_entropy(model(x).float(), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert plugin.plan.fp8_layers == {"a", "d", "head"}
    assert type(model.module.head).__name__ == "Float8Linear"


def test_layers_arguments_are_checked_at_construction(tmp_path):
    with pytest.raises(ValueError, match="calibration_batches=...\\)` applies to `layers='auto'` only"):
        FP8Precision(calibration_batches=4, emulate=True)
    with pytest.raises(ValueError, match="calibration_batches=0"):
        FP8Precision(layers="auto", calibration_batches=0, emulate=True)
    with pytest.raises(ValueError, match="a PrecisionPlan or the path of a saved plan"):
        FP8Precision(layers=3, emulate=True)
    with pytest.raises(FileNotFoundError, match="no plan file"):
        FP8Precision(layers=str(tmp_path / "missing.yaml"), emulate=True)
    path = _plan().save(tmp_path / "plan.json")
    with pytest.raises(ValueError, match="pass one or the other"):
        FP8Precision(layers=path, module_filter=lambda m, fqn: True, emulate=True)
    with pytest.raises(ValueError, match="cannot be chosen during sharded training"):
        FP8Precision(layers="auto", fsdp_float8_all_gather=True, emulate=True)
    plugin = FP8Precision(layers=path, emulate=True)
    with pytest.raises(ValueError, match="does not have as nn.Linear: d, head"):
        plugin.convert_module(_renamed())


def _renamed() -> nn.Module:
    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.z = nn.Linear(64, 64), nn.Linear(64, 64)

    return Other()


class RankOutliers(Lit):
    """Rank 1 alone feeds layer ``a`` inputs with outlier channels; every rank writes the plan it applied."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 1:
            x = torch.cat([x[:, :3] * 1e3, x[:, 3:]], dim=1)
        return super().training_step((x, y), batch_idx)

    def on_train_end(self):
        import json

        plugin = self.trainer.precision_plugin
        report = {"fp8": sorted(plugin.plan.fp8_layers), "a": plugin.plan.get("net.a").reason,
                  "converted": sorted(f"net.{n}" for n, m in self.net.named_children()
                                      if type(m).__name__ == "Float8Linear")}
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump(report, f)


def test_under_ddp_every_rank_applies_the_same_plan(tmp_path):
    """The measurements are summed across ranks before the rule decides. Without it, the rank that saw outliers would
    keep ``a`` in bf16 and the other convert it: the same Parameters, so DDP would not notice, and the ranks would
    train different numerics in silence."""
    from tests.distributed import fit_spawned

    plugin = FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", plugins=[plugin], max_steps=3,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    reports = fit_spawned(trainer, RankOutliers(str(tmp_path)), loader(6), tmp_path)
    assert reports[0] == reports[1]
    assert "net.a" not in reports[0]["fp8"] and "input underflow" in reports[0]["a"]
    assert reports[0]["converted"] == reports[0]["fp8"] != []


def test_the_sums_every_rank_reduces_have_one_row_per_layer_whichever_ran():
    """Under DDP a layer may run on some ranks only (data-dependent routing): the tensor handed to the all-reduce must
    have the same shape on every rank (a rank's own set of rows would hang or mix layers), and a layer that ran on no
    rank is left out of the result. The reduce here records what it is given, as ``dist.all_reduce`` would see it."""
    from lightning_precision.fp8._sensitivity import SensitivityProbe
    from lightning_precision.fp8._torchao import torchao_config

    model = Outliers()
    probe = SensitivityProbe({"a": model.a, "c": model.c}, torchao_config("tensorwise", emulate=True))
    model.a(torch.randn(8, 64)).sum().backward()  # only `a` runs
    probe.close()
    seen = []
    result = probe.result(lambda t: seen.append(tuple(t.shape)) or t)
    assert seen == [(1, 3, 22)] and list(result) == ["a"]  # per format measured: a row per layer, one of batch counts
    assert probe.result() == result


def test_a_fit_that_ends_before_the_plan_is_made_says_nothing_was_converted():
    from lightning_precision import NoEffectWarning

    plugin = FP8Precision(layers="auto", calibration_batches=4, **FP8_KW)
    with pytest.warns(NoEffectWarning, match=r"ended after 2 of the 4 batches to measure, so no layer was converted"):
        _, module = fit(plugin, 2)
    assert plugin.plan is None and type(module.net.a).__name__ == "Linear"
    # The measured steps' layer outputs are not kept: each would hold its step's whole graph until the plan is made.
    assert plugin._calibration.probe.outputs == []


def test_auto_trains_closer_to_bf16_than_every_eligible_layer_in_fp8():
    """300 steps from the same seed on tests/callbacks/test_guard.py's model with its degradation present from the start (layer
    ``b`` sits where gradients are about 1e-21 of the loss's: bf16 holds them, fp8's e5m2 flushes them all). Measured
    (torch 2.13, torchao 0.18, CPU), mean loss over steps 280-299: bf16 1.488; layers="auto" 1.486 (it measured 8
    steps and kept ``b`` in bf16, ``a`` and ``head`` in fp8); every eligible layer in fp8 2.528 (nothing reaches ``a``;
    chance is ln 16 = 2.77)."""
    from tests.callbacks.test_guard import Lit as Injected
    from tests.callbacks.test_guard import loader as teacher

    steps, late = 300, slice(280, 300)
    runs = {}
    for name, plugin in [("bf16", lightning_precision.BF16MixedPrecision()), ("fp8", FP8Precision(**FP8_KW)),
                         ("auto", FP8Precision(layers="auto", **FP8_KW))]:
        module = Injected(inject_at=0)
        L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=steps, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False).fit(module, teacher(steps))
        runs[name] = sum(module.losses[late]) / 20
        if name == "auto":
            assert plugin.plan.fp8_layers == {"net.a", "net.head"} and plugin.plan.batches == 8
    assert abs(runs["auto"] - runs["bf16"]) < 0.1
    assert runs["fp8"] > runs["bf16"] + 0.5


def test_the_errors_are_against_an_fp32_reference_inside_autocast():
    """The probe's hooks run inside the training forward's bf16 autocast, which would turn the reference matmul into
    bf16 too (an error against bf16, not fp32, silently). One layer, one batch: the error equals the hand-computed
    ||fp8 output - fp32 output|| / ||fp32 output||."""
    import copy

    from torchao.float8 import convert_to_float8_training

    from lightning_precision.fp8._torchao import torchao_config

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 32)), torch.randn(16, 64)
    result = fp8_sensitivity(model, [x], loss_fn=lambda m, b: m(b).float().pow(2).sum())["0"]
    shadow = convert_to_float8_training(copy.deepcopy(model), config=torchao_config("tensorwise", emulate=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y8 = shadow(x).float()
        bf16_ref = model(x).float()
    ref = model(x)
    expected = ((y8 - ref).norm() / ref.norm()).item()
    assert result.output_error == pytest.approx(expected, rel=1e-4)
    # Against the bf16 output it would read 0.03274 here, not 0.03268: small, but not the number the docs define.
    assert result.output_error != pytest.approx(((y8 - bf16_ref).norm() / bf16_ref.norm()).item(), rel=1e-3)


# ---- clear answers to odd calls ---------------------------------------------------------------


def _loss(m, b):
    return nn.functional.cross_entropy(m(b[0]).float(), b[1])


def test_measuring_under_no_grad_measures_all_the_same():
    """The measurement needs a backward; under a caller's ``torch.no_grad()`` it used to see nothing and call every
    layer "did not run"."""
    data = batches(2)
    expected = fp8_sensitivity(Outliers(), data, loss_fn=_loss)
    with torch.no_grad():
        assert fp8_sensitivity(Outliers(), data, loss_fn=_loss) == expected
        plan = make_plan(Outliers(), data, loss_fn=_loss, skip_small_layers=False, skip_first_last=False)
        assert not torch.is_grad_enabled()  # the caller's mode, restored
    assert plan.fp8_layers == {"a", "d", "head"} and plan.batches == 2


def test_non_torchao_recipes_and_models_without_linear_layers_are_refused_clearly():
    """MXFP8 is measured with its block casts now (tests/fp8/test_sensitivity_candidates.py); Transformer Engine's formats
    and NVFP4 are not torchao recipes: ``measure_candidates`` measures them, and the error says so."""
    for recipe in ("nvfp4", "delayed", "block"):
        with pytest.raises(ValueError, match=rf"`fp8_sensitivity\(recipe='{recipe}'\)`: not a torchao recipe.*"
                                             rf"measure_candidates\(model, batches, candidates=\('{recipe}',\)\)"):
            fp8_sensitivity(Outliers(), batches(1), recipe=recipe, loss_fn=_loss)
    with pytest.raises(ValueError, match=r"`make_plan\(recipe='nvfp4'\)`"):
        make_plan(Outliers(), batches(1), recipe="nvfp4", loss_fn=_loss)
    plan = make_plan(Outliers(), batches(1), recipe="mxfp8", loss_fn=_loss, skip_small_layers=False,
                     skip_first_last=False)
    assert plan.scaling_family == "mxfp8" and plan.batches == 1 and plan.get("a").numbers
    for measure in (fp8_sensitivity, make_plan):
        with pytest.raises(ValueError, match="ReLU has no nn.Linear layer, so there is nothing to measure"):
            measure(nn.ReLU(), [torch.randn(4, 64)], loss_fn=lambda m, b: m(b).sum())


def test_demote_takes_any_name_of_a_tied_layer():
    """One module under two names is one layer, decided under its first name; the second name moved nothing."""
    plugin = lp_fabric.FP8Precision(**FP8_KW)
    model = Outliers()
    model.tied = model.d  # `d` also registered as `tied`
    L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(model)
    assert next(d for d in plugin.layer_decisions if d.fqn == "d").aliases == ("tied",)
    assert plugin.demote({"tied": "by its second name"}, {"tied": {"output_error": 1.0}}) == ["d"]
    assert type(model.d) is nn.Linear and model.tied is model.d
    assert plugin.plan.get("d").reason == "by its second name" and plugin.plan.get("d").numbers == {"output_error": 1.0}
