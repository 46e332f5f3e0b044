"""GradientUnderflowMonitor's probe backward: the first micro-batch's backward again, at ``probe_factor`` times the loss
scale, whose non-zero gradients show what the real fp16 backward flushed. Its scale, how it runs (inside the loop's own
backward under Fabric), and what it found, judged on the device without a host read."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_precision.functional import CastStats, exponent_histogram, measurable_values

__all__ = ["Probe", "judged", "probe_run", "probe_scale", "smaller_factor"]


class Probe:
    """The probe backward of one micro-batch: where its gradients are non-zero, their histogram, and whether it stayed
    finite (if not, it says nothing: it is discarded on the device, without a host read). With activation hooks, the
    activation gradients it passed (``activation_histogram``) and those of the real backward (``real_activations``),
    one of which joins the monitor's histogram once the probe is judged."""

    def __init__(self, nonzero: dict[str, Tensor], histogram: Tensor, finite: Tensor,
                 activation_histogram: Tensor | None = None, headroom: Tensor | None = None) -> None:
        # `finite`: whether it is judged (it stayed finite, and saw beyond the real backward); `overflowed`: whether it
        # went non-finite (what makes the next probe smaller).
        self.nonzero, self.histogram, self.overflowed = nonzero, histogram, ~finite
        self.finite = finite if headroom is None else finite & headroom.to(finite.device)
        self.activation_histogram = activation_histogram
        self.real_activations: Tensor | None = None
        # What `compare` counted: real gradients lost to fp16, and the elements compared.
        self.flushed: Tensor | None = None
        self.compared: Tensor | None = None

    def add_real_activations(self, hist: Tensor) -> None:
        """The real backward's activation gradients, held until the probe is judged."""
        self.real_activations = hist if self.real_activations is None else self.real_activations + hist

    def take_real_activations(self) -> Tensor | None:
        real, self.real_activations = self.real_activations, None
        return real

    def compare(self, name: str, values: Tensor) -> None:
        """Count, of the real gradient ``values`` of ``name``, those zero where the probe's are not (lost to fp16), and
        how many were compared. Only where the probe saw the same values (a sparse gradient may store others):
        elsewhere this tensor adds nothing to the lost count, and its own statistics stand."""
        probed = self.nonzero.get(name)
        if probed is None or probed.shape != values.shape:
            return
        flushed = torch.count_nonzero((values == 0) & probed)
        self.flushed = flushed if self.flushed is None else self.flushed + flushed
        n = torch.zeros((), dtype=torch.int64, device=flushed.device) + probed.numel()
        self.compared = n if self.compared is None else self.compared + n

    def lost(self) -> CastStats | None:
        """The ``lost/fp16`` counts of what ``compare`` saw (None if nothing). A probe that overflowed says nothing: it
        adds neither losses nor elements (decided on the device), and its overflow is counted so that the next probe
        is smaller."""
        if self.flushed is None or self.compared is None:
            return None
        zero = torch.zeros_like(self.flushed)
        lost, compared = torch.where(self.finite, self.flushed, zero), torch.where(self.finite, self.compared, zero)
        return CastStats(numel=compared, exact_zero=zero, underflow=lost, overflow=zero,
                         nonfinite=self.overflowed.to(torch.int64))

    def histogram_or(self, real: Tensor) -> Tensor:
        """The probe's parameter-gradient histogram where it stayed finite, else the real one."""
        return torch.where(self.finite, self.histogram.to(real.device), real)

    def judged_activations(self) -> Tensor | None:
        """The same choice for activation gradients: the probe's where it stayed finite (it holds what fp16's real
        backward flushed), else the real backward's; None without activation hooks."""
        if self.activation_histogram is None:
            return None
        real = self.real_activations if self.real_activations is not None else \
            torch.zeros_like(self.activation_histogram)
        return torch.where(self.finite.to(real.device), self.activation_histogram.to(real.device), real)


def smaller_factor(factor: float) -> float:
    """The factor of the probe after one overflowed: its log2 halved (2**16 -> 2**8)."""
    return 2.0 ** (int(math.log2(factor)) // 2)


class _RunInBackward(torch.autograd.Function):
    """A root whose backward calls ``fn`` and passes no gradient on."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[], Any], leaf: Tensor) -> Tensor:
        ctx.fn = fn
        return leaf.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        ctx.fn()
        return None, None


def _run_in_backward(fn: Callable[[], Any], device: torch.device, backward: Callable[[Tensor], None]) -> Any:
    """``fn()``, run from inside ``backward(root)``: Fabric lets a backward pass through its model's outputs only there.
    The root hangs on a fresh leaf, so ``backward`` walks (and frees) nothing of the model's graph, and the gradient it
    sends in (the loss scale) is not used."""
    result: list[Any] = []
    backward(_RunInBackward.apply(lambda: result.append(fn()), torch.zeros((), device=device, requires_grad=True)))
    return result[0]


def probe_scale(loss: Tensor, loss_scale: Tensor | float, factor: float) -> tuple[Tensor, Tensor | None]:
    """The probe's effective scale, and where it is capped, whether it still exceeds the real scale (``headroom``)."""
    scale = torch.as_tensor(loss_scale, dtype=torch.float32, device=loss.device)
    effective = scale * factor
    headroom = None
    if loss.dtype == torch.float16:
        # An fp16 loss (FP16TruePrecision) takes its gradient, the scale, in fp16: above 2**15 it is inf at the
        # root. Capped there; a probe no larger than the real scale sees nothing beyond it and is not judged.
        effective = effective.clamp(max=2.0**15)
        headroom = effective > scale
    return effective, headroom


def probe_run(loss: Tensor, effective: Tensor, params: list[Tensor],
              backward: Callable[[Tensor], None] | None) -> Callable[[], Sequence[Tensor | None]]:
    """The probe backward, ready to run (``loss * effective`` is taken now): ``torch.autograd.grad`` on the same
    graph, kept for the real backward; inside ``backward``, the loop's own entry, when there is one."""
    probe = functools.partial(torch.autograd.grad, loss * effective, params, retain_graph=True, allow_unused=True)
    if backward is None:
        return probe
    return lambda: _run_in_backward(probe, loss.device, backward)


def judged(params: Sequence[str], grads: Sequence[Tensor | None], effective: Tensor,
           activation_histogram: Tensor | None, headroom: Tensor | None) -> Probe | None:
    """What the probe found, as a ``Probe``; None when its gradients reached none of ``params`` (with some)."""
    present = {n: g for n, g in zip(params, grads, strict=True) if g is not None}
    if params and not present:
        return None
    finite = torch.stack([torch.isfinite(measurable_values(g)).all() for g in present.values()]).all() if present \
        else torch.ones((), dtype=torch.bool)
    nonzero = {n: measurable_values(g) != 0 for n, g in present.items()}
    return Probe(nonzero, exponent_histogram(present, 1.0 / effective), finite, activation_histogram, headroom)
