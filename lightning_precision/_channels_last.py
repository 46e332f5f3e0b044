"""Channels-last memory format for convolutions and image batches: the pure functions ``functional`` exports
(``apply_channels_last``, ``to_channels_last``) and what the ``ChannelsLast`` callback needs beneath them."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_precision._core.fsdp import is_sharded
from lightning_precision._warnings import NoEffectWarning, warn

__all__ = ["apply_channels_last", "convert_convolutions", "convolutions", "is_channels_last", "to_channels_last"]


_FORMAT_OF_DIM = {4: torch.channels_last, 5: torch.channels_last_3d}
_CONVS = (nn.modules.conv._ConvNd,)


def convolutions(module: nn.Module) -> list[tuple[str, nn.modules.conv._ConvNd]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, _CONVS) and m.weight.dim() in _FORMAT_OF_DIM]


def apply_channels_last(module: nn.Module) -> int:
    """Convert every 2-d convolution's weight to ``channels_last`` and every 3-d one's to ``channels_last_3d``.

    Per module, because ``model.to(memory_format=torch.channels_last)`` raises on a Conv3d; a mixed 2-d/3-d model
    works. Returns how many convolutions were converted; warns ``NoEffectWarning`` when there are none.

    Not for a model FSDP2 shards: ``fully_shard`` refuses non-contiguous parameters, before or after. There, convert
    the batches only (``to_channels_last``): convolutions given channels-last input compute and return channels-last.

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv3d(8, 8, 1))
        >>> apply_channels_last(model)
        2
        >>> model[0].weight.is_contiguous(memory_format=torch.channels_last)
        True
    """
    if is_sharded(module):
        raise ValueError(f"apply_channels_last: `{type(module).__name__}` is sharded by FSDP2, which keeps parameters"
                         " contiguous. Convert only the batches (`to_channels_last(batch)`): convolutions given"
                         " channels-last input compute and return channels-last.")
    return convert_convolutions(module, "apply_channels_last", "Remove the `apply_channels_last` call.")


def convert_convolutions(module: nn.Module, caller: str, fix: str, weights: bool = True) -> int:
    """``apply_channels_last``, with a no-effect warning that names the API the user called (function or callback).
    ``weights=False`` only counts the convolutions."""
    convs = convolutions(module)
    for _, conv in convs if weights else ():
        conv.to(memory_format=_FORMAT_OF_DIM[conv.weight.dim()])  # type: ignore[call-overload]  # stubs omit it
    if not convs:
        warn(
            f"{caller}: `{type(module).__name__}` has no 2-d or 3-d convolution, so channels-last changes nothing."
            f" {fix}",
            NoEffectWarning,
        )
    return len(convs)


def _tensor_to_channels_last(x: Tensor) -> Tensor:
    return x.contiguous(memory_format=_FORMAT_OF_DIM[x.dim()]) if x.dim() in _FORMAT_OF_DIM else x


def to_channels_last(batch: Any) -> Any:
    """Every 4-d (``channels_last``) and 5-d (``channels_last_3d``) floating-point tensor in a nested batch.

    Example:
        >>> x, y = to_channels_last((torch.randn(2, 3, 8, 8), torch.tensor([0, 1])))
        >>> is_channels_last(x), y.tolist()
        (True, [0, 1])
    """
    return apply_to_collection(batch, Tensor, lambda t: _tensor_to_channels_last(t) if t.is_floating_point() else t)


def is_channels_last(x: Tensor) -> bool:
    """Whether a 4-d or 5-d tensor is laid out channels-last (``channels_last`` or ``channels_last_3d``).

    Example:
        >>> x = torch.randn(2, 3, 8, 8)
        >>> is_channels_last(x), is_channels_last(x.contiguous(memory_format=torch.channels_last))
        (False, True)
    """
    return x.dim() in _FORMAT_OF_DIM and x.is_contiguous(memory_format=_FORMAT_OF_DIM[x.dim()])
