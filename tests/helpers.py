"""Small real models and loops shared by the tests: nothing here is mocked."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IN, HIDDEN, OUT = 16, 32, 4


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def make_data(n_batches: int, batch_size: int = 8, seed: int = 1, overflow_batches: tuple[int, ...] = ()) -> TensorDataset:
    """A learnable task (labels from a fixed linear map); ``overflow_batches`` get inputs that overflow fp16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * batch_size, IN, generator=g)
    y = (x @ torch.randn(IN, OUT, generator=g)).argmax(dim=1)
    for b in overflow_batches:
        x[b * batch_size : (b + 1) * batch_size] *= 1e6  # fp16 max is 65504: the first linear output becomes inf
    return TensorDataset(x, y)


def loader(ds: TensorDataset, batch_size: int = 8) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=False)


class LitNet(L.LightningModule):
    def __init__(self, seed: int = 0, lr: float = 0.1, scheduler: bool = False) -> None:
        super().__init__()
        self.net = make_net(seed)
        self.lr = lr
        self.scheduler = scheduler
        self.losses: list[float] = []
        self.output_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        self.output_dtypes.append(out.dtype)
        loss = nn.functional.cross_entropy(out, y)
        self.losses.append(float(loss.detach()))  # a float of a tensor that needs grad warns
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LossRecorder(L.LightningModule):
    """Cross-entropy of ``net`` (``logits`` says how a batch reaches it), SGD, every training loss kept in
    ``losses``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.losses: list[float] = []

    def logits(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.logits(x, batch_idx).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(plugin: Any = None, **kwargs: Any) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    if plugin is not None:
        defaults["plugins"] = [plugin]
    return L.Trainer(**defaults)


def fabric_loop(plugin: Any, ds: TensorDataset, steps: int, lr: float = 0.1) -> tuple[list[float], nn.Module, L.Fabric]:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net(0)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    model, opt = fabric.setup(net, opt)
    losses = []
    for step, (x, y) in enumerate(fabric.setup_dataloaders(loader(ds))):
        if step == steps:
            break
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(float(loss))
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
    return losses, net, fabric


def count_host_reads(monkeypatch: Any) -> list[int]:
    """From now until ``monkeypatch.undo()``, count host reads of tensors (``item``, ``float``, ``int``, ``bool``,
    ``tolist``: many values in one read) in ``reads[0]`` of the returned list, which the caller may reset."""
    reads = [0]
    for name in ("item", "__float__", "__int__", "__bool__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            reads[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def assert_params_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)


class QuietNet(LitNet):
    """LitNet without its per-step `float(loss)`, so the only device reads left are the precision plugin's."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


def device_reads_per_step(plugin: Any, monkeypatch: Any, log_every_n_steps: int) -> list[int]:
    """Host reads of tensors (`item`, `float`, `int`, `bool`) inside each `optimizer_step` of the plugin, over a
    6-step fit of ``QuietNet`` with a scheduler."""
    counts, current = [], count_host_reads(monkeypatch)
    step = plugin.optimizer_step

    def counting_step(*args: Any, **kwargs: Any) -> Any:
        current[0] = 0
        out = step(*args, **kwargs)
        counts.append(current[0])
        return out

    monkeypatch.setattr(plugin, "optimizer_step", counting_step)
    trainer(plugin, max_steps=6, log_every_n_steps=log_every_n_steps).fit(QuietNet(scheduler=True), loader(make_data(6)))
    monkeypatch.undo()
    return counts



class TwoOptimizers(L.LightningModule):
    """Manual optimization: one backward through ``a`` and ``b``, then each one's optimizer stepped. Subclasses give
    ``loss``."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.automatic_optimization = False

    def loss(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.optimizers()
        self.manual_backward(self.loss(batch[0], batch_idx))
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


def communicate(run: Any, timeout: float = 300) -> tuple[Any, Any]:
    """``run.communicate(timeout=...)``, and the process killed and reaped on any way out (a timeout, a failed assert
    in the caller's ``with``): no test leaves a process behind."""
    try:
        return run.communicate(timeout=timeout)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()

# ---- what the installed torchao can run on a CPU ------------------------------------------------------------------


@functools.cache
def rowwise_emulates_on_cpu() -> bool:
    """torchao 0.11 cannot emulate the rowwise recipe under CPU autocast (its float8 tensor has no rowwise cast there;
    docs/plugins/fp8.md); later releases can."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return False
    net = convert_to_float8_training(nn.Sequential(nn.Linear(16, 16)), config=dataclasses.replace(
        Float8LinearConfig.from_recipe_name("rowwise"), emulate=True))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(torch.randn(16, 16)).float().sum().backward()
    except (AssertionError, RuntimeError, NotImplementedError):
        return False
    return True


@functools.cache
def has_mxfp8() -> bool:
    """Whether the installed torchao has the MXFP8 training layer (torchao 0.11 has none)."""
    from lightning_precision.fp8 import _torchao as lp_fp8

    try:
        return lp_fp8.mxfp8_linear_module() is not None
    except ImportError:
        return False


def fp8_recipe(recipe: str) -> Any:
    """``recipe`` as a pytest parameter, skipped with the reason where the installed torchao cannot run it here."""
    if recipe == "rowwise" and not rowwise_emulates_on_cpu():
        return pytest.param(recipe, marks=pytest.mark.skip(reason="this torchao cannot emulate rowwise under CPU autocast"))
    if recipe == "mxfp8" and not has_mxfp8():
        return pytest.param(recipe, marks=pytest.mark.skip(reason="this torchao has no MXFP8 training layer"))
    return recipe


class Classifier(L.LightningModule):
    """``net`` trained on (input, label) batches with cross-entropy, each loss kept in ``losses``; ``optimizer(module)``
    builds its optimizer; ``log_plugin`` logs the precision plugin's metrics every step."""

    def __init__(self, net: nn.Module, optimizer, log_plugin: bool = False):
        super().__init__()
        self.net, self.losses, self._optimizer, self._log_plugin = net, [], optimizer, log_plugin

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.losses.append(float(loss.detach()))
        if self._log_plugin:
            self.log_dict(self.trainer.precision_plugin.metrics())
        return loss

    def configure_optimizers(self):
        return self._optimizer(self)


def _tensor_parts(value: torch.Tensor) -> list[torch.Tensor]:
    """What a tensor's bits are: an 8-bit optimizer state (torchao's ``OptimState8bit``) by its codes, scales and map."""
    if type(value).__name__ == "OptimState8bit":
        return [value.codes, value.scale, value.qmap]  # type: ignore[attr-defined]
    return [value]


def assert_same_bits(a: Any, b: Any, where: str = "") -> None:
    """Equal bit for bit, through dicts, lists and tuples: tensors by type, dtype, shape and bytes (8-bit states by
    codes, scales and map), the rest by ``==``."""
    if isinstance(a, torch.Tensor):
        assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
        for x, y in zip(_tensor_parts(a), _tensor_parts(b), strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape, f"{where}: {x.dtype}{tuple(x.shape)} != {y.dtype}{tuple(y.shape)}"
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {set(a) ^ set(b)}"
        for key in a:
            assert_same_bits(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_bits(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class RecordingLogger(Logger):
    """A real logger (Trainer and Fabric) that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass
