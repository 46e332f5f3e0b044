"""Switch a Lightning Trainer between precisions with one line, and see what each one did.

Trains the same small classifier on a generated, learnable task (nothing is downloaded) under fp32,
``BF16MixedPrecision`` and ``FP16MixedPrecision`` on the CPU, and prints accuracy, loss, step time and the fp16 loss
scaler's state. Runs in well under a minute on a laptop CPU:

    python examples/quickstart.py [--steps 150]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision


def make_task(n: int, seed: int) -> TensorDataset:
    """Labels from a fixed random teacher network: learnable, and chance is 1/8."""
    g = torch.Generator().manual_seed(0)
    teacher = [torch.randn(32, 64, generator=g), torch.randn(64, 8, generator=g)]
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
        self.step_times: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_times.append(time.perf_counter() - self._t0)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(dim=1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description="Compare fp32, bf16-mixed and fp16-mixed on a small CPU task.")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the table only, not each fit's banner
    train, val = make_task(8192, seed=1), make_task(2048, seed=2)

    print(f"{'precision':<12}{'val acc':>9}{'loss':>8}{'ms/step':>9}{'loss scale':>12}{'skipped':>9}")
    for name, plugin in [("32-true", None), ("bf16-mixed", BF16MixedPrecision()), ("16-mixed", FP16MixedPrecision())]:
        model = Classifier()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=args.steps, plugins=[plugin] if plugin else None,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(train, batch_size=64, shuffle=True))
        loss = float(trainer.callback_metrics["train_loss"])  # the last step's
        # Validated once after the last step: the accuracy of the model the steps produced, whatever --steps is.
        (metrics,) = trainer.validate(model, DataLoader(val, batch_size=512), verbose=False)
        median_ms = sorted(model.step_times)[len(model.step_times) // 2] * 1e3
        scale = f"{plugin.loss_scale:.0f}" if isinstance(plugin, FP16MixedPrecision) else "-"
        skipped = str(plugin.skipped_steps) if isinstance(plugin, FP16MixedPrecision) else "-"
        print(f"{name:<12}{float(metrics['val_acc']):>9.3f}{loss:>8.3f}{median_ms:>9.2f}"
              f"{scale:>12}{skipped:>9}")
    print("chance accuracy is 0.125")


if __name__ == "__main__":
    main()
