"""fp32 evaluation of a true-precision model (``eval_precision="32-true"``) without an fp32 copy of its weights: each
layer's 16-bit parameters and buffers are swapped for fp32 copies for its own forward only, and put back after it.

A module may read a child's weight without calling the child (``nn.MultiheadAttention`` reads ``out_proj.weight``,
``nn.TransformerEncoderLayer``'s fast path every weight of its sublayers): no hook of the child runs then, so a
``TorchFunctionMode`` widens any 16-bit tensor still reaching an op, for that op only (a function mode is public torch
API; only the evaluation pays its per-op Python cost)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

__all__ = ["FP32Evaluation"]


def _narrow(tensors: Iterator[tuple[str, Tensor | None]]) -> list[tuple[str, Tensor]]:
    return [(name, t) for name, t in tensors if t is not None and t.is_floating_point() and t.dtype != torch.float32]


# Ops that read no element of their tensors: widening them would copy a weight to learn its shape.
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous", "data_ptr",
    "element_size", "is_floating_point", "is_complex", "get_device", "untyped_storage", "__len__", "__hash__",
    "__repr__", "__format__", "__reduce_ex__", "__deepcopy__", "__setstate__", "requires_grad_", "is_set_to",
})

# Ops that update the running statistics they are given (BatchNorm and InstanceNorm in train mode, as
# `torch.optim.swa_utils.update_bn` runs them under no_grad): computed on widened copies, written back into the model's.
_RUNNING_STATS = frozenset({F.batch_norm, F.instance_norm})


class _WidenReads(TorchFunctionMode):
    """Widens to fp32 every tensor of ``dtype`` an op reads (attributes, the tensor an in-place op writes into and
    ``out=`` excepted: a write lands in the 16-bit original, as without the mode)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def _widen(self, tensor: Tensor) -> Tensor:
        return tensor.float() if tensor.dtype == self.dtype else tensor

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" or name in _METADATA or "out" in kwargs:
            return func(*args, **kwargs)
        if func in _RUNNING_STATS:
            return self._keeping_running_stats(func, args, kwargs)
        # `x.add_(w)`, `x[i] = w`, `x += w`: the written tensor stays itself; what it reads is widened.
        writes = (name.endswith("_") and not name.startswith("__")) or name == "__setitem__" or name.startswith("__i")
        kept, read = (args[:1], args[1:]) if writes else ((), args)
        read = apply_to_collection(read, Tensor, self._widen)
        return func(*kept, *read, **apply_to_collection(kwargs, Tensor, self._widen))

    def _keeping_running_stats(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        bound = inspect.signature(func).bind(*args, **kwargs)
        written = []
        for name in ("running_mean", "running_var"):
            stat = bound.arguments.get(name)
            if isinstance(stat, Tensor) and stat.dtype == self.dtype:
                bound.arguments[name] = wide = stat.float()
                written.append((stat, wide))
        out = func(*apply_to_collection(bound.args, Tensor, self._widen),
                   **apply_to_collection(bound.kwargs, Tensor, self._widen))
        for stat, wide in written:  # unchanged in eval mode: the round trip through fp32 is exact
            stat.copy_(wide)
        return out


class FP32Evaluation:
    """A context: while open, every module of ``root`` with 16-bit parameters of its own computes on fp32 copies of them
    (a forward pre-hook swaps them in, a forward hook puts the originals back, also when the forward raises), so that
    at most the running layers' copies exist at once; and a function mode widens any other 16-bit tensor an op reads
    (a child's weight read directly, a buffer), for that op. Buffers stay in place, so that a forward writing into one
    (a counter, running statistics) writes into the model's. On exit the hooks go and any original still swapped out
    is put back: the model holds the same Parameter objects, values and dtypes as before.

    Parameters that require gradients are refused under grad mode: the copies are no leaves of the model, and a
    backward through them would train nothing (evaluate under ``torch.no_grad()``/``torch.inference_mode()``)."""

    def __init__(self, root: nn.Module, owner: str, dtype: torch.dtype) -> None:
        self.owner = owner
        # Layers kept in fp32 (`keep_fp32`) have nothing 16-bit and get no hooks.
        self.modules = [m for m in root.modules() if _narrow(m.named_parameters(recurse=False, remove_duplicate=False))]
        self._handles: list[RemovableHandle] = []
        self._mode = _WidenReads(dtype)
        self._mode_open = False
        # Per module being run: the originals swapped out, and how deep its forward is (a module called inside itself).
        self._swapped: dict[nn.Module, dict[str, Tensor]] = {}
        self._depth: dict[nn.Module, int] = {}

    def __enter__(self) -> FP32Evaluation:
        try:
            for module in self.modules:
                self._handles.append(module.register_forward_pre_hook(self._widen, prepend=True))
                self._handles.append(module.register_forward_hook(self._put_back, always_call=True))
            self._mode.__enter__()
            self._mode_open = True
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode_open:
            self._mode_open = False
            self._mode.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in list(self._swapped):
            self._restore(module)
        self._depth.clear()

    def _widen(self, module: nn.Module, args: Any) -> None:
        self._depth[module] = self._depth.get(module, 0) + 1
        if module in self._swapped:  # called inside its own forward: its copies are in place already
            return
        params = _narrow(module.named_parameters(recurse=False, remove_duplicate=False))
        if torch.is_grad_enabled() and any(p.requires_grad for _, p in params):
            self._depth[module] -= 1
            raise RuntimeError(
                f"`{self.owner}(eval_precision='32-true')` evaluates on fp32 copies of the 16-bit weights, which a"
                " backward would not train. Evaluate under `torch.no_grad()` or `torch.inference_mode()` (the"
                " Trainer's validate/test/predict do), e.g. `with torch.no_grad(), plugin.eval_context(): ...`."
            )
        self._swapped[module] = dict(params)
        for name, p in params:
            setattr(module, name, nn.Parameter(p.float(), requires_grad=False))

    def _put_back(self, module: nn.Module, args: Any, output: Any) -> None:
        depth = self._depth.get(module, 0) - 1
        self._depth[module] = max(depth, 0)
        if depth <= 0 and module in self._swapped:
            self._restore(module)

    def _restore(self, module: nn.Module) -> None:
        for name, value in self._swapped.pop(module).items():
            setattr(module, name, value)
