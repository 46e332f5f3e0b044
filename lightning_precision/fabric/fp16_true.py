"""True fp16 for Fabric: fp16 weights, gradients and optimizer states, a bounded loss scaler, and never a NaN weight."""

from __future__ import annotations

import torch
from torch import nn

from lightning_precision._core.scaling.scaler import ScalerConfig, resolve_scaler_config
from lightning_precision._core.true.precision import DEFAULT_STEP_CHUNK, DEFAULT_UPDATE, TruePrecision

__all__ = ["FP16TruePrecision"]

# 2**15, not torch's 2**16: a loss computed in fp16 (the Trainer's training_step runs with fp16 as the default dtype)
# starts backward with a gradient of the scale itself, and 2**16 is inf in fp16: the first step would always be skipped.
INIT_SCALE = 2.0**15


class FP16TruePrecision(TruePrecision):
    """fp16 weights, gradients, activations and optimizer states, stepped like fp32:
    ``Fabric(plugins=[FP16TruePrecision()])``.

    Lightning's ``precision="16-true"`` turns NaN with Adam: fp16 flushes the second moment and ``eps=1e-8`` to zero
    and the update divides by zero (the DistilBERT "16-full" failure). Here the optimizer runs in fp32 (``eps`` never
    meets fp16), each fp16 state is stored at a power of two that keeps its largest element near 2**14 (so the second
    moment does not flush), the loss is scaled by the package's bounded scaler (gradients stay scaled in fp16 and are
    unscaled in fp32 inside the step), a step whose gradients hold inf/nan is skipped and counted, and an element whose
    new value is not finite keeps its old one: no NaN is ever written into a weight.

    Every argument is keyword-only. ``update``, ``optimizer_states``, ``keep_fp32``, ``seed``, ``step_chunk``,
    ``skip_schedulers_on_overflow``, ``device`` and ``eval_precision`` as for :class:`BF16TruePrecision` (in fp16,
    ``"compensated"`` keeps the remainder in bf16, about 19 bits of the weight instead of fp32's 24). The loss scaler's
    arguments as for ``FP16MixedPrecision``: ``scaler=ScalerConfig(...)`` or the flat ones (``init_scale``, default
    2**15 here: the gradient a loss computed in fp16 starts backward with is the scale, and 2**16 is inf in fp16;
    ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``min_scale``, ``max_scale``,
    ``max_consecutive_skips``).

    Clipping: the Trainer's ``gradient_clip_val`` clips inside the step, in fp32; with Fabric call
    ``plugin.clip_in_step(optimizer, max_norm=...)`` before ``optimizer.step()`` (``fabric.clip_gradients`` would
    unscale the fp16 gradients in place, flushing the small ones, and raises).
    """

    precision = "16-true"

    def __init__(
        self,
        *,
        update: str = DEFAULT_UPDATE,
        optimizer_states: str = "weight",
        keep_fp32: tuple[type[nn.Module], ...] = (),
        seed: int = 0,
        step_chunk: int = DEFAULT_STEP_CHUNK,
        scaler: ScalerConfig | None = None,
        init_scale: float = INIT_SCALE,
        growth_factor: float = ScalerConfig.growth_factor,
        backoff_factor: float = ScalerConfig.backoff_factor,
        growth_interval: int = ScalerConfig.growth_interval,
        min_scale: float = ScalerConfig.min_scale,
        max_scale: float = ScalerConfig.max_scale,
        max_consecutive_skips: int | None = ScalerConfig.max_consecutive_skips,
        skip_schedulers_on_overflow: bool = True,
        device: str | None = None,
        eval_precision: str | None = None,
    ) -> None:
        if scaler is not None and init_scale == INIT_SCALE:
            init_scale = ScalerConfig.init_scale  # left at this plugin's default: the config's own is in force
        config = resolve_scaler_config(
            type(self).__name__, scaler, {"init_scale": INIT_SCALE}, init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, min_scale=min_scale, max_scale=max_scale,
            max_consecutive_skips=max_consecutive_skips,
        )
        super().__init__(torch.float16, update=update, optimizer_states=optimizer_states, keep_fp32=keep_fp32,
                         seed=seed, step_chunk=step_chunk, scaler=config,
                         skip_schedulers_on_overflow=skip_schedulers_on_overflow, device=device,
                         max_consecutive_skips=config.max_consecutive_skips, eval_precision=eval_precision)
