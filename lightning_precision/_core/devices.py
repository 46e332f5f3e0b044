"""The hardware checks of the plugins, run once when a plugin resolves its device (never on a property read), and the
bf16 threshold ``doctor`` shares with them."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BF16_MIN_CAPABILITY", "bf16_capable", "check_bf16_supported", "check_fp64"]

# bf16 arithmetic on CUDA arrived with Ampere: the one threshold, for the plugins and for `doctor`.
BF16_MIN_CAPABILITY = (8, 0)


def bf16_capable(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability has bf16 arithmetic (every ROCm GPU torch runs on has, as
    ``torch.cuda.is_bf16_supported`` says)."""
    return bool(torch.version.hip) or capability >= BF16_MIN_CAPABILITY


def check_bf16_supported(device_type: str) -> None:
    """Refuse bf16 autocast on a CUDA GPU without bf16 arithmetic, naming the GPU and the plugin to use instead."""
    if device_type != "cuda":
        return
    if not torch.cuda.is_available():  # (asked for the capability, torch would fail with a bare assertion)
        raise RuntimeError(
            "bf16 on device 'cuda': this process has no CUDA GPU (`torch.cuda.is_available()` is False, torch"
            f" {torch.__version__}). Pass the device the model trains on, or `device=None` (where the model lives)."
        )
    found = torch.cuda.get_device_capability()
    if not bf16_capable(found):
        name = torch.cuda.get_device_name()
        need = ".".join(map(str, BF16_MIN_CAPABILITY))
        raise RuntimeError(
            f"BF16MixedPrecision needs a GPU with bf16 support (compute capability >= {need}), found {name!r}"
            f" (compute capability {'.'.join(map(str, found))}). Use `FP16MixedPrecision()` on this GPU."
        )


def check_fp64(props: Any) -> None:
    """GradScaler keeps its inf checks in fp64; XPUs without fp64 (Arc A-series) cannot run it."""
    if not getattr(props, "has_fp64", True):
        raise RuntimeError(
            f"`XPUPrecision(dtype='fp16')` needs a loss scaler, and torch's GradScaler needs fp64, which"
            f" {getattr(props, 'name', 'this XPU')!r} does not have. Use `XPUPrecision(dtype='bf16')`: bf16 needs no"
            " scaler."
        )
