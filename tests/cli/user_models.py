"""A user's own LightningModule and DataModule for ``compare --model/--data`` (tests/cli/test_compare_user_model.py),
imported by class path from the current directory (the repository's root), as a user's would be; and the wrong kinds of
class a user can name."""

import lightning as L
import torch
from torch import nn


class TinyNet(L.LightningModule):
    """A two-layer classifier that logs val_loss, not val_acc. ``fail_in``: a dtype (``"bfloat16"``) in which its
    logits coming out raise from the fifth training step on, as a model with a numerics bug does: under bf16-mixed's
    autocast, not under 32-true, nor outside a fit (compare counts its FLOPs on its training_step)."""

    def __init__(self, hidden: int = 16, fail_in: str | None = None) -> None:
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden must be positive, got {hidden}")
        self.net = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 4))
        self.fail_in = fail_in

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        if self.fail_in is not None and logits.dtype == getattr(torch, self.fail_in) and self.global_step >= 4:
            raise RuntimeError("the loss went to NaN in layer net.2")
        loss = nn.functional.cross_entropy(logits.float(), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x).float(), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class TrainerBoundNet(TinyNet):
    """A step that reads the Trainer on every call: it cannot run outside a fit."""

    def training_step(self, batch, batch_idx):
        assert self.trainer.precision
        return super().training_step(batch, batch_idx)


class TinyData(L.LightningDataModule):
    """Generated 32-feature samples in 4 classes."""

    def __init__(self, batch_size: int = 8, samples: int = 64) -> None:
        super().__init__()
        self.batch_size, self.samples = batch_size, samples

    def _loader(self, seed: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.samples, 32, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, :4].argmax(1))),
                                           batch_size=self.batch_size)

    def train_dataloader(self):
        return self._loader(0)

    def val_dataloader(self):
        return self._loader(1)


class ReturnsNothing(TinyNet):
    """A step that computes its loss and drops it (a missing `return`): the Trainer would skip every step."""

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)


class ReturnsNoLoss(TinyNet):
    """A step that returns its loss under a key the Trainer does not read."""

    def training_step(self, batch, batch_idx):
        return {"total": super().training_step(batch, batch_idx)}


class EmptyData(TinyData):
    """Data whose training loader holds no sample (an empty split, a filter that kept nothing)."""

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.empty(0, 32)), batch_size=8)


class BrokenData(TinyData):
    """Data whose loader cannot be made (a missing file, as a user's would)."""

    def train_dataloader(self):
        raise FileNotFoundError("/data/train.csv")


class NoOptimizer(L.LightningModule):
    def training_step(self, batch, batch_idx):
        return batch[0].sum()


class PlainModule(nn.Module):
    pass


def not_a_class():
    return TinyNet()
