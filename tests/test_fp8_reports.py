"""What the fp8 plugin reports is what runs (issue 28, items 1 and 5): ``precision/fp8_layers`` reaches the Trainer's
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
from tests.test_plan import FP8_KW, Lit, loader

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
    with caplog.at_level(logging.INFO):
        L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=3, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="last")],
                  ).fit(Lit(), loader(3))
    assert caplog.text.count(measuring) == 1 and caplog.text.count(table) == 1, caplog.text
    assert "linear layers run in fp8" not in caplog.text  # the conversion's own summary, a second table
    made = plugin.plan
    caplog.clear()

    resumed = FP8Precision(layers="auto", calibration_batches=2, **FP8_KW)
    with caplog.at_level(logging.INFO):
        L.Trainer(accelerator="cpu", plugins=[resumed], max_steps=4, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False,
                  ).fit(Lit(), loader(4), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.plan == made
    assert measuring not in caplog.text, caplog.text
    assert caplog.text.count("the plan restored from the checkpoint, not measured again") == 1
    assert caplog.text.count(table) == 1 and "linear layers run in fp8" not in caplog.text
