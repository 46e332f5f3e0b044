"""The private and prototype names of torchao this package uses, each imported on first use (torchao is optional).

Each has no public route in torchao 0.18: MXFP8 training lives under ``torchao.prototype``, its kernel choice in the
private ``torchao.quantization.quantize_`` package, and ``MXFP8Linear.forward`` passes ``self.weight`` as it is, so an
autocast-aware forward calls its matmul function directly. ``tests/upstream/test_upstream_torchao.py`` exercises each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_precision import _imports

__all__ = ["FLOAT8_EPS", "float8_dynamic_cast", "kernel_preference", "mxfp8_linear_module", "mxfp8_scaled_mm",
           "rceil_scale_mode"]

# torchao clamps amax to this before dividing (``torchao.float8.float8_utils.EPS``, not exported): a tensor whose amax
# is below it gets a capped scale, and its values may flush to zero. Copied (torchao is optional); the canary compares.
FLOAT8_EPS = 1e-12


def mxfp8_linear_module() -> Any:
    """``torchao.prototype.moe_training.mxfp8_linear``: the module of ``MXFP8Linear`` (prototype: the only MXFP8
    training layer torchao has)."""
    return _imports.import_quietly("torchao.prototype.moe_training.mxfp8_linear")


def mxfp8_scaled_mm() -> Callable[..., Any]:
    """``_to_mxfp8_then_scaled_mm``: what ``MXFP8Linear.forward`` calls with ``self.weight`` as it is; called by our
    layer with the weight in the input's dtype (an fp32 weight beside a bf16 input fails inside torchao). Resolved once
    per layer class: an import inside a compiled forward breaks its graph at every call."""
    return mxfp8_linear_module()._to_mxfp8_then_scaled_mm


def kernel_preference(emulated: bool) -> Any:
    """``KernelPreference.EMULATED`` (torch ops, any device) or ``.AUTO``, from the private ``quantize_`` package."""
    kernels = _imports.import_quietly("torchao.quantization.quantize_.common").KernelPreference
    return kernels.EMULATED if emulated else kernels.AUTO


def rceil_scale_mode() -> Any:
    """``ScaleCalculationMode.RCEIL``: the e8m0 block scale rounded up, as MXFP8 training takes it (prototype)."""
    return _imports.import_quietly("torchao.prototype.mx_formats.config").ScaleCalculationMode.RCEIL


def float8_dynamic_cast() -> tuple[Callable[..., Any], Callable[..., Any], Any]:
    """``(hp_tensor_to_float8_dynamic, get_maybe_axiswise_dim, GemmInputRole)``: the casts ``Float8Linear``'s backward
    makes (``matmul_with_hp_or_float8_args.backward``), which the sensitivity probe runs for the input gradient alone
    (torchao has no public route to half of that backward). ``GemmInputRole`` lives in ``float8_training_tensor``, in
    ``float8_tensor`` before (torchao 0.11)."""
    scaling = _imports.import_quietly("torchao.float8.float8_scaling_utils")
    try:
        tensors = _imports.import_quietly("torchao.float8.float8_training_tensor")
    except ModuleNotFoundError:
        tensors = _imports.import_quietly("torchao.float8.float8_tensor")
    return scaling.hp_tensor_to_float8_dynamic, scaling.get_maybe_axiswise_dim, tensors.GemmInputRole
