"""bf16 mixed precision for Fabric: bf16 autocast, no scaler (bf16 has fp32's exponent range)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from typing_extensions import override

from lightning_precision.fabric._autocast import MatmulPrecision, _AutocastPrecision

__all__ = ["BF16_MIN_CAPABILITY", "BF16MixedPrecision", "bf16_capable"]


# bf16 arithmetic on CUDA arrived with Ampere: the one threshold, for this plugin and for `doctor`.
BF16_MIN_CAPABILITY = (8, 0)


def bf16_capable(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability has bf16 arithmetic (every ROCm GPU torch runs on has, as
    ``torch.cuda.is_bf16_supported`` says)."""
    return bool(torch.version.hip) or capability >= BF16_MIN_CAPABILITY


def _check_bf16_supported(device_type: str) -> None:
    if device_type != "cuda":
        return
    found = torch.cuda.get_device_capability()
    if not bf16_capable(found):
        name = torch.cuda.get_device_name()
        need = ".".join(map(str, BF16_MIN_CAPABILITY))
        raise RuntimeError(
            f"BF16MixedPrecision needs a GPU with bf16 support (compute capability >= {need}), found {name!r}"
            f" (compute capability {'.'.join(map(str, found))}). Use `FP16MixedPrecision()` on this GPU."
        )


class BF16MixedPrecision(_AutocastPrecision):
    """bf16 autocast: ``Fabric(plugins=[BF16MixedPrecision()])``.

    Every argument is keyword-only.

    Args:
        device: autocast device type; ``None`` takes it from where the model lives.
        matmul_precision: ``torch.set_float32_matmul_precision`` for the run, restored at teardown.
        scaler: must stay ``None``. Accepted only to say clearly that bf16 needs no loss scaling.
        reduce_dtype: the dtype FSDP2 reduces gradients in under ``mp_policy`` (fp32 by default; bf16 halves the bytes).
    """

    precision = "bf16-mixed"

    def __init__(
        self,
        *,
        device: Optional[str] = None,
        matmul_precision: Optional[MatmulPrecision] = None,
        scaler: Any = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        if scaler is not None:
            raise ValueError(
                f"`{type(self).__name__}(scaler={scaler!r})`: bf16 has fp32's exponent range, so gradients do not"
                " underflow and need no loss scaling. Remove `scaler`, or use `FP16MixedPrecision(...)` for fp16."
            )
        super().__init__(torch.bfloat16, device=device, matmul_precision=matmul_precision, reduce_dtype=reduce_dtype)

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        _check_bf16_supported(device_type)
