"""FSDP2 (``torch.distributed.fsdp.fully_shard``), as the plugins meet it: is a model sharded, with which policy.

Public torch is used where it exists (``FSDPModule``, ``MixedPrecisionPolicy``, ``set_custom_all_gather``); the private
names it needs (the policy a module was sharded with, the default all-gather, a DTensor's own local tensor, autograd's
version counter) are in ``_upstream/torch.py`` with their canary. ``Float8ScalePrecompute`` also reads and writes
torchao's ``WeightWithDynamicFloat8CastTensor._precomputed_scale``, where torchao's own
``precompute_float8_dynamic_scale_for_fsdp`` writes it: torch and torchao offer no public way to ask whether a
precomputed scale still fits its weight.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_precision import _imports
from lightning_precision._upstream.torch import (
    byte_all_gather_base,
    dtensor_local_tensor,
    fsdp_mp_policy,
    version_counter,
)

__all__ = [
    "Float8ScalePrecompute",
    "check_gather_dtype",
    "check_gloo_averages",
    "custom_all_gather_supported",
    "install_byte_all_gather",
    "is_sharded",
    "local_shard",
    "process_group_backend",
]


def fsdp_modules(module: nn.Module) -> list[Any]:
    """The modules ``fully_shard`` was applied to (FSDP2 swaps their class to a subclass of ``FSDPModule``)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def is_sharded(module: nn.Module) -> bool:
    return bool(fsdp_modules(module))


def mp_policy_of(fsdp_module: Any) -> Any | None:
    """The ``MixedPrecisionPolicy`` a module was sharded with; None if torch no longer keeps it where we read it."""
    return fsdp_mp_policy(fsdp_module)


def own_floating_dtypes(fsdp_module: Any) -> set[torch.dtype]:
    """The dtypes of the floating parameters this FSDP module manages itself (not those of nested FSDP modules)."""
    nested = {id(p) for m in fsdp_modules(fsdp_module) if m is not fsdp_module for p in m.parameters()}
    return {p.dtype for p in fsdp_module.parameters() if id(p) not in nested and p.is_floating_point()}


def gather_dtypes(module: nn.Module) -> Iterator[tuple[str, torch.dtype]]:
    """``(path, dtype)`` per FSDP module: the dtype its parameters are all-gathered and computed in. That is the
    policy's ``param_dtype``, or the parameters' own dtype without one. Modules that manage no parameter are left
    out."""
    from torch.distributed.fsdp import FSDPModule

    for name, m in module.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        own = own_floating_dtypes(m)
        if not own:
            continue
        policy = mp_policy_of(m)
        param_dtype = getattr(policy, "param_dtype", None)
        yield name or "<root>", param_dtype if param_dtype is not None else max(own, key=lambda d: d.itemsize)


def process_group_backend() -> str | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_backend()
    return None


