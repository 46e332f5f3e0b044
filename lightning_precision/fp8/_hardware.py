"""Whether this machine runs fp8 (and MXFP8, NVFP4) GEMMs for real: CUDA compute capability, checked before training."""

from __future__ import annotations

import torch

from lightning_precision.fp8._selection import BLOCK_SCALED, TE_NVFP4

__all__ = ["FP8_MIN_CAPABILITY", "MXFP8_MIN_CAPABILITY", "check_fp8_hardware", "fp8_capable", "fp8_gpu_available",
           "required_capability"]

# fp8 tensor cores: Ada and Hopper (8.9, 9.0); MXFP8 and NVFP4 block scaling: Blackwell (10.0).
FP8_MIN_CAPABILITY = (8, 9)
MXFP8_MIN_CAPABILITY = (10, 0)


def fp8_capable(capability: tuple[int, int]) -> bool:
    return capability >= FP8_MIN_CAPABILITY


def fp8_gpu_available() -> bool:
    """A CUDA device that runs fp8 GEMMs for real."""
    return torch.cuda.is_available() and fp8_capable(torch.cuda.get_device_capability())


def required_capability(scaling_family: str) -> tuple[int, int]:
    """The CUDA compute capability a scaling family's GEMMs need: block-scaled (MXFP8, NVFP4) Blackwell's, the rest
    fp8's."""
    return MXFP8_MIN_CAPABILITY if scaling_family in BLOCK_SCALED else FP8_MIN_CAPABILITY


def check_fp8_hardware(device_type: str, backend: str, scaling_family: str, emulate: bool,
                       owner: str = "FP8Precision") -> None:
    """fp8 GEMMs need CUDA compute capability >= 8.9 (Ada, Hopper), MXFP8 and NVFP4 >= 10.0 (Blackwell);
    ``emulate=True`` (torchao only) runs the same numerics anywhere."""
    if emulate:
        if backend != "torchao":
            raise ValueError(
                "`FP8Precision(backend='transformer_engine', emulate=True)`: Transformer Engine has no emulation."
                " Use `backend='torchao'` to emulate fp8 numerics without an fp8 GPU."
            )
        return
    need = required_capability(scaling_family)
    if device_type != "cuda":
        emulation = " Pass `emulate=True` (torchao backend) to run the fp8 numerics emulated here." \
            if scaling_family != TE_NVFP4 else " NVFP4 has no emulation here: measure what it would lose with" \
            " `GradientUnderflowMonitor(formats=('nvfp4',))` on a bf16 run."
        raise RuntimeError(
            f"{owner} ({scaling_family}) needs a CUDA GPU with compute capability >= {need[0]}.{need[1]}; the model is"
            f" on {device_type!r}.{emulation}"
        )
    found = torch.cuda.get_device_capability()
    if found < need:
        raise RuntimeError(
            f"{owner} ({scaling_family}) needs CUDA compute capability >= {need[0]}.{need[1]}, found"
            f" {torch.cuda.get_device_name()!r} with {found[0]}.{found[1]}. Use `BF16MixedPrecision()` on this GPU,"
            " or `FP8Precision(emulate=True)` to check fp8 numerics (slowly)."
        )

