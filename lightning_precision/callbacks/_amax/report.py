"""AmaxHistoryLogger's per-layer keys: ``precision/amax/<tensor>/<layer>`` and ``precision/fp8_scale/<tensor>/<layer>``
of the layers that ran, as 0-d device tensors (read once by the caller)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_precision.fp8._selection import TENSORS

__all__ = ["layer_metrics"]


def layer_metrics(layers: Sequence[str], ran: Sequence[bool], amax: Tensor, scale: Tensor) -> dict[str, Tensor]:
    """The amax and delayed scale ([layers, 3] each) of every layer that ran (one that never ran has no amax)."""
    amaxes, scales = amax.unbind(0), scale.unbind(0)  # one split each, not an indexing op per key
    metrics: dict[str, Tensor] = {}
    for i, layer in enumerate(layers):
        if not ran[i]:
            continue  # never ran: it has no amax to report
        for k, tensor in enumerate(TENSORS):
            metrics[f"precision/amax/{tensor}/{layer}"] = amaxes[i][k]
            metrics[f"precision/fp8_scale/{tensor}/{layer}"] = scales[i][k]
    return metrics
