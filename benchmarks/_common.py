"""What the benchmarks share: a step timer, and ResNet18 and ResNet50 (He et al. 2016, torchvision's layout) without
torchvision, so the benchmarks run on a bare CPU install."""

from __future__ import annotations

import itertools
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_precision.cli.recipes.vision import Bottleneck, resnet

# Steps dropped from the start of every fit (allocator and thread-pool warm-up).
WARMUP = 5


class StepTimer(Callback):
    """Time of each training step, from batch start to batch end (forward, backward, optimizer, hooks): wall time, or
    with ``clock=time.process_time`` the CPU time of this process (its threads together), which other processes on a
    shared machine disturb less."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.times: list[float] = []
        self.clock = clock

    def on_train_batch_start(self, *args) -> None:
        self._t0 = self.clock()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(self.clock() - self._t0)


class BasicBlock(nn.Module):
    expansion = 1  # output channels per unit of width (the package's Bottleneck has 4)

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.down(x))


def process_bytes(field: str) -> int:
    """A byte count of this process from ``/proc/self/status`` (Linux): ``"VmRSS:"`` (resident now), ``"VmHWM:"``
    (its high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def resnet18(num_classes: int = 10) -> nn.Module:
    return resnet(BasicBlock, (2, 2, 2, 2), num_classes)


def resnet50(num_classes: int = 1000, base_width: int = 64, channels: int = 3) -> nn.Module:
    """ResNet50: bottleneck blocks (the package's, also behind its ResNet50 recipe) in stages of 3, 4, 6, 3;
    ``base_width`` 64 is the standard network, smaller widths keep the layout for quick CPU runs."""
    return resnet(Bottleneck, (3, 4, 6, 3), num_classes, base_width, channels)


class ResNet18Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = resnet18()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def image_data(n: int, size: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, size, size, generator=g),
                                          torch.randint(0, 10, (n,), generator=g))


class MLP(L.LightningModule):
    """Linear layers of the given widths with GELU between them; ``MLP(width)`` is five layers: width x4, then 10."""

    def __init__(self, width: int = 512, dims: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        dims = dims or (width,) * 5 + (10,)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(dims) - 2 else [])
        self.net = nn.Sequential(*layers)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)
