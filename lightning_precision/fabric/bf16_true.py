"""True bf16 for Fabric: bf16 weights, gradients and optimizer states that train like fp32."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from lightning_precision._core.devices import check_bf16_supported
from lightning_precision._core.scaling.scaler import ScalerConfig
from lightning_precision._core.true.precision import DEFAULT_STEP_CHUNK, DEFAULT_UPDATE, TruePrecision

__all__ = ["BF16TruePrecision"]


class BF16TruePrecision(TruePrecision):
    """bf16 weights, gradients, activations and optimizer states, stepped like fp32:
    ``Fabric(plugins=[BF16TruePrecision()])``.

    With Adam, 8 bytes a parameter (weight, gradient and two states in bf16) instead of bf16-mixed's 16, with the
    optimizer you already use: each step runs it in fp32 on the weights widened (a chunk at a time), and the new
    weights land in bf16 by ``update``. Lightning's ``precision="bf16-true"`` rounds every update to nearest, and an
    update under half a bf16 ulp (AdamW at lr=1e-4 on weights near 1.0: every one) is lost: the weights never move.

    Every argument is keyword-only.

    Args:
        update: how a new fp32 value lands in a bf16 weight. ``"stochastic"`` (default): rounded up with probability
            equal to its distance from the lower neighbour over the gap, so unbiased: small updates land in proportion.
            ``"compensated"``: bf16 plus a 16-bit remainder that gives back the exact fp32 weight (2 bytes a parameter
            more; deterministic). ``"nearest"``: plain rounding, Lightning's ``bf16-true`` (with
            ``optimizer_states="weight"`` the very same step: the optimizer on the bf16 weights), for comparison.
        optimizer_states: ``"weight"`` (default): the optimizer's states in bf16, rounded like the weights (a
            second moment moving 0.1% a step is under half a bf16 ulp, and would stall rounded to nearest);
            ``"float32"``: in fp32 (4 bytes a state); ``"8bit"``: torchao's 8-bit block-quantized states (about 1
            byte; tensors under 4096 elements stay bf16).
        keep_fp32: module classes kept in fp32 (their inputs widened, their outputs back in bf16), e.g.
            ``(torch.nn.LayerNorm,)``. Default ``()``: every layer in bf16. Normalization layers train in bf16 here
            (their updates land like any weight's, and torch computes their statistics in fp32 internally); keep them
            in fp32 if a model's norms need more than bf16's 8 bits.
        seed: seeds the stochastic rounding (with each parameter's index and step), the same on every rank.
        step_chunk: elements widened to fp32 at once in the optimizer step; bounds its transient memory (torch's and
            torchao's optimizers, which update each parameter apart; any other is stepped once, on the whole model).
        skip_schedulers_on_overflow: hold step-interval LR schedulers on a skipped step (Trainer).
        max_consecutive_skips: skipped steps (inf/nan gradients) in a row before ``SkippedStepsError`` (None: never).
        device: the device the model lives on; ``None``: where it is.
        eval_precision: what validation, test and predict run in (``eval_context()``): ``None`` (default) as it
            trains; ``"32-true"``: fp32 compute, each layer's weights widened for its own forward only (no fp32 copy
            of the model; docs/evaluation.md).
    """

    precision = "bf16-true"

    def __init__(
        self,
        *,
        update: str = DEFAULT_UPDATE,
        optimizer_states: str = "weight",
        keep_fp32: tuple[type[nn.Module], ...] = (),
        seed: int = 0,
        step_chunk: int = DEFAULT_STEP_CHUNK,
        skip_schedulers_on_overflow: bool = True,
        max_consecutive_skips: int | None = ScalerConfig.max_consecutive_skips,
        device: str | None = None,
        eval_precision: str | None = None,
    ) -> None:
        super().__init__(torch.bfloat16, update=update, optimizer_states=optimizer_states, keep_fp32=keep_fp32,
                         seed=seed, step_chunk=step_chunk, scaler=None,
                         skip_schedulers_on_overflow=skip_schedulers_on_overflow, device=device,
                         max_consecutive_skips=max_consecutive_skips, eval_precision=eval_precision)

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        check_bf16_supported(device_type)
        super()._on_device_resolved(device_type)
