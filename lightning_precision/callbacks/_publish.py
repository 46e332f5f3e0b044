"""A logging step's metrics read from the device at once, for the callbacks that publish them straight to the loggers
(``_upstream.lightning.publish_metrics``): ``self.log`` costs about a millisecond a key on a CPU, more than the
statistics themselves, and a read per key would be a synchronisation each on a GPU."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["read_metrics"]


def read_metrics(metrics: dict[str, Tensor]) -> dict[str, float]:
    """``metrics`` (0-d device tensors) as floats, in one device read."""
    values = torch.stack([v.float() for v in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))
