"""bf16 mixed precision for Fabric: bf16 autocast, no loss scaling (bf16 has fp32's exponent range), and on request
(``skip_nonfinite=True``) a step whose gradients hold inf/nan skipped instead of written into the weights."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_precision._core.autocast import MatmulPrecision
from lightning_precision._core.devices import check_bf16_supported
from lightning_precision._core.scaled import SKIP_NONFINITE_DEFAULT, ScaledPrecision
from lightning_precision._core.scaling.scaler import ScalerConfig

__all__ = ["BF16MixedPrecision"]


class BF16MixedPrecision(ScaledPrecision):
    """bf16 autocast: ``Fabric(plugins=[BF16MixedPrecision()])``.

    Every argument is keyword-only.

    Args:
        device: autocast device type; ``None`` takes it from where the model lives.
        matmul_precision: ``torch.set_float32_matmul_precision`` inside the forward and backward passes, restored after.
        scaler: must stay ``None``. Accepted only to say clearly that bf16 needs no loss scaling.
        reduce_dtype: the dtype FSDP2 reduces gradients in under ``mp_policy`` (fp32 by default; bf16 halves the bytes).
        skip_nonfinite: ``True``: skip an optimizer step whose gradients hold inf or nan instead of writing NaN into
            every weight, as ``FP16MixedPrecision``'s scaler does (a loss that turns NaN, a diverging step): counted in
            ``skipped_steps`` and ``precision/skipped_steps``, LR schedulers held on it. ``False`` (default):
            Lightning's behaviour, no check; off by default because the check costs more than 2% of a step on small
            models (docs/benchmarks.md).
        max_consecutive_skips: skipped steps in a row before the run stops with ``SkippedStepsError`` (default 50;
            None: never), instead of training nothing. With ``skip_nonfinite=True`` only (another value without it
            is a ``ValueError``: nothing would be skipped).
        eval_precision: what validation, test and predict run in (``eval_context()``): ``None`` (default) as it
            trains; ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` (docs/evaluation.md).
    """

    precision = "bf16-mixed"

    def __init__(
        self,
        *,
        device: str | None = None,
        matmul_precision: MatmulPrecision | None = None,
        scaler: Any = None,
        reduce_dtype: torch.dtype = torch.float32,
        skip_nonfinite: bool = SKIP_NONFINITE_DEFAULT,
        max_consecutive_skips: int | None = ScalerConfig.max_consecutive_skips,
        eval_precision: str | None = None,
    ) -> None:
        if scaler is not None:
            raise ValueError(
                f"`{type(self).__name__}(scaler={scaler!r})`: bf16 has fp32's exponent range, so gradients do not"
                " underflow and need no loss scaling. Remove `scaler`, or use `FP16MixedPrecision(...)` for fp16."
            )
        super().__init__(torch.bfloat16, None, True, device, matmul_precision, reduce_dtype,
                         skip_nonfinite=skip_nonfinite, max_consecutive_skips=max_consecutive_skips,
                         eval_precision=eval_precision)

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        check_bf16_supported(device_type)
        super()._on_device_resolved(device_type)
