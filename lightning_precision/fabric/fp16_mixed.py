"""fp16 mixed precision for Fabric: fp16 autocast plus a loss scaler, for real on every device (CPU included)."""

from __future__ import annotations

import torch

from lightning_precision._core.autocast import MatmulPrecision
from lightning_precision._core.scaled import ScaledPrecision
from lightning_precision._core.scaling.scaler import ScalerConfig, resolve_scaler_config

__all__ = ["FP16MixedPrecision"]


class FP16MixedPrecision(ScaledPrecision):
    """fp16 autocast with a ``torch.amp.GradScaler``: ``Fabric(plugins=[FP16MixedPrecision()])``.

    Unlike Lightning's ``precision="16-mixed"``, which becomes bf16 on CPU, this runs fp16 autocast and a CPU
    ``GradScaler`` there too (slow without native fp16, but the numerics are the real ones).

    The scale is updated once per backward, after every optimizer that uses its gradients has stepped: at the next
    backward, or when ``loss_scale``, ``skipped_steps``, ``metrics()`` or ``state_dict()`` is read (torch's documented
    pattern for several optimizers; updating after each optimizer would unscale the second with the new scale).

    Every argument is keyword-only. The scaler's are given either as one ``scaler=ScalerConfig(...)`` or flat; not both.

    Args:
        scaler: the loss scaler's arguments as one :class:`~lightning_precision.ScalerConfig` (``None``: the flat ones).
        init_scale: initial loss scale, in ``[min_scale, max_scale]``.
        growth_factor: scale multiplier after ``growth_interval`` steps without inf/nan.
        backoff_factor: scale multiplier on a step with inf/nan (that step is skipped).
        growth_interval: overflow-free steps before the scale grows.
        device: autocast device type; ``None`` takes it from where the model lives.
        matmul_precision: ``torch.set_float32_matmul_precision`` inside the forward and backward passes, restored after.
        skip_schedulers_on_overflow: record whether each step was skipped (``step_was_skipped``) so that step-interval
            LR schedulers are not advanced on it. The Trainer plugin does this for you (Lightning issue #5558).
        min_scale, max_scale: bounds of the scale (defaults 2**-24 and 2**24). torch's scaler has none, and at a scale
            of 2**-128 its unscale writes NaN into every weight on the next clean step.
        max_consecutive_skips: skipped steps in a row before the run stops with ``SkippedStepsError`` (default 50;
            None: never), instead of training nothing.
        reduce_dtype: the dtype FSDP2 reduces gradients in under ``mp_policy`` (fp32 by default; bf16 halves the bytes).
        eval_precision: what validation, test and predict run in (``eval_context()``): ``None`` (default) as it
            trains; ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` (docs/evaluation.md).
    """

    precision = "16-mixed"

    def __init__(
        self,
        *,
        scaler: ScalerConfig | None = None,
        init_scale: float = ScalerConfig.init_scale,
        growth_factor: float = ScalerConfig.growth_factor,
        backoff_factor: float = ScalerConfig.backoff_factor,
        growth_interval: int = ScalerConfig.growth_interval,
        device: str | None = None,
        matmul_precision: MatmulPrecision | None = None,
        skip_schedulers_on_overflow: bool = True,
        min_scale: float = ScalerConfig.min_scale,
        max_scale: float = ScalerConfig.max_scale,
        max_consecutive_skips: int | None = ScalerConfig.max_consecutive_skips,
        reduce_dtype: torch.dtype = torch.float32,
        eval_precision: str | None = None,
    ) -> None:
        config = resolve_scaler_config(
            type(self).__name__, scaler, init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, min_scale=min_scale, max_scale=max_scale,
            max_consecutive_skips=max_consecutive_skips,
        )
        super().__init__(torch.float16, config, skip_schedulers_on_overflow, device, matmul_precision, reduce_dtype,
                         eval_precision=eval_precision)
