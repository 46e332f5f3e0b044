"""Evaluation in its own precision (``eval_precision=``): the values a plugin accepts, checked once for every plugin,
and the autocast each one runs validation, test and predict under."""

from __future__ import annotations

from typing import Any

import torch

from lightning_precision._core.devices import check_bf16_supported

__all__ = ["EVAL_AUTOCAST", "EVAL_TRUE", "check_eval_precision", "eval_autocast"]

# What a plugin may evaluate in: an autocast plugin (fp8 and XPU included) in fp32 or either 16-bit autocast; a
# true-precision plugin in fp32 only (its weights are 16-bit: a 16-bit autocast over them is what it trains in).
EVAL_AUTOCAST = ("32-true", "bf16-mixed", "16-mixed")
EVAL_TRUE = ("32-true",)

_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def check_eval_precision(owner: str, eval_precision: Any, allowed: tuple[str, ...]) -> None:
    if eval_precision is not None and (not isinstance(eval_precision, str) or eval_precision not in allowed):
        raise ValueError(
            f"`{owner}(eval_precision={eval_precision!r})`: pass {', '.join(map(repr, allowed))} (what validation,"
            " test and predict run in) or None (the default: evaluate as it trains)."
        )


def eval_autocast(eval_precision: str, device_type: str) -> torch.autocast:
    """``"32-true"``: autocast off (an fp32 forward even inside another autocast; no ``matmul_precision`` scope: fp32
    was asked); ``"bf16-mixed"``/``"16-mixed"``: autocast in that dtype, without the weight cache, as training's."""
    if eval_precision == "32-true":
        return torch.autocast(device_type, enabled=False)
    dtype = _AUTOCAST_DTYPES[eval_precision]
    if dtype is torch.bfloat16:
        check_bf16_supported(device_type)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)