def custom_all_gather_supported() -> bool:
    """torch >= 2.8 lets a module all-gather with a custom collective (``FSDPModule.set_custom_all_gather``)."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_custom_all_gather")


def byte_all_gather() -> Any:
    """An FSDP2 all-gather that moves 1-byte dtypes (float8) as uint8, for process groups without float8 (gloo)."""
    class _ByteAllGather(byte_all_gather_base()):  # type: ignore[misc]
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            if output_tensor.element_size() == 1 and output_tensor.dtype != torch.uint8:
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return _ByteAllGather()


def install_byte_all_gather(module: nn.Module) -> int:
    """Give every FSDP module of ``module`` the uint8 all-gather; returns how many got it."""
    comm = byte_all_gather()
    modules = fsdp_modules(module)
    for m in modules:
        m.set_custom_all_gather(comm)
    return len(modules)


def check_gather_dtype(owner: str, module: nn.Module, compute_dtype: torch.dtype) -> None:
    """Warn when FSDP2 all-gathers parameters in a dtype other than the plugin's compute dtype: in fp32, autocast
    casts after the all-gather, so communication and the unsharded copies stay fp32 and the plugin saves neither."""
    from lightning_precision._warnings import NoEffectWarning, warn

    off = [(name, dtype) for name, dtype in gather_dtypes(module) if dtype != compute_dtype]
    if not off:
        return
    shown = ", ".join(f"{name} ({str(dtype).replace('torch.', '')})" for name, dtype in off[:4])
    more = f" and {len(off) - 4} more" if len(off) > 4 else ""
    warn(
        f"{owner} computes in {str(compute_dtype).replace('torch.', '')}, but FSDP2 all-gathers the parameters of"
        f" {len(off)} sharded module(s) in another dtype: {shown}{more}. Autocast casts only after the all-gather, so"
        " communication and the unsharded copies do not shrink. Shard with the plugin's policy:"
        " `fully_shard(module, mesh=mesh, mp_policy=plugin.mp_policy)` (Trainer: `plugin ="
        " self.trainer.precision_plugin` in `configure_model`).",
        NoEffectWarning,
    )


def local_shard(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a tensor FSDP2 shards (a ``DTensor``); any other tensor as it is. Counting local shards and
    summing across ranks counts every element of a sharded gradient once."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


_GLOO_AVERAGES: bool | None = None  # asked once per process


def check_gloo_averages() -> None:
    """FSDP2 averages fp32/bf16 gradients with ``ReduceOp.AVG``; gloo in torch 2.7 sums instead, silently, so every
    gradient is world-size times too large (measured: 2x on 2 ranks). One tiny reduce-scatter tells; refuse to train
    on such a process group rather than train with wrong gradients."""
    import torch.distributed as dist

    global _GLOO_AVERAGES
    if process_group_backend() != "gloo":
        return
    world = dist.get_world_size()
    if _GLOO_AVERAGES is None:
        out = torch.zeros(1)
        dist.reduce_scatter_tensor(out, torch.full((world,), float(dist.get_rank() + 1)), op=dist.ReduceOp.AVG)
        _GLOO_AVERAGES = out.item() == (world + 1) / 2
    if not _GLOO_AVERAGES:  # every time it is asked: a caught error must not let the run go on
        raise RuntimeError(
            f"FSDP2 on gloo with torch {torch.__version__}: gloo's reduce-scatter sums where FSDP2 asks it to average,"
            f" so every gradient would be {world} times too large. Use a newer torch for FSDP2 on CPU (2.13 averages"
            " correctly); NCCL on GPUs"
            " is not affected."
        )


class Float8ScalePrecompute:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step: one all-reduce for the scales
    of every fp8 weight instead of one per weight at each all-gather.

    A precomputed scale is only right for the weights it was computed from. When a weight changes any other way (a
    checkpoint loaded in place, an EMA swap), its version counter moves, and the scales are dropped before the next
    forward: torchao then computes them at the all-gather, as without precomputing. A stale scale would saturate or
    flush the new weights silently.
    """

    def __init__(self, module: nn.Module) -> None:
        fsdp_utils = _imports.import_quietly("torchao.float8.fsdp_utils")
        self._precompute = fsdp_utils.precompute_float8_dynamic_scale_for_fsdp
        self._weight_type = fsdp_utils.WeightWithDynamicFloat8CastTensor
        self._module = module
        self._layers = [m for m in module.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
        self._versions: list[int] = []

    def _weights(self) -> list[Any]:
        """The sharded fp8 weights, looked up each time (FSDP2 re-creates its sharded parameters at its lazy init)."""
        from torch.distributed.tensor import DTensor

        return [m.weight for m in self._layers
                if isinstance(m.weight, DTensor) and isinstance(dtensor_local_tensor(m.weight), self._weight_type)]

    def after_optimizer_step(self) -> None:
        weights = self._weights()
        if weights:
            self._precompute(self._module)
            # The parameter's own counter: in-place updates reach the local tensors below autograd, uncounted there.
            self._versions = [version_counter(w) for w in weights]

    def before_forward(self) -> None:
        if not self._versions:
            return
        weights = self._weights()
        if self._versions != [version_counter(w) for w in weights]:
            # The scale lives on the weight's own local tensor (``to_local()`` returns a view), where torchao's
            # precompute puts it.
            for w in weights:
                dtensor_local_tensor(w)._precomputed_scale = None
            self._versions = []
