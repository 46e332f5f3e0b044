"""A linear layer that receives no tokens in a step, as a mixture-of-experts expert no token was routed to.
torchao's dynamic scale reduces the input's amax, which has no value over zero elements: plain fp8 crashed,
and so did ``layers="auto"``, ``FP8Guard``, ``fp8_sensitivity`` and ``AmaxHistoryLogger`` (bf16 too). Real Trainer
fits, real torchao (``emulate=True``)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import BF16MixedPrecision, FP8Precision, NoEffectWarning, PrecisionPlan
from lightning_precision.callbacks import AmaxHistoryLogger, FP8Guard
from tests.helpers import LossRecorder, fp8_recipe

pytest.importorskip("torchao")

FP8_KW = {"emulate": True, "skip_small_layers": False, "skip_first_last": False}
STEPS = 6


class MoE(nn.Module):
    """Two experts behind a router: on odd steps every token goes to expert 0 and expert 1 gets none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(64, 64)
        self.experts = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])
        self.head = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor, idle: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        route = torch.zeros(len(h), dtype=torch.long) if idle else torch.arange(len(h)) % 2
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            chosen = route == i
            out[chosen] = expert(h[chosen]).to(out.dtype)  # expert 1 gets a [0, 64] input on odd steps
        return self.head(out)


class Lit(LossRecorder):
    def __init__(self) -> None:
        super().__init__(MoE())

    def logits(self, x, batch_idx):
        return self.net(x, idle=batch_idx % 2 == 1)


def loader(steps: int = STEPS) -> torch.utils.data.DataLoader:
    # 64 tokens a step: 32 per expert on even steps, 64 and 0 on odd ones (MXFP8 casts tokens in blocks of 32)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 64, 64, generator=g),
                                          torch.randint(0, 32, (steps * 64,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=64)


def fit(plugin, callbacks=(), **kwargs) -> Lit:
    module = Lit()
    L.Trainer(accelerator="cpu", plugins=[plugin], callbacks=list(callbacks), max_steps=STEPS, logger=False,
              log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, **kwargs).fit(module, loader())
    assert len(module.losses) == STEPS and all(math.isfinite(v) for v in module.losses)
    return module


@pytest.mark.parametrize("recipe", [fp8_recipe(r) for r in ("tensorwise", "rowwise", "mxfp8")])
def test_plain_fp8_runs_a_step_in_which_an_expert_gets_no_tokens(recipe):
    """torchao's Float8Linear cannot (its amax has no value over zero elements): such a call runs in high precision, an
    empty output and a zero weight gradient, as fp8 would give. torchao's MXFP8 layer runs it as is."""
    module = fit(FP8Precision(recipe=recipe, **FP8_KW))
    idle = module.net.experts[1]
    assert type(idle).__name__ in ("Float8Linear", "AutocastMXFP8Linear")  # still fp8 for the steps with tokens
    x = torch.randn(0, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = idle(x)
    y.float().sum().backward()
    assert y.shape == (0, 64) and y.dtype == torch.bfloat16 and not idle.weight.grad.any()


def test_auto_measures_an_expert_on_the_steps_it_gets_tokens():
    plugin = FP8Precision(layers="auto", calibration_batches=4, **FP8_KW)
    fit(plugin)
    assert plugin.plan.batches == 4
    assert plugin.plan.get("net.experts.1").numbers  # measured on steps 0 and 2, passed over on 1 and 3
    assert "net.experts.1" in plugin.plan.fp8_layers


def test_the_guard_watches_an_expert_that_gets_no_tokens_in_some_steps(tmp_path):
    guard = FP8Guard(every_n_steps=1)
    fit(FP8Precision(**FP8_KW), [guard], default_root_dir=tmp_path)
    assert guard.events == []


@pytest.mark.parametrize("plugin", [BF16MixedPrecision(), FP8Precision(**FP8_KW)], ids=["bf16", "fp8"])
def test_the_amax_logger_records_the_tokens_there_are(plugin):
    logger = AmaxHistoryLogger(log_every_n_steps=1)
    fit(plugin, [logger])
    history = logger.chronological_history()
    expert = logger.layers.index("net.experts.1")
    inputs = history[:, expert, 0]
    # amax of its input on the steps it got tokens (0, 2, 4); nothing on the others (1, 3, 5); its weight every step
    assert (inputs[0::2] > 0).all() and (inputs[1::2] == 0).all() and (history[:, expert, 1] > 0).all()


def test_fp8_sensitivity_passes_over_a_batch_without_tokens():
    from lightning_precision.fp8._sensitivity import fp8_sensitivity

    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(64, 64, generator=g), torch.randint(0, 32, (64,), generator=g), idle) for idle in (0, 1, 0)]
    result = fp8_sensitivity(MoE(), data, loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0], b[2]).float(), b[1]))
    assert set(result) == {"inp", "experts.0", "experts.1", "head"} and {s.batches for s in result.values()} == {3}
    assert 0 < result["experts.1"].output_error < 0.1


