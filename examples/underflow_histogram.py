"""Produce the exponent-histogram figure of docs/callbacks/gradient_underflow_monitor.md from a real fp16 run.

A small CNN trained 40 steps under FP16MixedPrecision on generated images (a learnable task: the label is the
quadrant with the brightest mean), with GradientUnderflowMonitor measuring parameter and activation gradients.

    python examples/underflow_histogram.py [--out exponent_histogram.png] [--steps 40]

The plot goes to ``exponent_histogram.png`` in the current working directory unless ``--out`` says otherwise, so
running the example never overwrites the project's docs. The project regenerates its docs figure by passing the path
explicitly, from the repository root:

    python examples/underflow_histogram.py --out docs/images/exponent_histogram.png
"""

from __future__ import annotations

import argparse
import warnings

import lightning as L
import torch
from torch import nn

from lightning_precision import FP16MixedPrecision
from lightning_precision.callbacks import GradientUnderflowMonitor


def quadrant_task(n: int, size: int = 32, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g) * 0.5
    y = torch.randint(0, 4, (n,), generator=g)
    h = size // 2
    for i, q in enumerate(y.tolist()):
        r, c = divmod(q, 2)
        x[i, :, r * h : (r + 1) * h, c * h : (c + 1) * h] += 0.1
    return torch.utils.data.TensorDataset(x, y)


class SmallCNN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
            nn.Linear(256, 4),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_acc", (self.net(x).argmax(1) == y).float().mean(), prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="exponent_histogram.png",
                        help="where to write the plot (default: exponent_histogram.png in the current directory)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    monitor = GradientUnderflowMonitor(activations=True, measure_every_n_steps=1, log_every_n_steps=10,
                                       plot_path=args.out)
    trainer = L.Trainer(accelerator="cpu", max_steps=args.steps, plugins=[FP16MixedPrecision()], callbacks=[monitor],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=10)
    trainer.fit(SmallCNN(), torch.utils.data.DataLoader(quadrant_task(64 * args.steps), batch_size=64))
    for key in sorted(trainer.callback_metrics):
        print(f"{key:<45} {float(trainer.callback_metrics[key]):.5g}")
    scale, under, over = monitor.recommend_loss_scale()
    print(f"recommended loss scale {scale:g} (fp16 underflow {under:.4%}, overflow {over:.4%}); plot: {args.out}")


if __name__ == "__main__":
    main()
