"""Every private torch name the package uses, each with the reason no public route serves.

``tests/upstream/test_upstream_torch.py`` exercises what we rely on against the installed torch, so that an upstream
change fails loudly there, not deep inside a sharded run or as a wrong loss scale.

Besides the functions below, ``_core/scaling/scaler.py``'s ``TrackingGradScaler`` subclasses ``torch.amp.GradScaler``
and reads and writes its base's own state: ``_per_optimizer_states`` (each optimizer's stage and
``found_inf_per_device``), ``_scale``, ``_growth_tracker``, ``_init_scale``, ``_init_growth_tracker`` and ``_enabled``
(stable since torch 1.6), and overrides one private method, ``_unscale_grads_(optimizer, inv_scale, found_inf,
allow_fp16)``: the one place torch's scaler checks gradients (its ``unscale_``, and the check before a fused optimizer's
step), which hands bf16 gradients to a kernel that refuses them on CUDA (pytorch#127176). A subclass's use of its base
cannot move here; the canary pins each of them by behaviour.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CUDA_KERNEL_DTYPES",
    "FUSED_CHECK_DTYPES",
    "DispatchCounter",
    "byte_all_gather_base",
    "dtensor_local_tensor",
    "foreach_copy_",
    "foreach_mul",
    "foreach_mul_",
    "foreach_norm",
    "fsdp_mp_policy",
    "grad_scaler_scale",
    "inside_compiled_call",
    "non_finite_check_and_unscale_",
    "optimizer_step_hooks",
    "sparse_values",
    "version_counter",
    "xpu_is_compiled",
]


# The dtypes the CUDA kernels of the private ops on the gradients' path take, per positional tensor argument (each
# tensor of a list argument; other arguments unchecked). aten/src/ATen/native/cuda/AmpKernels.cu: gradients in fp16,
# fp32 or fp64 (AT_DISPATCH_FLOATING_TYPES_AND_HALF), scale and flags in fp32, the growth tracker in int32;
# ForeachReduceOp.cu: the norm of fp16, bf16, fp32 or fp64 tensors. Their CPU kernels can take more (bf16 gradients in
# the check), so a CPU run cannot show a call that every CUDA run refuses (pytorch#127176): the package calls them with
# these dtypes only, the CPU suite makes them refuse the rest (tests/cuda_kernels.py), and the cuda tier checks this
# table against the real kernels on a GPU.
CUDA_KERNEL_DTYPES: dict[str, tuple[tuple[torch.dtype, ...], ...]] = {
    "_amp_foreach_non_finite_check_and_unscale_": (
        (torch.float16, torch.float32, torch.float64), (torch.float32,), (torch.float32,)),
    "_amp_update_scale_": ((torch.float32,), (torch.int32,), (torch.float32,)),
    "_foreach_norm": ((torch.float16, torch.bfloat16, torch.float32, torch.float64),),
}


class DispatchCounter(TorchDispatchMode):
    """The aten ops dispatched while active, by name (``aten.mm.default``, ...), and the devices of the tensors read on
    the host (``aten._local_scalar_dense``: ``item``, ``float``, ``bool`` of a tensor). torch's ``TorchDispatchMode``
    is the only way to see every op a step runs, on any device: on a GPU each is at least one kernel launch, and a read
    of a GPU tensor a synchronisation. Counting costs Python time per op: count an untimed step."""

    HOST_READ = "aten._local_scalar_dense.default"

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.read_devices: list[str] = []
        self._tolist: Any = None
        self._own_attribute = False

    # ``Tensor.tolist()`` reads every value on the host in one go (the package's one read of a logging step's metrics)
    # but dispatches no aten op on a CPU tensor: while counting it is wrapped, and each call is one read of its device
    # (once, though a subclass's ``__torch_function__`` calls it again inside).
    def __enter__(self) -> DispatchCounter:
        tolist = self._tolist = torch.Tensor.tolist
        self._own_attribute = "tolist" not in torch.Tensor.__dict__  # inherited from TensorBase: deleted on exit
        counter, inside = self, [False]

        def counted(tensor: torch.Tensor) -> Any:
            if inside[0]:
                return tolist(tensor)
            counter.names.append(self.HOST_READ)
            counter.read_devices.append(tensor.device.type)
            inside[0] = True
            try:
                return tolist(tensor)
            finally:
                inside[0] = False

        torch.Tensor.tolist = counted  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._tolist is None:
            return
        if self._own_attribute:
            del torch.Tensor.tolist  # back to TensorBase's, as before
        else:
            torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        self._tolist = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        self.names.append(name)
        if name == self.HOST_READ:
            self.read_devices.append(args[0].device.type)
        return func(*args, **(kwargs or {}))

    @property
    def host_reads(self) -> int:
        return len(self.read_devices)

    def reads_on(self, device_type: str) -> int:
        """Host reads of tensors on ``device_type`` ("cuda": the synchronising ones; torch's optimizers read their step
        counts, which live on the CPU)."""
        return self.read_devices.count(device_type)


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


# The gradients torch's fused check takes on every device: those its CUDA kernel takes.
FUSED_CHECK_DTYPES = CUDA_KERNEL_DTYPES["_amp_foreach_non_finite_check_and_unscale_"][0]


# An fp32 factor of 1 per device: the fused kernel's factor where it only checks.
_ONES: dict[torch.device, torch.Tensor] = {}


def non_finite_check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor,
                                  inv_scale: torch.Tensor | None) -> None:
    """Set ``found_inf`` (fp32, one element, on the gradients' device) to 1 where a gradient of ``grads`` (one device,
    one dtype) holds inf or nan, and multiply them by ``inv_scale`` (fp32, one element; None: check only). No host
    read, and any floating dtype on any device.

    fp16, fp32 and fp64 go through torch's fused check-and-unscale kernel
    (``torch._amp_foreach_non_finite_check_and_unscale_``, the op ``GradScaler.unscale_`` runs: one launch per group);
    no public function checks a list of tensors without a host read. Other dtypes (bf16), which its CUDA kernel
    refuses, go through one ``torch._foreach_norm`` of order inf (the largest magnitude of each tensor: inf or nan
    exactly when one of its values is; NaN propagates in its CUDA and CPU kernels), grouped as torch's
    ``get_total_norm`` groups, then ``torch._foreach_mul_``: a fixed number of ops per group, whatever its size."""
    if grads[0].dtype in FUSED_CHECK_DTYPES:
        if inv_scale is None:
            device = found_inf.device
            inv_scale = _ONES.get(device)
            if inv_scale is None:
                inv_scale = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)  # times 1 is exact
        return
    sharded = _dtensor_class()
    if sharded is not None and not isinstance(grads[0], sharded):
        sharded = None
    # A sharded (DTensor) group is checked on this rank's shards, then its flag reduced over the mesh, as torch's
    # DTensor rule for the fused kernel does: every rank joins that reduction, also one whose shards are all empty.
    local = [dtensor_local_tensor(g) for g in grads] if sharded is not None else grads
    nonempty = [g for g in local if g.numel()]  # an empty tensor has no largest value (and nothing to check)
    flag: torch.Tensor | None = None
    # Outside autocast: a step taken inside the forward's region (manual optimization, a Fabric step under
    # `fabric.autocast()`) would send bf16 norms through fp16 autocast's `stack`, which refuses them.
    with torch.autocast(found_inf.device.type, enabled=False):
        if nonempty:
            largest = torch.stack(torch._foreach_norm(nonempty, float("inf"))).amax()
            flag = largest.mul(0).ne(0)  # inf * 0 and nan * 0 are nan, any finite value * 0 is 0
        if sharded is not None:
            flag = _on_any_rank(flag if flag is not None else found_inf.new_zeros((), dtype=torch.bool), grads[0])
        if flag is not None:
            found_inf.logical_or_(flag)
        if inv_scale is not None:
            torch._foreach_mul_(local, inv_scale)


def _dtensor_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _on_any_rank(flag: torch.Tensor, like: Any) -> torch.Tensor:
    """Whether ``flag`` is set on any rank of the mesh ``like`` (a DTensor) is sharded over (its replicated dims
    excepted), read as a max over the shards' flags: one all-reduce."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    placements = [p if isinstance(p, Replicate) else Partial("max") for p in like.placements]
    return DTensor.from_local(flag.float(), like.device_mesh, placements, run_check=False).full_tensor()


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


# torch's list ops (`torch._foreach_*`): the true-precision step's one op per list of tensors (on a GPU one launch, or a
# few, for any number of parameters), which torch's own optimizers are built on; torch has no public name for them.
# Looked up on `torch` at each call (the CPU suite wraps `_foreach_norm` to refuse what its CUDA kernel refuses).


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i, converting the dtype (CUDA's kernel does it in one launch when
    every source shares a dtype, every target another, and sizes and strides match)."""
    torch._foreach_copy_(targets, sources)


def foreach_mul(tensors: list[torch.Tensor], factor: float) -> list[torch.Tensor]:
    """New tensors ``t * factor`` (``factor=1``: copies that keep every bit, -0.0 and NaN included)."""
    return list(torch._foreach_mul(tensors, factor))


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """``t.mul_(factor)`` for every tensor, ``factor`` a 0-dim tensor on their device."""
    torch._foreach_mul_(tensors, factor)


def foreach_norm(tensors: list[torch.Tensor], ord: float, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each tensor's ``ord``-norm (``inf``: its largest magnitude), accumulated and returned in ``dtype`` when given (an
    fp16 gradient's norm at a loss scale overflows fp16)."""
    if dtype is None:
        return list(torch._foreach_norm(tensors, ord))
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))
