"""What the fp8 plugin reports is what runs: ``precision/fp8_layers`` reaches the Trainer's
logger at its cadence, and a resumed ``layers="auto"`` run says its plan was restored, once.

Real torchao (``emulate=True``), real Trainer fits on CPU, real CSV logs and checkpoints.
"""

from __future__ import annotations

import csv
import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_precision import FP8Precision
from tests.fp8.test_plan import FP8_KW, Lit, loader
from tests.helpers import has_mxfp8

pytest.importorskip("torchao")


def logged(tmp_path, key: str) -> dict[int, float]:
    """``key``'s values in the CSV log, by step."""
    (path,) = tmp_path.rglob("metrics.csv")
    with open(path) as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


class TwoOptimizers(Lit):
    """Manual optimization: one backward, two optimizers stepped per training step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        self.manual_backward(loss)
        for opt in (first, second):
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        net = self.net
        return (torch.optim.SGD([*net.a.parameters(), *net.b.parameters()], lr=0.01),
                torch.optim.SGD([p for n, p in net.named_parameters() if n[0] not in "ab"], lr=0.01))


@pytest.mark.parametrize("module", [Lit, TwoOptimizers], ids=["automatic", "manual-two-optimizers"])
def test_the_trainer_plugin_logs_the_fp8_layer_count_at_the_loggers_cadence(tmp_path, module):
    """It used to be in ``plugin.metrics()`` only (FP8Guard logged it, on its measured steps): now every logging step
    has it, one value per step whatever the optimizers, read from the host (no device value)."""
    plugin = FP8Precision(**FP8_KW)
    steps = 6 if module is Lit else 12  # `max_steps` counts each optimizer's steps
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=steps, log_every_n_steps=2,
                        logger=CSVLogger(tmp_path, name="run"), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module(), loader(6))
    assert logged(tmp_path, "precision/fp8_layers") == {1: 5.0, 3: 5.0, 5: 5.0}  # the logger's steps 1, 3, 5


def test_an_auto_plan_prints_once_and_a_resumed_run_says_it_was_restored_not_measured(tmp_path, caplog):
    """The plan used to print twice (its table, then the conversion's summary), and a run resumed from a checkpoint
    said "the first 2 training batches run in bf16 while ... measured" before applying the checkpoint's plan."""
    measuring, table = "while their fp8 numerics are measured", "linear layers in fp8"
    plugin = FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):  # another test may have quieted it
        L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=3, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="last")],
                  ).fit(Lit(), loader(3))
    assert caplog.text.count(measuring) == 1 and caplog.text.count(table) == 1, caplog.text
    assert "linear layers run in fp8" not in caplog.text  # the conversion's own summary, a second table
    made = plugin.plan
    caplog.clear()

    resumed = FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):  # another test may have quieted it
        L.Trainer(accelerator="cpu", plugins=[resumed], max_steps=4, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False,
                  ).fit(Lit(), loader(4), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.plan == made
    assert measuring not in caplog.text, caplog.text
    assert caplog.text.count("the plan restored from the checkpoint, not measured again") == 1
    assert caplog.text.count(table) == 1 and "linear layers run in fp8" not in caplog.text


# ---- an MXFP8 layer that never gets a block of tokens is reported as what it runs ------------------------------

mxfp8 = pytest.mark.skipif(not has_mxfp8(), reason="this torchao has no MXFP8 training layer")


class Pooled(nn.Module):
    """DistilBERT's shape in small: an encoder layer over every token (batch x sequence), then ``pre`` (its
    ``pre_classifier``) over the first token of each sample only (batch tokens), then a head whose 2 classes no block
    divides (kept in bf16 by the shape rules)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.pre, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        return self.head(torch.relu(self.pre(h[:, 0])))


class PooledLit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Pooled()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def sequences(batch: int, lengths: list[int]) -> torch.utils.data.DataLoader:
    """One batch of ``batch`` samples per entry of ``lengths``, each of that sequence length (batch_size=None: the
    loader yields them as they are)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, n, 64, generator=g), torch.randint(0, 2, (batch,), generator=g)) for n in lengths]
    return torch.utils.data.DataLoader(data, batch_size=None)


MX_KW = {"recipe": "mxfp8", "emulate": True, "skip_small_layers": False, "skip_first_last": False}


def fit_pooled(tmp_path, loader, **kwargs):
    plugin = FP8Precision(**MX_KW, **kwargs)
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=len(loader), log_every_n_steps=1,
                        logger=CSVLogger(tmp_path, name="run"), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.warns(Warning) as caught:
        trainer.fit(PooledLit(), loader)
    from lightning_precision import NoEffectWarning

    return plugin, [str(w.message) for w in caught if issubclass(w.category, NoEffectWarning)]


@mxfp8
def test_a_layer_that_sees_too_few_tokens_for_a_block_is_reported_not_fp8_and_named_with_a_fix(tmp_path):
    """8 samples of 4 tokens: ``enc`` sees 32 tokens (MXFP8), ``pre`` 8 (every call in bf16). ``pre`` used to be
    reported MXFP8 (``precision/fp8_layers`` = 2) while it ran in bf16 every step, behind a warning that named no layer
    and advised a batch x sequence that was already a multiple of 32."""
    plugin, warned = fit_pooled(tmp_path, sequences(8, [4] * 4))
    decisions = {d.fqn: d for d in plugin.layer_decisions}
    assert decisions["net.enc"].fp8 and not decisions["net.pre"].fp8
    assert "every training call so far had 8 tokens, not a multiple of 32" in decisions["net.pre"].reason
    assert float(plugin.metrics()["precision/fp8_layers"]) == 1
    assert set(logged(tmp_path, "precision/fp8_layers").values()) == {1.0}  # from the first logged step on
    assert len(warned) == 1, warned  # one warning, from the plugin, not one more from the layer each step
    assert "net.pre (8 tokens)" in warned[0] and "module_filter=lambda module, fqn: fqn not in {'net.pre'}" in warned[0]
    assert "batch x sequence is what is short" not in warned[0]
    # The fix it gives works: with `pre` excluded, every fp8 layer runs in MXFP8 and nothing is warned.
    plugin, warned = fit_pooled(tmp_path / "fixed", sequences(8, [4] * 2),
                                module_filter=lambda module, fqn: fqn not in {"net.pre"})
    assert [d.fqn for d in plugin.layer_decisions if d.fp8] == ["net.enc"] and warned == []


@mxfp8
def test_when_batch_x_sequence_is_short_the_warning_says_so_and_a_layer_counts_again_once_it_runs_in_mxfp8(tmp_path):
    """8 samples of 3 tokens (24): no layer gets a block, so batch x sequence is what is short. Sequences of another
    length later (dynamic padding: 8 x 4 = 32 tokens) run ``enc`` in MXFP8: it is fp8 again from then on."""
    plugin, warned = fit_pooled(tmp_path, sequences(8, [3, 3, 4, 4]))
    assert len(warned) == 1 and "net.enc (24 tokens), net.pre (8 tokens)" in warned[0]
    assert "batch x sequence is what is short" in warned[0]
    by_step = logged(tmp_path, "precision/fp8_layers")
    assert by_step == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0}
    assert [d.fqn for d in plugin.layer_decisions if d.fp8] == ["net.enc"]


