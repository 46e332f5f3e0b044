"""The loss scaler's numbers pinned: loss scale, growth tracker, skipped steps, streak and optimizer steps, step by
step, on runs whose overflows force skips, backoffs and both bounds of the scale (Fabric and Trainer; gradient
accumulation; several optimizers, read between their steps or not; a fused optimizer; the non-finite guard).

The expected values were recorded with the scaler as it was before its host time was cut; a faster scaler must
produce the very same numbers. Overflows are forced by powers of two (a loss times 2**k overflows fp16 in backward once
the scale is large enough, far from fp16's limit otherwise), so the traces do not depend on the CPU's kernels.
"""

from __future__ import annotations

import math
import re
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision, ScalerConfig, SkippedStepsError
from lightning_precision import fabric as lp_fabric
from tests.helpers import trainer

INF, NAN = math.inf, math.nan
# The loss factor of each step: 2**14 overflows fp16 at the larger scales (backoff until it fits), inf and nan always
# skip (a streak of them drives the scale down to min_scale), 1 trains (and lets the scale grow to max_scale: the
# first ten steps).
FACTORS = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2.0**14, 2.0**14, 1, 1, 1, 1, 1, 1, 1, 1, INF, INF, NAN, INF, INF, INF, INF, INF, 1, 2.0**14, 1, 1,
           1, 1, 1, 1, 2.0**16, 1]
