"""ChannelsLast: convolution weights and image batches in channels-last memory format."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from typing_extensions import override

from lightning_precision._fsdp import is_sharded
from lightning_precision.warnings import NoEffectWarning, warn

_FORMAT_OF_DIM = {4: torch.channels_last, 5: torch.channels_last_3d}
_CONVS = (nn.modules.conv._ConvNd,)


def _convs(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, _CONVS) and m.weight.dim() in _FORMAT_OF_DIM]


def apply_channels_last(module: nn.Module) -> int:
    """Convert every 2-d convolution's weight to ``channels_last`` and every 3-d one's to ``channels_last_3d``.

    Per module, because ``model.to(memory_format=torch.channels_last)`` raises on a Conv3d; a mixed 2-d/3-d model
    works. Returns how many convolutions were converted; warns ``NoEffectWarning`` when there are none.

    Not for a model FSDP2 shards: ``fully_shard`` refuses non-contiguous parameters, before or after. There, convert
    the batches only (``to_channels_last``): convolutions given channels-last input compute and return channels-last.
    """
    if is_sharded(module):
        raise ValueError(f"apply_channels_last: `{type(module).__name__}` is sharded by FSDP2, which keeps parameters"
                         " contiguous. Convert only the batches (`to_channels_last(batch)`): convolutions given"
                         " channels-last input compute and return channels-last.")
    return _apply_channels_last(module, "apply_channels_last", "Remove the `apply_channels_last` call.")


def _apply_channels_last(module: nn.Module, caller: str, fix: str, weights: bool = True) -> int:
    """``apply_channels_last``, with a no-effect warning that names the API the user called (function or callback).
    ``weights=False`` only counts the convolutions."""
    convs = _convs(module)
    for _, conv in convs if weights else ():
        conv.to(memory_format=_FORMAT_OF_DIM[conv.weight.dim()])
    if not convs:
        warn(
            f"{caller}: `{type(module).__name__}` has no 2-d or 3-d convolution, so channels-last changes nothing."
            f" {fix}",
            NoEffectWarning,
        )
    return len(convs)


def _to_channels_last(x: Tensor) -> Tensor:
    return x.contiguous(memory_format=_FORMAT_OF_DIM[x.dim()]) if x.dim() in _FORMAT_OF_DIM else x


def to_channels_last(batch: Any) -> Any:
    """Every 4-d (``channels_last``) and 5-d (``channels_last_3d``) floating-point tensor in a nested batch."""
    return apply_to_collection(batch, Tensor, lambda t: _to_channels_last(t) if t.is_floating_point() else t)


def is_channels_last(x: Tensor) -> bool:
    return x.dim() in _FORMAT_OF_DIM and x.is_contiguous(memory_format=_FORMAT_OF_DIM[x.dim()])


def _shards_parameters(strategy: Any) -> bool:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))


class _ConvertAfter:
    """Wraps a batch-transfer hook so the batch it returns is channels-last."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        self.__wrapped__ = hook  # Lightning's `is_overridden` looks through it to the hook it wraps

    def __call__(self, batch: Any, dataloader_idx: int) -> Any:
        return to_channels_last(self.hook(batch, dataloader_idx))


class ChannelsLast(Callback):
    """Channels-last convolutions and batches for the Trainer: ``Trainer(callbacks=[ChannelsLast()])``.

    The model is converted in ``setup``, before the strategy moves and wraps it (moving keeps the memory format).
    Under a strategy that shards parameters (``ModelParallelStrategy``, ``FSDPStrategy``) the weights stay contiguous,
    as FSDP refuses others (``weights_channels_last`` is False): the batches alone are converted, and convolutions
    given channels-last input still compute and return channels-last (tested under FSDP2 with the same gradients).
    A callback cannot replace the batch from ``on_train_batch_start``, so every batch is converted in the
    ``on_after_batch_transfer`` hook, after it reaches the device, for fit, validate, test and predict: the callback
    wraps that hook on the LightningModule and the DataModule (whichever Lightning calls) and restores it at teardown.
    On the first forward, it checks that the first convolution really receives channels-last input, and warns if
    something in between (a ``.contiguous()``, an input transform in the forward) converted it back.
    """

    def __init__(self) -> None:
        self.converted = 0
        self.weights_channels_last = False
        self.first_conv_input_channels_last: Optional[bool] = None
        self._wrapped: list[Any] = []
        self._probe: Optional[Any] = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.weights_channels_last = not (_shards_parameters(trainer.strategy) or is_sharded(pl_module))
        self.converted = _apply_channels_last(
            pl_module, "ChannelsLast", "Remove the `ChannelsLast()` callback from the Trainer's `callbacks`.",
            weights=self.weights_channels_last,
        )
        if not self.converted:
            return
        for owner in (pl_module, trainer.datamodule):
            if owner is not None and "on_after_batch_transfer" not in vars(owner):
                owner.on_after_batch_transfer = _ConvertAfter(owner.on_after_batch_transfer)
                self._wrapped.append(owner)
        name, first = _convs(pl_module)[0]
        self._probe = first.register_forward_pre_hook(self._check_first_input(name))

    def _check_first_input(self, name: str) -> Any:
        def check(module: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            if isinstance(x, Tensor):
                self.first_conv_input_channels_last = is_channels_last(x)
                if not self.first_conv_input_channels_last:
                    warn(
                        f"ChannelsLast: the first convolution (`{name}`) received a contiguous (channels-first) input:"
                        " something between the batch and it converted it back (a `.contiguous()`, `.view`, or an"
                        " input transform in the forward). Convolutions still run, with a layout conversion each step.",
                        NoEffectWarning,
                    )
            if self._probe is not None:
                self._probe.remove()
                self._probe = None

        return check

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for owner in self._wrapped:
            del owner.on_after_batch_transfer
        self._wrapped.clear()
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