@mxfp8
def test_a_layer_that_falls_back_only_on_a_short_last_batch_stays_mxfp8_with_one_warning_naming_it(tmp_path):
    """An epoch's short last batch (6 samples: ``enc`` sees 24 tokens, ``pre`` 6) runs both in bf16 once: they stay
    MXFP8 layers (their other steps run in MXFP8), each named once in a warning with the fix (drop_last). With 32
    samples ``pre`` gets 32 tokens, as a strided view (the first token of each sample), which torchao's MXFP8 cast
    refused ("unsupported": it takes contiguous tensors only): the layer now hands it a contiguous copy."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(b, 4, 64, generator=g), torch.randint(0, 2, (b,), generator=g)) for b in (32, 32, 6)]
    plugin, warned = fit_pooled(tmp_path, torch.utils.data.DataLoader(data, batch_size=None))
    assert [d.fqn for d in plugin.layer_decisions if d.fp8] == ["net.enc", "net.pre"]
    assert float(plugin.metrics()["precision/fp8_layers"]) == 2
    assert sorted(w.split(" ran a call")[0] for w in warned) == ["MXFP8: layer 'net.enc'", "MXFP8: layer 'net.pre'"]
    assert "of 24 tokens" in " ".join(warned) and all("drop_last=True" in w for w in warned)


def test_the_guards_fp8_layer_count_is_logged_at_the_step_lightning_logs_the_batch_at(tmp_path):
    """FP8Guard logged ``precision/fp8_layers`` (on its measured steps between the logger's) at ``global_step``, which
    counts every optimizer's steps, while the plugin logs it at the logger's step: with two optimizers a 6-step run
    had values at steps 8 and 10, and a logger that drops steps going back (wandb) lost the plugin's."""
    from lightning_precision.callbacks import FP8Guard

    L.Trainer(accelerator="cpu", plugins=[FP8Precision(**FP8_KW)], callbacks=[FP8Guard(every_n_steps=1)], max_steps=12,
              log_every_n_steps=2, logger=CSVLogger(tmp_path, name="run"), default_root_dir=tmp_path,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              ).fit(TwoOptimizers(), loader(6))
    assert sorted(logged(tmp_path, "precision/fp8_layers")) == [0, 1, 2, 3, 4, 5]  # guard: 0, 2, 4; plugin: 1, 3, 5


class Routed(nn.Module):
    """A router over two MXFP8 experts: expert 1 gets no token in step 0, 8 of the 64 tokens in steps 1 and 2, 32 in
    step 3; expert 0 the rest."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(64, 64), nn.Linear(64, 64)
        self.experts = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        route = torch.zeros(len(h), dtype=torch.long)
        route[: (0, 8, 8, 32)[step]] = 1
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            chosen = route == i
            if chosen.any():  # an expert without tokens is not called (Hugging Face's Mixtral)
                out[chosen] = expert(h[chosen]).to(out.dtype)
        return self.head(out)


class RoutedLit(PooledLit):
    def __init__(self) -> None:
        super().__init__()
        self.net = Routed()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x, batch_idx).float(), y)


@mxfp8
def test_an_expert_idle_in_the_first_step_whose_calls_then_fall_back_is_reported_not_fp8_until_one_runs_in_mxfp8(
    tmp_path,
):
    """Its first step with tokens was never judged as the first step is: it was counted fp8 from then on while every
    call ran in bf16, under the layer's own warning that it "stays an MXFP8 layer". Judged the same way now: not fp8
    (the reason gives its 8 tokens) until a call of 32 tokens runs in MXFP8."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 64, generator=g), torch.randint(0, 64, (64,), generator=g)) for _ in range(4)]
    plugin = FP8Precision(**MX_KW)
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=3, log_every_n_steps=1,
                        logger=CSVLogger(tmp_path, name="run"), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = RoutedLit()
    with pytest.warns(Warning) as caught:
        trainer.fit(module, torch.utils.data.DataLoader(data[:3], batch_size=None))
    from lightning_precision import NoEffectWarning

    warned = [str(w.message) for w in caught if issubclass(w.category, NoEffectWarning)]
    assert logged(tmp_path, "precision/fp8_layers") == {0: 3.0, 1: 3.0, 2: 3.0}
    expert = {d.fqn: d for d in plugin.layer_decisions}["net.experts.1"]
    assert not expert.fp8 and "every training call so far had 8 tokens" in expert.reason
    assert not any("'net.experts.1'" in w and "stays an MXFP8 layer" in w for w in warned), warned
    assert sum("net.experts.1 (8 tokens)" in w for w in warned) == 1, warned

    # A step that gives it 32 tokens runs it in MXFP8: counted again.
    L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False,
              ).fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    assert plugin.metrics()["precision/fp8_layers"].item() == 4


@mxfp8
def test_demote_moves_an_mxfp8_layer_whose_calls_all_fell_back_and_it_does_not_count_again(tmp_path):
    """``pre`` (8 tokens a step) is reported not fp8 after the first step; ``demote`` left it as an MXFP8 layer (not
    "in fp8 now"), so the first 32-token call ran it in MXFP8 and counted it fp8 again, its demotion lost."""
    from tests.fp8.test_idle_experts import DemoteAtSecondStep

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(b, 4, 64, generator=g), torch.randint(0, 2, (b,), generator=g)) for b in (8, 8, 32)]
    plugin, demote, module = FP8Precision(**MX_KW), DemoteAtSecondStep("net.pre"), PooledLit()
    with pytest.warns(Warning):
        L.Trainer(accelerator="cpu", plugins=[plugin], callbacks=[demote], max_steps=3, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  ).fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    assert demote.moved == ["net.pre"] and type(module.net.pre) is nn.Linear
    assert [d.fqn for d in plugin.layer_decisions if d.fp8] == ["net.enc"]
    assert plugin.metrics()["precision/fp8_layers"].item() == 1


@mxfp8
def test_a_second_model_leaves_the_first_ones_mxfp8_layers_warning_their_fallbacks():
    """Fabric with two models (a GAN's two halves) on one plugin: the second's conversion closed the first's watch
    before any backward, and the first's MXFP8 layers kept the silence the watch had put on them: their calls on too
    few tokens for a block ran in bf16, step after step, with no warning."""
    from lightning_precision import NoEffectWarning
    from lightning_precision.fabric import FP8Precision as FabricFP8Precision

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision(**MX_KW)])
    first = fabric.setup_module(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))
    fabric.setup_module(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))
    with pytest.warns(NoEffectWarning, match=r"layer '0' ran a call of 8 tokens"):
        fabric.backward(first(torch.randn(8, 64)).float().sum())
