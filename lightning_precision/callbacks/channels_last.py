"""ChannelsLast: convolution weights and image batches in channels-last memory format, for the Trainer: a thin
callback over ``functional.apply_channels_last`` and ``functional.to_channels_last``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_precision._channels_last import convert_convolutions, convolutions, is_channels_last, to_channels_last
from lightning_precision._core.fsdp import is_sharded
from lightning_precision._warnings import NoEffectWarning, warn

__all__ = ["ChannelsLast"]


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
        self.first_conv_input_channels_last: bool | None = None
        self._wrapped: list[Any] = []
        self._probe: Any | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.weights_channels_last = not (_shards_parameters(trainer.strategy) or is_sharded(pl_module))
        self.converted = convert_convolutions(
            pl_module, "ChannelsLast", "Remove the `ChannelsLast()` callback from the Trainer's `callbacks`.",
            weights=self.weights_channels_last,
        )
        if not self.converted:
            return
        for owner in (pl_module, getattr(trainer, "datamodule", None)):
            if owner is not None and "on_after_batch_transfer" not in vars(owner):
                owner.on_after_batch_transfer = _ConvertAfter(owner.on_after_batch_transfer)  # type: ignore[method-assign]
                self._wrapped.append(owner)
        name, first = convolutions(pl_module)[0]
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
