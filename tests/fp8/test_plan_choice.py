"""Plans that choose among formats: ``PrecisionPlan.choose`` (the exact choice under an error budget, the reasons, the
alternatives kept), its files, and ``make_plan(candidates=...)`` on a real model with torchao's casts."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision.fp8 import LayerDecision, LayerSensitivity, PlanRule, PrecisionPlan, TensorNumerics, make_plan
from lightning_precision.fp8._plan_types import error_contribution
from lightning_precision.fp8._speed import predicted_saving, speed_device
from tests.helpers import has_mxfp8, rowwise_emulates_on_cpu

needs_mxfp8 = pytest.mark.skipif(not has_mxfp8(), reason="this torchao has no MXFP8 training layer (torchao 0.11)")
needs_rowwise = pytest.mark.skipif(not rowwise_emulates_on_cpu(),
                                   reason="this torchao cannot emulate rowwise under CPU autocast (torchao 0.11)")

GOOD = TensorNumerics(31.0, 1e-5, 0.0)
BIG = (16384, 4096, 4096)  # tokens, in, out: a GEMM fp8 speeds up on an H100


def _s(fqn, out_err, gin_err, tokens=BIG[0], k=BIG[1], n=BIG[2], numerics=GOOD):
    return LayerSensitivity(fqn, k, n, numerics, numerics, numerics, out_err, gin_err, batches=4, tokens=tokens)


def _decisions(*fqns, k=BIG[1], n=BIG[2]):
    return [LayerDecision(f, k, n, True, "fp8") for f in fqns]


def test_without_a_budget_each_layer_takes_the_format_that_saves_most_within_the_rule():
    measured = {"tensorwise": {"a": _s("a", 0.04, 0.05), "b": _s("b", 0.5, 0.05)},
                "rowwise": {"a": _s("a", 0.03, 0.04), "b": _s("b", 0.03, 0.04)}}
    plan = PrecisionPlan.choose(_decisions("a", "b"), measured, device="H100 SXM", high="bf16")
    gpu = speed_device("H100 SXM")[0]
    # tensorwise saves more than rowwise at this shape; b's tensorwise output error breaks the per-layer bound
    assert predicted_saving("tensorwise", *BIG, gpu) > predicted_saving("rowwise", *BIG, gpu) > 0
    assert plan.format_of("a") == "tensorwise" and plan.format_of("b") == "rowwise"
    b = plan.get("b")
    verdicts = {o.format: o.verdict for o in b.alternatives}
    assert verdicts["rowwise"] == "chosen" and verdicts["tensorwise"].startswith("output error 0.500 > 0.1")
    assert plan.predicted_saving == pytest.approx(predicted_saving("tensorwise", *BIG, gpu)
                                                  + predicted_saving("rowwise", *BIG, gpu))
    assert plan.device == "H100 SXM" and plan.fp8_layers == {"a", "b"}


def test_an_outlier_layer_never_gets_a_format_that_breaks_the_budget():
    # "out" errs 30x more in tensorwise (an outlier channel), less in MXFP8's blocks
    measured = {"tensorwise": {f: _s(f, 0.03, 0.03) for f in "abc"} | {"out": _s("out", 0.09, 0.09)},
                "mxfp8": {f: _s(f, 0.035, 0.035) for f in "abc"} | {"out": _s("out", 0.04, 0.04)}}
    decisions = _decisions("a", "b", "c", "out")
    for budget in (0.0, 0.002, 0.005, 0.008, 0.012, 0.02, 0.05, math.inf):
        plan = PrecisionPlan.choose(decisions, measured, PlanRule(error_budget=budget), device="B200", high="bf16")
        spent = 0.0
        for p in plan.layers:
            if p.low:
                spent += error_contribution(measured[p.precision][p.fqn])
            assert p.precision != "tensorwise" or p.fqn != "out" or budget == math.inf or \
                error_contribution(measured["tensorwise"]["out"]) <= budget
        assert spent <= budget
    tight = PrecisionPlan.choose(decisions, measured, PlanRule(error_budget=0.0), device="B200", high="bf16")
    assert not tight.fp8_layers and all("error budget" in p.reason for p in tight.layers)
    assert tight.predicted_saving == 0.0


def test_the_budget_choice_is_the_brute_force_optimum():
    import itertools

    measured = {"tensorwise": {f: _s(f, e, e) for f, e in zip("abcd", (0.02, 0.05, 0.03, 0.08), strict=True)},
                "rowwise": {f: _s(f, e, e) for f, e in zip("abcd", (0.015, 0.03, 0.02, 0.04), strict=True)}}
    decisions = _decisions(*"abcd")
    gpu = speed_device("H100 SXM")[0]
    saving = {fmt: predicted_saving(fmt, *BIG, gpu) for fmt in measured}
    for budget in (0.001, 0.003, 0.006, 0.01, 0.02):
        plan = PrecisionPlan.choose(decisions, measured, PlanRule(error_budget=budget), device="H100 SXM")
        best = 0.0
        for picks in itertools.product((None, "tensorwise", "rowwise"), repeat=4):
            error = sum(error_contribution(measured[f][x]) for f, x in zip(picks, "abcd", strict=True) if f)
            if error <= budget:
                best = max(best, sum(saving[f] for f in picks if f))
        assert plan.predicted_saving == pytest.approx(best)


def test_one_candidate_without_budget_is_todays_rule():
    rule = PlanRule()
    sens = {"a": _s("a", 0.04, 0.05), "b": _s("b", 0.5, 0.05), "c": _s("c", 0.02, 0.2)}
    decisions = _decisions("a", "b", "c")
    binary = PrecisionPlan.decide(decisions, sens, rule, high="bf16")
    chosen = PrecisionPlan.choose(decisions, {"tensorwise": sens}, rule, device="H100 SXM", high="bf16")
    assert binary.fp8_layers == chosen.fp8_layers == {"a"}


def test_small_layers_are_judged_by_the_speed_model():
    sens = {"tiny": _s("tiny", 0.03, 0.03, tokens=256, k=64, n=64)}
    decisions = _decisions("tiny", k=64, n=64)
    plan = PrecisionPlan.choose(decisions, {"tensorwise": sens}, device="H100 SXM", high="bf16")
    assert not plan.fp8_layers and "predicted slower than bf16 on H100 SXM" in plan.get("tiny").reason
    # skip_small_layers=False: as many layers in low precision as allowed, even if slower
    forced = PrecisionPlan.choose(decisions, {"tensorwise": sens}, device="H100 SXM", high="bf16",
                                  skip_small_layers=False)
    assert forced.fp8_layers == {"tiny"} and forced.predicted_saving < 0


def test_dims_a_block_format_cannot_divide_are_out():
    sens = _s("a", 0.03, 0.03, k=4096, n=4112)  # 4112 = 16 * 257: not a multiple of 32
    plan = PrecisionPlan.choose([LayerDecision("a", 4096, 4112, True, "fp8")],
                                {"mxfp8": {"a": sens}, "tensorwise": {"a": sens}}, device="B200")
    verdicts = {o.format: o.verdict for o in plan.get("a").alternatives}
    assert verdicts["mxfp8"] == "dims 4096x4112 not divisible by 32" and plan.format_of("a") == "tensorwise"


def test_a_chosen_plan_round_trips_through_files_and_prints_its_saving(tmp_path):
    measured = {"tensorwise": {"a": _s("a", 0.04, 0.05)}, "rowwise": {"a": _s("a", 0.03, 0.04)}}
    decisions = [*_decisions("a"), LayerDecision("head", 4096, 10, False, "dims 4096x10 not divisible by 16")]
    plan = PrecisionPlan.choose(decisions, measured, PlanRule(error_budget=0.01), high="bf16")
    for suffix in (".yaml", ".json"):
        path = plan.save(tmp_path / f"plan{suffix}")
        assert PrecisionPlan.load(path) == plan
    table = plan.table()
    assert "error budget 0.01" in table and "ms per step" in table
    if not torch.cuda.is_available():
        assert "(a prediction: this process does not run on one)" in table and plan.device == "H100 SXM"
    assert "rowwise (" in table  # the other format weighed, with its saving and error


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d["layers"][0]["alternatives"][0].update(format="fp4"), "format='fp4'"),
    (lambda d: d["layers"][0]["alternatives"][0].pop("verdict"), "has no `verdict`"),
    (lambda d: d["layers"][0].update(predicted_saving="fast"), "predicted_saving"),
    (lambda d: d.update(device=3), "device"),
    (lambda d: d.update(baseline=-1), "baseline"),
    # a NaN saving would reach the plan in force when FP8Guard steps the layer to that format (a crash mid-fit)
    (lambda d: d["layers"][0]["alternatives"][0].update(predicted_saving="nan"),
     r"alternatives`\[0\]: FormatOption\(predicted_saving=nan\)"),
    (lambda d: d["layers"][0]["alternatives"][0].update(error="nan"), r"FormatOption\(error=nan\)"),
])
def test_bad_choice_fields_in_a_file_fail_clearly(edit, match):
    plan = PrecisionPlan.choose(_decisions("a"), {"tensorwise": {"a": _s("a", 0.04, 0.05)}}, high="bf16")
    data = plan.to_dict()
    edit(data)
    with pytest.raises(ValueError, match=match):
        PrecisionPlan.from_dict(data)


@pytest.mark.parametrize(("candidates", "match"), [
    ("tensorwise", "a tuple of format names"),
    ((), "name at least one format"),
    (("fp4",), "'fp4' is not a format"),
    (("rowwise", "rowwise"), "'rowwise' named more than once"),
])
def test_make_plan_refuses_bad_candidates(candidates, match):
    model = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(ValueError, match=match):
        make_plan(model, [torch.randn(4, 32)], loss_fn=lambda m, b: m(b).sum(), candidates=candidates)


@needs_rowwise
def test_make_plan_measures_every_candidate_in_one_pass_and_chooses():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with torch.no_grad():
        model[2].weight[:, 3] *= 200.0  # an outlier input channel of the middle layer's weight
    batches = [torch.randn(64, 64) for _ in range(3)]
    loss = lambda m, b: m(b).float().pow(2).mean()  # noqa: E731
    plan = make_plan(model, batches, loss_fn=loss, candidates=("tensorwise", "rowwise", "mxfp8"),
                     skip_small_layers=False, skip_first_last=False, device="B200")
    assert plan.batches == 3 and plan.device == "B200"
    for p in plan.layers:
        assert {o.format for o in p.alternatives} == {"tensorwise", "rowwise", "mxfp8"}
        assert all(o.error < math.inf for o in p.alternatives)
    assert len(plan.fp8_layers) == 3  # skip_small_layers=False: low precision wherever the rule allows
    tight = make_plan(model, batches, loss_fn=loss, candidates=("tensorwise", "rowwise", "mxfp8"),
                      skip_small_layers=False, skip_first_last=False, device="B200",
                      plan_rule=PlanRule(error_budget=0.0))
    assert not tight.fp8_layers


class _Outliers(nn.Module):
    """Four layers of 64; the input of ``c`` has two outlier channels (x 1e4, the weight scaling them back): one
    tensorwise scale flushes the rest of its input, MXFP8's blocks of 32 isolate them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(64, 64) for _ in range(4))
        with torch.no_grad():
            self.c.weight[:, :2] /= 1e4

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        h = torch.cat([h[:, :2] * 1e4, h[:, 2:]], dim=1)
        return self.d(torch.relu(self.c(h)))