class Skipping(MoE):
    """An expert no token was routed to is not called at all, as Hugging Face's Mixtral and Qwen-MoE blocks do;
    ``never`` is an expert the router never picks."""

    def __init__(self, never: bool = False) -> None:
        super().__init__()
        self.never = never

    def forward(self, x: torch.Tensor, idle: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        route = torch.zeros(len(h), dtype=torch.long) if idle or self.never else torch.arange(len(h)) % 2
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            chosen = route == i
            if chosen.any():
                out[chosen] = expert(h[chosen]).to(out.dtype)
        return self.head(out)


class IdleFirst(Lit):
    """Expert 1 gets no tokens on even steps, the first one included."""

    def __init__(self, never: bool = False) -> None:
        super().__init__()
        self.net = Skipping(never)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x, idle=batch_idx % 2 == 0).float(), y)


def test_an_expert_not_called_in_the_first_step_is_fp8_from_the_step_it_runs(tmp_path):
    """Only the first step was watched: an expert the router skipped then was reported "its weight is used elsewhere:
    not fp8" for the whole run although it computed in fp8 on every later step with tokens, so FP8Guard never
    watched it, `precision/fp8_layers` left it out, and the plan written said bf16 for it (a run resumed from that plan
    then trained it in bf16). It counts as fp8 from the step it runs; an expert never called stays reported not fp8,
    and the model still pickles."""
    import io

    plugin, guard = FP8Precision(**FP8_KW), FP8Guard(every_n_steps=2)
    module = IdleFirst()
    with pytest.warns(NoEffectWarning, match=r"did not run their forward in the first training step: net\.experts\.1"
                                             r".*no input reached them"):
        L.Trainer(accelerator="cpu", plugins=[plugin], callbacks=[guard], max_steps=STEPS, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                  default_root_dir=tmp_path).fit(module, loader())
    fp8 = {"net.inp", "net.experts.0", "net.experts.1", "net.head"}
    assert {d.fqn for d in plugin.layer_decisions if d.fp8} == set(plugin.fp8_modules()) == fp8
    assert plugin.metrics()["precision/fp8_layers"].item() == 4
    assert PrecisionPlan.load(guard.plan_file).fp8_layers == fp8

    plugin = FP8Precision(**FP8_KW)
    module = IdleFirst(never=True)
    with pytest.warns(NoEffectWarning, match="did not run their forward"):
        L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=STEPS, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False).fit(module, loader())
    assert {d.fqn for d in plugin.layer_decisions if d.fp8} == fp8 - {"net.experts.1"}
    torch.save(module.net, io.BytesIO())


class DemoteAtSecondStep(L.Callback):
    """``plugin.demote(fqn)`` by hand before the second step: after the first backward (settled: expert 1 of
    ``IdleFirst`` did not run in it)."""

    def __init__(self, fqn: str) -> None:
        self.fqn, self.moved = fqn, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.moved = trainer.precision_plugin.demote({self.fqn: "by hand"})


def fit_demoting(fqn: str) -> tuple[FP8Precision, DemoteAtSecondStep, IdleFirst]:
    plugin, demote, module = FP8Precision(**FP8_KW), DemoteAtSecondStep(fqn), IdleFirst()
    with pytest.warns(NoEffectWarning, match="did not run their forward"):
        L.Trainer(accelerator="cpu", plugins=[plugin], callbacks=[demote], max_steps=STEPS, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                  ).fit(module, loader())
    return plugin, demote, module


def test_an_expert_demoted_before_it_first_runs_stays_in_high_precision_when_it_runs():
    """``demote`` (by hand, or a resumed plan's demotions) of an expert no token had reached yet: it was not among the
    layers "in fp8 now", so it was left as a Float8Linear, and the step it first ran it computed in fp8 and was counted
    fp8 again, its demotion lost. It moves like any fp8 layer, and stays moved."""
    plugin, demote, module = fit_demoting("net.experts.1")
    assert demote.moved == ["net.experts.1"]
    assert type(module.net.experts[1]) is nn.Linear  # ran on steps 1, 3, 5: in bf16
    decisions = {d.fqn: d for d in plugin.layer_decisions}
    assert not decisions["net.experts.1"].fp8 and decisions["net.experts.1"].reason == "demoted: by hand"
    assert set(plugin.fp8_modules()) == {"net.inp", "net.experts.0", "net.head"}
    assert plugin.metrics()["precision/fp8_layers"].item() == 3
    assert "net.experts.1" not in plugin.plan_in_force().fp8_layers


def test_a_demotion_while_an_expert_has_not_run_yet_keeps_that_expert_fp8_in_the_plan():
    """The plan ``demote`` keeps (FP8Guard's file, the checkpoint's) was taken from ``layer_decisions`` as they read
    then, an expert no token had reached yet "not fp8": it ran in fp8 from the next step on while the plan said bf16,
    and a run resumed from that checkpoint demoted it."""
    plugin, demote, module = fit_demoting("net.head")
    assert demote.moved == ["net.head"]
    fp8 = {"net.inp", "net.experts.0", "net.experts.1"}
    assert {d.fqn for d in plugin.layer_decisions if d.fp8} == set(plugin.fp8_modules()) == fp8
    assert plugin.plan_in_force().fp8_layers == fp8
    assert PrecisionPlan.from_dict(plugin.state_dict()["plan"]).fp8_layers == fp8