# An inf gradient for the second layer alone (the second optimizer's) on these steps.
SECOND_ONLY = {4, 15, 19, 20, 34}
CONFIG = ScalerConfig(init_scale=2.0**12, growth_interval=3, min_scale=2.0**6, max_scale=2.0**12,
                      max_consecutive_skips=None)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _loss(net: nn.Module, out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    loss = nn.functional.mse_loss(out.float(), y) * FACTORS[step]
    if step in SECOND_ONLY:  # inf in the last layer's weight gradient only
        loss = loss + (net[2].weight * INF).sum()
    return loss


def _state(plugin: Any) -> tuple[Any, ...]:
    state = plugin.state_dict()
    return (state.get("scale"), state.get("_growth_tracker"), state["skipped_steps"], state["consecutive_skips"],
            state["optimizer_steps"])


def _fabric_run(plugin: Any, optimizers: str = "sgd", accumulate: int = 1, read: str = "every",
                steps: int = len(FACTORS)) -> list[Any]:
    """One trace entry per step: what ``step_was_skipped`` said after each optimizer, plus (``read="every"``) the
    state after the step, or (``read="between"``) the loss scale read between the two optimizers' steps and the state
    after both. ``read="end"`` reads the state once, after the last step (the last entry)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _net()
    if optimizers == "two":
        opts = [torch.optim.SGD(net[0].parameters(), lr=0.01),
                torch.optim.Adam(net[2].parameters(), lr=0.01)]
    elif optimizers == "fused":
        opts = [torch.optim.Adam(net.parameters(), lr=0.01, fused=True)]
    else:
        opts = [torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)]
    model, *opts = fabric.setup(net, *opts)
    trace: list[Any] = []
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        for micro in range(accumulate):
            x, y = _batch(step, micro)
            fabric.backward(_loss(net, model(x), y, step) / accumulate)
        entry: list[Any] = []
        for i, opt in enumerate(opts):
            opt.step()
            entry.append(plugin.step_was_skipped)
            if read == "between" and i == 0:
                entry.append(plugin.loss_scale)
        if read in ("every", "between"):
            entry.append(_state(plugin))
        trace.append(tuple(entry))
    trace.append(_state(plugin))
    return trace


# Recorded with the scaler before its host time was cut (see the module's docstring).
GOLDEN: dict[str, list[Any]] = {
    'fabric-sgd-every': [
        (False, (4096.0, 1, 0, 0, 1)),
        (False, (4096.0, 2, 0, 0, 2)),
        (False, (4096.0, 0, 0, 0, 3)),
        (False, (4096.0, 1, 0, 0, 4)),
        (True, (2048.0, 0, 1, 1, 5)),
        (False, (2048.0, 1, 1, 0, 6)),
        (False, (2048.0, 2, 1, 0, 7)),
        (False, (4096.0, 0, 1, 0, 8)),
        (False, (4096.0, 1, 1, 0, 9)),
        (False, (4096.0, 2, 1, 0, 10)),
        (True, (2048.0, 0, 2, 1, 11)),
        (True, (1024.0, 0, 3, 2, 12)),
        (False, (1024.0, 1, 3, 0, 13)),
        (False, (1024.0, 2, 3, 0, 14)),
        (False, (2048.0, 0, 3, 0, 15)),
        (True, (1024.0, 0, 4, 1, 16)),
        (False, (1024.0, 1, 4, 0, 17)),
        (False, (1024.0, 2, 4, 0, 18)),
        (False, (2048.0, 0, 4, 0, 19)),
        (True, (1024.0, 0, 5, 1, 20)),
        (True, (512.0, 0, 6, 2, 21)),
        (True, (256.0, 0, 7, 3, 22)),
        (True, (128.0, 0, 8, 4, 23)),
        (True, (64.0, 0, 9, 5, 24)),
        (True, (64.0, 0, 10, 6, 25)),
        (True, (64.0, 0, 11, 7, 26)),
        (True, (64.0, 0, 12, 8, 27)),
        (True, (64.0, 0, 13, 9, 28)),
        (False, (64.0, 1, 13, 0, 29)),
        (True, (64.0, 0, 14, 1, 30)),
        (False, (64.0, 1, 14, 0, 31)),
        (False, (64.0, 2, 14, 0, 32)),
        (False, (128.0, 0, 14, 0, 33)),
        (False, (128.0, 1, 14, 0, 34)),
        (True, (64.0, 0, 15, 1, 35)),
        (False, (64.0, 1, 15, 0, 36)),
        (True, (64.0, 0, 16, 1, 37)),
        (False, (64.0, 1, 16, 0, 38)),
        (64.0, 1, 16, 0, 38),
    ],
    'fabric-sgd-end': [
        (False,),
        (False,),
        (False,),
        (False,),
        (True,),
        (False,),
        (False,),
        (False,),
        (False,),
        (False,),
        (True,),
        (True,),
        (False,),
        (False,),
        (False,),
        (True,),
        (False,),
        (False,),
        (False,),
        (True,),
        (True,),
        (True,),
        (True,),
        (True,),
        (True,),
        (True,),
        (True,),
        (True,),
        (False,),
        (True,),
        (False,),
        (False,),
        (False,),
        (False,),
        (True,),
        (False,),
        (True,),
        (False,),
        (64.0, 1, 16, 0, 38),
    ],
    'fabric-two-every': [
        (False, False, (4096.0, 1, 0, 0, 1)),
        (False, False, (4096.0, 2, 0, 0, 2)),
        (False, False, (4096.0, 0, 0, 0, 3)),
        (False, False, (4096.0, 1, 0, 0, 4)),
        (False, True, (2048.0, 0, 1, 1, 5)),
        (False, False, (2048.0, 1, 1, 0, 6)),
        (False, False, (2048.0, 2, 1, 0, 7)),
        (False, False, (4096.0, 0, 1, 0, 8)),
        (False, False, (4096.0, 1, 1, 0, 9)),
        (False, False, (4096.0, 2, 1, 0, 10)),
        (True, True, (2048.0, 0, 2, 1, 11)),
        (True, True, (1024.0, 0, 3, 2, 12)),
        (False, False, (1024.0, 1, 3, 0, 13)),
        (False, False, (1024.0, 2, 3, 0, 14)),
        (False, False, (2048.0, 0, 3, 0, 15)),
        (False, True, (1024.0, 0, 4, 1, 16)),
        (False, False, (1024.0, 1, 4, 0, 17)),
        (False, False, (1024.0, 2, 4, 0, 18)),
        (False, False, (2048.0, 0, 4, 0, 19)),
        (False, True, (1024.0, 0, 5, 1, 20)),
        (True, True, (512.0, 0, 6, 2, 21)),
        (True, True, (256.0, 0, 7, 3, 22)),
        (True, True, (128.0, 0, 8, 4, 23)),
        (True, True, (64.0, 0, 9, 5, 24)),
        (True, True, (64.0, 0, 10, 6, 25)),
        (True, True, (64.0, 0, 11, 7, 26)),
        (True, True, (64.0, 0, 12, 8, 27)),
        (True, True, (64.0, 0, 13, 9, 28)),
        (False, False, (64.0, 1, 13, 0, 29)),
        (True, True, (64.0, 0, 14, 1, 30)),
        (False, False, (64.0, 1, 14, 0, 31)),
        (False, False, (64.0, 2, 14, 0, 32)),
        (False, False, (128.0, 0, 14, 0, 33)),
        (False, False, (128.0, 1, 14, 0, 34)),
        (False, True, (64.0, 0, 15, 1, 35)),
        (False, False, (64.0, 1, 15, 0, 36)),
        (True, True, (64.0, 0, 16, 1, 37)),
        (False, False, (64.0, 1, 16, 0, 38)),
        (64.0, 1, 16, 0, 38),
    ],
    'fabric-two-between': [
        (False, 4096.0, False, (4096.0, 2, 0, 0, 2)),
        (False, 4096.0, False, (4096.0, 1, 0, 0, 4)),
        (False, 4096.0, False, (4096.0, 0, 0, 0, 6)),
        (False, 4096.0, False, (4096.0, 2, 0, 0, 8)),
        (False, 4096.0, True, (2048.0, 0, 1, 1, 10)),
        (False, 2048.0, False, (2048.0, 2, 1, 0, 12)),
        (False, 4096.0, False, (4096.0, 1, 1, 0, 14)),
        (False, 4096.0, False, (4096.0, 0, 1, 0, 16)),
        (False, 4096.0, False, (4096.0, 2, 1, 0, 18)),
        (False, 4096.0, False, (4096.0, 1, 1, 0, 20)),
        (True, 2048.0, False, (2048.0, 1, 2, 0, 22)),
        (True, 1024.0, False, (1024.0, 1, 3, 0, 24)),
        (False, 1024.0, False, (2048.0, 0, 3, 0, 26)),
        (False, 2048.0, False, (2048.0, 2, 3, 0, 28)),
        (False, 4096.0, False, (4096.0, 1, 3, 0, 30)),
        (False, 4096.0, True, (2048.0, 0, 4, 1, 32)),
        (False, 2048.0, False, (2048.0, 2, 4, 0, 34)),
        (False, 4096.0, False, (4096.0, 1, 4, 0, 36)),
        (False, 4096.0, False, (4096.0, 0, 4, 0, 38)),
        (False, 4096.0, True, (2048.0, 0, 5, 1, 40)),
        (True, 1024.0, False, (1024.0, 1, 6, 0, 42)),
        (True, 512.0, False, (512.0, 1, 7, 0, 44)),
        (True, 256.0, False, (256.0, 1, 8, 0, 46)),
        (True, 128.0, False, (128.0, 1, 9, 0, 48)),
        (True, 64.0, False, (64.0, 1, 10, 0, 50)),
        (True, 64.0, False, (64.0, 1, 11, 0, 52)),
        (True, 64.0, False, (64.0, 1, 12, 0, 54)),
        (True, 64.0, False, (64.0, 1, 13, 0, 56)),
        (False, 64.0, False, (128.0, 0, 13, 0, 58)),
        (True, 64.0, False, (64.0, 1, 14, 0, 60)),
        (False, 64.0, False, (128.0, 0, 14, 0, 62)),
        (False, 128.0, False, (128.0, 2, 14, 0, 64)),
        (False, 256.0, False, (256.0, 1, 14, 0, 66)),
        (False, 256.0, False, (512.0, 0, 14, 0, 68)),
        (False, 512.0, True, (256.0, 0, 15, 1, 70)),
        (False, 256.0, False, (256.0, 2, 15, 0, 72)),
        (True, 128.0, False, (128.0, 1, 16, 0, 74)),
        (False, 128.0, False, (256.0, 0, 16, 0, 76)),
        (256.0, 0, 16, 0, 76),
    ],
    'fabric-two-end': [
        (False, False),
        (False, False),
        (False, False),
        (False, False),
        (False, True),
        (False, False),
        (False, False),
        (False, False),
        (False, False),
        (False, False),
        (True, True),
        (True, True),
        (False, False),
        (False, False),
        (False, False),
        (False, True),
        (False, False),
        (False, False),
        (False, False),
        (False, True),
        (True, True),
        (True, True),
        (True, True),
        (True, True),
        (True, True),
        (True, True),
        (True, True),
        (True, True),
        (False, False),
        (True, True),
        (False, False),
        (False, False),
        (False, False),
        (False, False),
        (False, True),
        (False, False),
        (True, True),
        (False, False),
        (64.0, 1, 16, 0, 38),
    ],
    'guard-sgd': [
        (False, (None, None, 0, 0, 1)),
        (False, (None, None, 0, 0, 2)),
        (False, (None, None, 0, 0, 3)),
        (False, (None, None, 0, 0, 4)),
        (True, (None, None, 1, 1, 5)),
        (False, (None, None, 1, 0, 6)),
        (False, (None, None, 1, 0, 7)),
        (False, (None, None, 1, 0, 8)),
        (False, (None, None, 1, 0, 9)),
        (False, (None, None, 1, 0, 10)),
        (False, (None, None, 1, 0, 11)),
        (False, (None, None, 1, 0, 12)),
        (False, (None, None, 1, 0, 13)),
        (True, (None, None, 2, 1, 14)),
        (True, (None, None, 3, 2, 15)),
        (True, (None, None, 4, 3, 16)),
        (True, (None, None, 5, 4, 17)),
        (False, (None, None, 5, 0, 18)),
        (True, (None, None, 6, 1, 19)),
        (True, (None, None, 7, 2, 20)),
        (True, (None, None, 8, 3, 21)),
        (True, (None, None, 9, 4, 22)),
        (True, (None, None, 10, 5, 23)),
        (True, (None, None, 11, 6, 24)),
        (True, (None, None, 12, 7, 25)),
        (True, (None, None, 13, 8, 26)),
        (True, (None, None, 14, 9, 27)),
        (True, (None, None, 15, 10, 28)),
        (True, (None, None, 16, 11, 29)),
        (True, (None, None, 17, 12, 30)),
        (True, (None, None, 18, 13, 31)),
        (True, (None, None, 19, 14, 32)),
        (True, (None, None, 20, 15, 33)),
        (True, (None, None, 21, 16, 34)),
        (True, (None, None, 22, 17, 35)),
        (True, (None, None, 23, 18, 36)),
        (True, (None, None, 24, 19, 37)),
        (True, (None, None, 25, 20, 38)),
        (None, None, 25, 20, 38),
    ],
    'guard-two': [
        (False, False, (None, None, 0, 0, 1)),
        (False, False, (None, None, 0, 0, 2)),
        (False, False, (None, None, 0, 0, 3)),
        (False, False, (None, None, 0, 0, 4)),
        (False, True, (None, None, 1, 1, 5)),
        (False, False, (None, None, 1, 0, 6)),
        (False, False, (None, None, 1, 0, 7)),
        (False, False, (None, None, 1, 0, 8)),
        (False, False, (None, None, 1, 0, 9)),
        (False, False, (None, None, 1, 0, 10)),
        (False, False, (None, None, 1, 0, 11)),
        (False, False, (None, None, 1, 0, 12)),
        (False, False, (None, None, 1, 0, 13)),
        (False, False, (None, None, 1, 0, 14)),
        (False, False, (None, None, 1, 0, 15)),
        (False, True, (None, None, 2, 1, 16)),
        (False, False, (None, None, 2, 0, 17)),
        (False, False, (None, None, 2, 0, 18)),
        (False, False, (None, None, 2, 0, 19)),
        (False, True, (None, None, 3, 1, 20)),
        (True, True, (None, None, 4, 2, 21)),
        (True, True, (None, None, 5, 3, 22)),
        (True, True, (None, None, 6, 4, 23)),
        (True, True, (None, None, 7, 5, 24)),
        (True, True, (None, None, 8, 6, 25)),
        (True, True, (None, None, 9, 7, 26)),
        (True, True, (None, None, 10, 8, 27)),
        (True, True, (None, None, 11, 9, 28)),
        (False, False, (None, None, 11, 0, 29)),
        (False, False, (None, None, 11, 0, 30)),
        (False, False, (None, None, 11, 0, 31)),
        (False, False, (None, None, 11, 0, 32)),
        (False, False, (None, None, 11, 0, 33)),
        (False, False, (None, None, 11, 0, 34)),
        (False, True, (None, None, 12, 1, 35)),
        (False, False, (None, None, 12, 0, 36)),
        (False, False, (None, None, 12, 0, 37)),
        (False, False, (None, None, 12, 0, 38)),
        (None, None, 12, 0, 38),
    ],
    'streak': [
        ['4', '4', '128', '64', '4', '32', '16', '65504', '16', '16'],
        (128.0, 0, 8, 4, 23),
    ],
    'new-scale': [
        (False,),
        (False,),
        (False,),
        (False,),
        (4096.0, 1, 0, 0, 4),
        (128.0, 1, 0, 0, 4),
        (512.0, 1, 0, 0, 4),
    ],
    'trainer-automatic-accumulate': [
        ((4096.0, 0, 0, 0, 0), 0.01),
        ((4096.0, 1, 0, 0, 1), 0.009000000000000001),
        ((4096.0, 1, 0, 0, 1), 0.009000000000000001),
        ((4096.0, 2, 0, 0, 2), 0.008100000000000001),
        ((4096.0, 2, 0, 0, 2), 0.008100000000000001),
        ((4096.0, 0, 0, 0, 3), 0.007290000000000001),
        ((4096.0, 0, 0, 0, 3), 0.007290000000000001),
        ((4096.0, 1, 0, 0, 4), 0.006561000000000002),
        ((4096.0, 1, 0, 0, 4), 0.006561000000000002),
        ((2048.0, 0, 1, 1, 5), 0.006561000000000002),
        ((2048.0, 0, 1, 1, 5), 0.006561000000000002),
        ((2048.0, 1, 1, 0, 6), 0.005904900000000002),
        ((2048.0, 1, 1, 0, 6), 0.005904900000000002),
        ((2048.0, 2, 1, 0, 7), 0.005314410000000002),
        ((2048.0, 2, 1, 0, 7), 0.005314410000000002),
        ((4096.0, 0, 1, 0, 8), 0.004782969000000002),
        ((4096.0, 0, 1, 0, 8), 0.004782969000000002),
        ((4096.0, 1, 1, 0, 9), 0.004304672100000002),
        ((4096.0, 1, 1, 0, 9), 0.004304672100000002),
        ((4096.0, 2, 1, 0, 10), 0.003874204890000002),
        ((4096.0, 2, 1, 0, 10), 0.003874204890000002),
        ((2048.0, 0, 2, 1, 11), 0.003874204890000002),
        ((2048.0, 0, 2, 1, 11), 0.003874204890000002),
        ((1024.0, 0, 3, 2, 12), 0.003874204890000002),
        ((1024.0, 0, 3, 2, 12), 0.003874204890000002),
        ((1024.0, 1, 3, 0, 13), 0.003486784401000002),
        ((1024.0, 1, 3, 0, 13), 0.003486784401000002),
        ((1024.0, 2, 3, 0, 14), 0.003138105960900002),
        ((1024.0, 2, 3, 0, 14), 0.003138105960900002),
        ((2048.0, 0, 3, 0, 15), 0.0028242953648100018),
        ((2048.0, 0, 3, 0, 15), 0.0028242953648100018),
        ((1024.0, 0, 4, 1, 16), 0.0028242953648100018),
        ((1024.0, 0, 4, 1, 16), 0.0028242953648100018),
        ((1024.0, 1, 4, 0, 17), 0.0025418658283290017),
        ((1024.0, 1, 4, 0, 17), 0.0025418658283290017),
        ((1024.0, 2, 4, 0, 18), 0.0022876792454961017),
        ((1024.0, 2, 4, 0, 18), 0.0022876792454961017),
        ((2048.0, 0, 4, 0, 19), 0.0020589113209464917),
    ],
    'trainer-manual-two': [
        ((4096.0, 1, 0, 0, 1), 0.01),
        ((4096.0, 2, 0, 0, 2), 0.01),
        ((4096.0, 0, 0, 0, 3), 0.01),
        ((4096.0, 1, 0, 0, 4), 0.01),
        ((2048.0, 0, 1, 1, 5), 0.01),
        ((2048.0, 1, 1, 0, 6), 0.01),
        ((2048.0, 2, 1, 0, 7), 0.01),
        ((4096.0, 0, 1, 0, 8), 0.01),
        ((4096.0, 1, 1, 0, 9), 0.01),
        ((4096.0, 2, 1, 0, 10), 0.01),
        ((2048.0, 0, 2, 1, 11), 0.01),
        ((1024.0, 0, 3, 2, 12), 0.01),
        ((1024.0, 1, 3, 0, 13), 0.01),
        ((1024.0, 2, 3, 0, 14), 0.01),
        ((2048.0, 0, 3, 0, 15), 0.01),
        ((1024.0, 0, 4, 1, 16), 0.01),
        ((1024.0, 1, 4, 0, 17), 0.01),
        ((1024.0, 2, 4, 0, 18), 0.01),
        ((2048.0, 0, 4, 0, 19), 0.01),
    ],
    'trainer-guard': [
        ((None, None, 0, 0, 1), 0.009000000000000001),
        ((None, None, 0, 0, 2), 0.008100000000000001),
        ((None, None, 0, 0, 3), 0.007290000000000001),
        ((None, None, 0, 0, 4), 0.006561000000000002),
        ((None, None, 1, 1, 5), 0.006561000000000002),
        ((None, None, 1, 0, 6), 0.005904900000000002),
        ((None, None, 1, 0, 7), 0.005314410000000002),
        ((None, None, 1, 0, 8), 0.004782969000000002),
        ((None, None, 1, 0, 9), 0.004304672100000002),
        ((None, None, 1, 0, 10), 0.003874204890000002),
        ((None, None, 1, 0, 11), 0.003486784401000002),
        ((None, None, 1, 0, 12), 0.003138105960900002),
        ((None, None, 1, 0, 13), 0.0028242953648100018),
        ((None, None, 1, 0, 14), 0.0025418658283290017),
        ((None, None, 2, 1, 15), 0.0025418658283290017),
        ((None, None, 3, 2, 16), 0.0025418658283290017),
        ((None, None, 4, 3, 17), 0.0025418658283290017),
        ((None, None, 5, 4, 18), 0.0025418658283290017),
        ((None, None, 6, 5, 19), 0.0025418658283290017),
        ((None, None, 7, 6, 20), 0.0025418658283290017),
        ((None, None, 8, 7, 21), 0.0025418658283290017),
        ((None, None, 9, 8, 22), 0.0025418658283290017),
        ((None, None, 10, 9, 23), 0.0025418658283290017),
        ((None, None, 11, 10, 24), 0.0025418658283290017),
        ((None, None, 12, 11, 25), 0.0025418658283290017),
        ((None, None, 13, 12, 26), 0.0025418658283290017),
        ((None, None, 14, 13, 27), 0.0025418658283290017),
        ((None, None, 15, 14, 28), 0.0025418658283290017),
        ((None, None, 16, 15, 29), 0.0025418658283290017),
        ((None, None, 17, 16, 30), 0.0025418658283290017),
        ((None, None, 18, 17, 31), 0.0025418658283290017),
        ((None, None, 19, 18, 32), 0.0025418658283290017),
        ((None, None, 20, 19, 33), 0.0025418658283290017),
        ((None, None, 21, 20, 34), 0.0025418658283290017),
        ((None, None, 22, 21, 35), 0.0025418658283290017),
        ((None, None, 23, 22, 36), 0.0025418658283290017),
        ((None, None, 24, 23, 37), 0.0025418658283290017),
        ((None, None, 25, 24, 38), 0.0025418658283290017),
    ],
}
# Accumulating over two batches and a fused optimizer step at the same steps as plain SGD: the same trace, step by step.
GOLDEN["fabric-accumulate"] = GOLDEN["fabric-fused"] = GOLDEN["fabric-sgd-every"]


def _check(name: str, trace: list[Any]) -> None:
    expected = GOLDEN[name]
    assert len(trace) == len(expected)
    for step, (got, want) in enumerate(zip(trace, expected, strict=True)):
        assert repr(got) == repr(want), f"{name}, step {step}: {got!r} != {want!r}"


@pytest.mark.parametrize("read", ["every", "end"])
def test_fabric_one_optimizer(read):
    _check(f"fabric-sgd-{read}", _fabric_run(lp_fabric.FP16MixedPrecision(scaler=CONFIG), read=read))


def test_fabric_gradient_accumulation():
    _check("fabric-accumulate", _fabric_run(lp_fabric.FP16MixedPrecision(scaler=CONFIG), accumulate=3))


@pytest.mark.parametrize("read", ["every", "between", "end"])
def test_fabric_two_optimizers(read):
    _check(f"fabric-two-{read}", _fabric_run(lp_fabric.FP16MixedPrecision(scaler=CONFIG), "two", read=read))


def test_fabric_fused_optimizer():
    _check("fabric-fused", _fabric_run(lp_fabric.FP16MixedPrecision(scaler=CONFIG), "fused"))


@pytest.mark.parametrize("optimizers", ["sgd", "two"])
def test_fabric_non_finite_guard(optimizers):
    plugin = lp_fabric.BF16MixedPrecision(skip_nonfinite=True, max_consecutive_skips=None)
    _check(f"guard-{optimizers}", _fabric_run(plugin, optimizers))


def test_streak_stops_the_run_at_the_same_step():
    plugin = lp_fabric.FP16MixedPrecision(scaler=ScalerConfig(**{**CONFIG.__dict__, "max_consecutive_skips": 4}))
    with pytest.raises(SkippedStepsError) as error:
        _fabric_run(plugin, read="end")
    # The numbers the message states (the streak, the limit, the scale it stopped at, ...), and the state then.
    _check("streak", [re.findall(r"\d+", str(error.value)), _state(plugin)])


def test_new_scale_as_float_and_as_tensor():
    plugin = lp_fabric.FP16MixedPrecision(scaler=CONFIG)
    trace = _fabric_run(plugin, read="end", steps=4)
    plugin.apply_pending_update()
    scaler = plugin.scaler
    scaler.update(2.0**7)
    trace.append(_state(plugin))
    scaler.update(torch.tensor(2.0**9))
    trace.append(_state(plugin))
    _check("new-scale", trace)


class _Module(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = _net()
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        step = batch_idx // self.trainer.accumulate_grad_batches
        x, y = _batch(batch_idx)
        loss = _loss(self.net, self.net(x), y, step)
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        return None

    def configure_optimizers(self) -> Any:
        if self.automatic_optimization:
            opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return (torch.optim.SGD(self.net[0].parameters(), lr=0.01),
                torch.optim.Adam(self.net[2].parameters(), lr=0.01))

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(range(len(FACTORS) * 2), batch_size=1)


class _Trace(Callback):
    def __init__(self) -> None:
        self.trace: list[Any] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        plugin = trainer.precision_plugin
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.trace.append((_state(plugin), lr))


@pytest.mark.parametrize("kind", ["automatic-accumulate", "manual-two"])
def test_trainer(kind):
    rec = _Trace()
    manual = kind == "manual-two"
    steps = len(FACTORS) if manual else len(FACTORS) // 2
    trainer(FP16MixedPrecision(scaler=CONFIG), max_steps=steps, callbacks=[rec], log_every_n_steps=1,
            accumulate_grad_batches=1 if manual else 2).fit(_Module(manual))
    _check(f"trainer-{kind}", rec.trace)


def test_trainer_guard():
    rec = _Trace()
    trainer(BF16MixedPrecision(skip_nonfinite=True, max_consecutive_skips=None), max_steps=len(FACTORS),
            callbacks=[rec]).fit(_Module())
    _check("trainer-guard", rec.trace)
