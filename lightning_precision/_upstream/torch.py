"""Every private torch name the package uses, each with the reason no public route serves.

``tests/test_upstream_torch.py`` exercises what we rely on against the installed torch, so that an upstream change
fails loudly there, not deep inside a sharded run or as a wrong loss scale.

Besides the functions below, ``fabric/_scaler.py``'s ``TrackingGradScaler`` subclasses ``torch.amp.GradScaler`` and
reads and writes its base's own state: ``_per_optimizer_states`` (each optimizer's stage and ``found_inf_per_device``),
``_scale``, ``_growth_tracker``, ``_init_scale``, ``_init_growth_tracker`` and ``_enabled`` (stable since torch 1.6).
A subclass's use of its base's state cannot move here; the canary pins each of them by behaviour.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch

__all__ = [
    "byte_all_gather_base",
    "dtensor_local_tensor",
    "fsdp_mp_policy",
    "grad_scaler_scale",
    "inside_compiled_call",
    "non_finite_check_and_unscale_",
    "optimizer_step_hooks",
    "sparse_values",
    "version_counter",
    "xpu_is_compiled",
]


def fsdp_mp_policy(fsdp_module: Any) -> Any | None:
    """The ``MixedPrecisionPolicy`` a module was sharded with (``_get_fsdp_state()._mp_policy``); None if torch no
    longer keeps it there. torch has no getter, and the plugins must tell a model that all-gathers in fp32 from one
    that all-gathers in the compute dtype before the first step, not after it."""
    return getattr(fsdp_module._get_fsdp_state(), "_mp_policy", None)


def byte_all_gather_base() -> type:
    """FSDP2's ``DefaultAllGather``, the base of a custom all-gather that behaves as the default one. The public
    ``AllGather`` is only the protocol: the default collective and its ``allocate`` are private. Needed because gloo
    has no float8 dtype, so fp8 all-gathers (torchao's) on CPU move the bytes viewed as uint8."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    return DefaultAllGather


def dtensor_local_tensor(tensor: Any) -> Any:
    """A DTensor's own local tensor (``_local_tensor``), the object torchao keeps a precomputed fp8 scale on:
    ``to_local()`` returns a new view each call, on which an attribute set would be lost."""
    return tensor._local_tensor


def version_counter(tensor: torch.Tensor) -> int:
    """Autograd's in-place counter of a tensor (``_version``): the only sign that a weight changed in place (a
    checkpoint loaded, an EMA swap) without comparing its values."""
    return tensor._version


def non_finite_check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """torch's fused check-and-unscale kernel (``torch._amp_foreach_non_finite_check_and_unscale_``), the op
    ``GradScaler.unscale_`` runs: one launch per (device, dtype) group sets ``found_inf`` where a gradient holds inf
    or nan. No public function checks a list of tensors for non-finite values without a host read."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> tuple[list[dict[int, Any]], list[dict[int, Any]]]:
    """The step hooks torch's step wrapper runs around ``optimizer.step()``, in its order: pre-hooks (the global ones,
    then the optimizer's), post-hooks (the optimizer's, then the global ones), each a dict of handle id to hook
    (``_global_optimizer_pre_hooks``, ``_optimizer_step_pre_hooks``, ...). The true-precision step calls the
    optimizer's step once a chunk, on stand-ins of the weights, and runs these hooks once around the whole step
    instead: torch has no public way to step an optimizer without its hooks, or to hold them."""
    from torch.optim import optimizer as module

    pre = [module._global_optimizer_pre_hooks, optimizer._optimizer_step_pre_hooks]
    post = [optimizer._optimizer_step_post_hooks, module._global_optimizer_post_hooks]
    return pre, post


def sparse_values(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse COO gradient, coalesced or not (``_values()``): the public ``values()`` refuses
    an uncoalesced tensor, and coalescing a gradient to check it would cost a copy."""
    return grad._values()


def grad_scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The current scale of any ``GradScaler`` (ours or Lightning's) as a tensor on its device, without synchronising:
    the public ``get_scale()`` reads the host, so this reads ``_scale`` (``_init_scale`` before the first step)."""
    if scaler._scale is None:
        return torch.tensor(float(scaler._init_scale))
    return scaler._scale.detach().clone()


def xpu_is_compiled() -> bool:
    """Whether this torch was built with XPU support (``torch.xpu._is_compiled``): ``is_available()`` is also false
    when the build has it but no device is visible, and the error must say which of the two to fix."""
    return bool(torch.xpu._is_compiled())


# The function dynamo wraps a compiled function or module in (``torch/_dynamo/eval_frame.py``): ``compile_wrapper``
# from torch 2.9 or so, ``_fn`` before. Under the ``force_eager`` stance it calls the original eagerly.
_COMPILE_WRAPPERS = ("compile_wrapper", "_fn")


def inside_compiled_call() -> bool:
    """Whether a caller up the stack is a ``torch.compile``d function or module, also when it runs eagerly (the
    ``force_eager`` stance): ``torch.compiler.is_compiling()`` answers only while dynamo traces. A look at the frames
    for dynamo's wrapper, no device work."""
    wrapper = getattr(sys.modules.get("torch._dynamo.eval_frame"), "__file__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _COMPILE_WRAPPERS and frame.f_code.co_filename == wrapper:
            return True
        frame = frame.f_back
    return False
