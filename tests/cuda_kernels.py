"""The private AMP ops refuse, on the CPU, what their CUDA kernels refuse.

Their CPU kernels take more than their CUDA kernels (``torch._amp_foreach_non_finite_check_and_unscale_`` takes bf16
gradients on the CPU, and raises ``NotImplementedError`` for them on CUDA): a CPU run alone would never show a call
that crashes every CUDA run. ``conftest.py`` wraps the ops for every test, and the multi-process workers wrap them
for their ranks; what CUDA takes is the package's own table (``_upstream.torch.CUDA_KERNEL_DTYPES``), which the
``cuda`` tier checks against the real kernels on a GPU (``tests/gpu/test_cuda.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lightning_precision._upstream.torch import CUDA_KERNEL_DTYPES

__all__ = ["cuda_refusal", "refusing_what_cuda_refuses"]

_NAMES = {torch.float16: "Half", torch.float32: "Float", torch.float64: "Double", torch.bfloat16: "BFloat16",
          torch.int32: "Int", torch.int64: "Long"}


def cuda_refusal(op: str, args: Sequence[Any]) -> str | None:
    """What the CUDA kernel of ``op`` would say of these arguments (None: it takes them): each positional argument
    (each tensor of a list) in a dtype the kernel is built for."""
    for i, (arg, allowed) in enumerate(zip(args, CUDA_KERNEL_DTYPES[op], strict=False)):
        for tensor in arg if isinstance(arg, (list, tuple)) else [arg]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype not in allowed:
                name = _NAMES.get(tensor.dtype, str(tensor.dtype))
                if i == 0:  # the kernel's dispatch on its first (tensor or list) argument
                    return f'"{op}cuda" not implemented for {name!r}'  # CUDA's own words
                return f"{op}: argument {i} must be a {' or '.join(_NAMES[d] for d in allowed)} tensor, got {name}"
    return None


def _refusing(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        refusal = cuda_refusal(op, args)
        if refusal is not None:
            raise NotImplementedError(refusal)
        return original(*args, **kwargs)

    call.refuses_like_cuda = True  # type: ignore[attr-defined]
    return call


@contextlib.contextmanager
def refusing_what_cuda_refuses() -> Iterator[None]:
    """Every op of ``CUDA_KERNEL_DTYPES`` replaced on ``torch`` (where torch's ``GradScaler`` and the package look it
    up at each call) by one that raises as its CUDA kernel would, then calls the real one."""
    originals = {op: getattr(torch, op) for op in CUDA_KERNEL_DTYPES}
    try:
        for op, original in originals.items():
            setattr(torch, op, _refusing(op, original))
        yield
    finally:
        for op, original in originals.items():
            setattr(torch, op, original)