def _loss(model, batch):
    return model(batch).float().pow(2).mean()


@needs_mxfp8
@needs_rowwise
def test_layers_auto_chooses_among_formats_under_the_trainer_and_trains_the_mix():
    import lightning as L

    from lightning_precision import FP8Precision

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _Outliers()

        def training_step(self, batch, batch_idx):
            return _loss(self.net, batch[0])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    plugin = FP8Precision(layers="auto", candidates=("tensorwise", "rowwise", "mxfp8"), emulate=True,
                          calibration_batches=2, skip_small_layers=False, skip_first_last=False)
    data = torch.utils.data.TensorDataset(torch.randn(32 * 6, 64))
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    lit = Lit()
    trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=32))
    plan = plugin.plan
    assert plan.device and all(p.alternatives for p in plan.layers)
    # the outlier layer: tensorwise flushes its input, so it never runs tensorwise
    assert plan.format_of("net.c") != "tensorwise"
    out = {o.format: o for o in plan.get("net.c").alternatives}
    assert out["mxfp8"].error < out["tensorwise"].error
    for p in plan.layers:
        layer = lit.net.get_submodule(p.fqn.removeprefix("net."))
        from lightning_precision.fp8._torchao import layer_format

        assert layer_format(layer) == (p.precision if p.low else None)
    assert torch.isfinite(torch.stack([q.detach().float().sum() for q in lit.parameters()])).all()


