"""What every recipe shares: a classification LightningModule with torchmetrics accuracy and AdamW."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["ClassificationRecipe", "training_loss"]


class ClassificationRecipe(L.LightningModule):
    """Subclasses build ``self.net`` and implement ``logits(batch)``; batches end with the labels."""

    net: nn.Module

    def __init__(self, num_classes: int, lr: float, weight_decay: float = 0.01) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.lr = lr
        self.weight_decay = weight_decay
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def logits(self, batch: Any) -> Tensor:
        raise NotImplementedError

    def training_loss(self, batch: Any) -> Tensor:
        """The loss of a training batch, without logging (``lightning-precision plan`` measures with it)."""
        return nn.functional.cross_entropy(self.logits(batch).float(), batch[-1])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.training_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits = self.logits(batch).float()
        self.log("val_loss", nn.functional.cross_entropy(logits, batch[-1]), prog_bar=True)
        self.val_acc(logits, batch[-1])
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def training_loss(model: nn.Module, batch: Any) -> Tensor:
    """A recipe model's training loss: the ``loss_fn`` of what measures before a fit (``plan``, ``compare``'s FLOPs)."""
    if not isinstance(model, ClassificationRecipe):
        raise TypeError(f"training_loss: expected a recipe's model (a ClassificationRecipe), not"
                        f" {type(model).__name__}")
    return model.training_loss(batch)