@needs_mxfp8
def test_layers_auto_chooses_among_formats_in_a_fabric_loop():
    import lightning as L

    from lightning_precision.fabric import FP8Precision

    torch.manual_seed(0)
    plugin = FP8Precision(layers="auto", candidates=("tensorwise", "mxfp8"), emulate=True, calibration_batches=2,
                          skip_small_layers=False, skip_first_last=False,
                          plan_rule=PlanRule(error_budget=0.01))
    fabric = L.Fabric(accelerator="cpu", plugins=[plugin])
    model = _Outliers()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for _ in range(5):
        loss = _loss(model, torch.randn(32, 64))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    plan = plugin.plan
    assert plan is not None and plan.rule.error_budget == 0.01
    spent = sum(next(o.error for o in p.alternatives if o.verdict == "chosen") for p in plan.layers if p.low)
    # the budget admits some layers (each errs ~0.004 here), not all: the choice is what trains
    assert plan.fp8_layers and len(plan.fp8_layers) < len(plan.layers)
    assert spent <= 0.01 and all(math.isfinite(v) for v in losses)
    from lightning_precision.fp8._torchao import layer_format

    for p in plan.layers:
        assert layer_format(model.module.get_submodule(p.fqn)) == (p.precision if p.low else None)


def test_a_calibration_whose_every_batch_was_non_finite_says_so_for_every_candidate():
    # Choosing among formats, a layer with nothing measured must say why (every batch non-finite), not that it did not
    # run: it ran, on data that could not be measured.
    import lightning as L

    from lightning_precision.fabric import FP8Precision

    torch.manual_seed(0)
    plugin = FP8Precision(layers="auto", candidates=("tensorwise", "mxfp8"), emulate=True, calibration_batches=2,
                          skip_small_layers=False, skip_first_last=False, skip_nonfinite=True)
    fabric = L.Fabric(accelerator="cpu", plugins=[plugin])
    model = _Outliers()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.warns(UserWarning, match="2 of the 2 batches measured"):
        for _ in range(2):
            batch = torch.randn(32, 64)
            batch[0, 0] = float("inf")
            fabric.backward(_loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()
    plan = plugin.plan
    assert plan is not None and not plan.fp8_layers and plan.batches == 0
    for p in plan.layers:
        assert "all 2 batches measured had non-finite values" in p.reason, p.reason
        assert "did not run" not in p.reason
        assert all("non-finite" in o.verdict for o in p.alternatives)


class _RankExpert(torch.nn.Module):
    """``e`` is an expert routed tokens on rank 0 only; rank 1 feeds ``a`` outlier channels."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.e, self.head = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x, rank):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.head(h + self.e(h) if rank == 0 else h)


class _RankLit(L.LightningModule):
    def __init__(self, out_dir):
        super().__init__()
        self.net, self.out_dir = _RankExpert(), out_dir

    def training_step(self, batch, batch_idx):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * batch_idx + self.global_rank))
        if self.global_rank == 1:
            x = torch.cat([x[:, :2] * 1e4, x[:, 2:]], dim=1)
        return _loss_of(self.net(x, self.global_rank))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def on_train_end(self):
        import json

        from lightning_precision.fp8._torchao import layer_format

        plugin = self.trainer.precision_plugin
        report = {"plan": plugin.plan.to_dict(), "formats": {n: layer_format(m) for n, m in self.net.named_children()}}
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump(report, f)


def _loss_of(out):
    return out.float().pow(2).mean()


@needs_mxfp8
@needs_rowwise
def test_under_ddp_every_rank_chooses_the_same_formats(tmp_path):
    """Each candidate's sums are all-reduced before the choice: the rank that saw outliers and the rank whose expert
    got no token reach one plan (formats, errors, alternatives), and convert alike."""
    from lightning_precision import FP8Precision
    from tests.distributed import fit_spawned

    plugin = FP8Precision(layers="auto", candidates=("tensorwise", "rowwise", "mxfp8"), emulate=True,
                          calibration_batches=2, skip_small_layers=False, skip_first_last=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn_find_unused_parameters_true",
                        plugins=[plugin], max_steps=3, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(32 * 4, 1)), batch_size=32)
    reports = fit_spawned(trainer, _RankLit(str(tmp_path)), data, tmp_path)
    assert reports[0] == reports[1]
    layers = {p["fqn"]: p for p in reports[0]["plan"]["layers"]}
    assert layers["net.a"]["precision"] == "bf16" and "input underflow" in layers["net.a"]["reason"]
    assert layers["net.e"]["precision"] in ("tensorwise", "rowwise", "mxfp8")  # measured on rank 0's tokens alone
    assert reports[0]["formats"] == {n: layers[f"net.{n}"]["precision"] if layers[f"net.{n}"]["precision"] != "bf16"
                                     else None for n in ("a", "b", "e", "head")}


def test_a_chosen_plan_of_no_low_layer_is_no_other_recipes_plan():
    """Every layer out (a budget of 0): the plan still chose among formats, so no plugin recipe mismatches it."""
    plan = PrecisionPlan.choose(_decisions("a"), {"mxfp8": {"a": _s("a", 0.04, 0.05)}}, PlanRule(error_budget=0.0),
                                device="B200")
    assert not plan.fp8_layers and plan.measured
    assert plan.recipe_mismatch("rowwise") is None and plan.recipe_mismatch("tensorwise") is None


def test_one_candidate_other_than_the_recipe_is_refused_not_ignored():
    """One candidate and no error budget decide between the plugin's recipe and high precision (the one rule,
    ``fp8._decision.chooses_formats``): a candidate other than the recipe was measured as the recipe and then ignored;
    now it is refused, saying the fix. The recipe itself, or a budget (a choice), is taken."""
    from lightning_precision.fabric import FP8Precision

    pytest.importorskip("torchao")
    with pytest.raises(ValueError, match=r"one candidate and no error budget .*'tensorwise'.* `recipe='rowwise'`"):
        FP8Precision(layers="auto", candidates=("rowwise",), emulate=True)
    assert FP8Precision(layers="auto", recipe="rowwise", candidates=("rowwise",), emulate=True).candidates == \
        ("rowwise",)
    chooses = FP8Precision(layers="auto", candidates=("rowwise",), plan_rule=PlanRule(error_budget=0.1), emulate=True)
    assert chooses._choosing and chooses.candidates == ("rowwise",)
