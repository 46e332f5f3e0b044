"""The one autocast core every plugin builds on.

It owns what all mixed-precision plugins share: the autocast device (taken from where the model lives, never
guessed from the accelerator, and checked against an explicit ``device``), the explicit dtype, the
``float32_matmul_precision`` of the forward and backward passes, and casting outputs back to the default dtype.
Scaling, fp8 and XPU specifics live in the small modules beside it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from typing_extensions import Self, override

from lightning_precision._core import fsdp
from lightning_precision._core.evaluation import EVAL_AUTOCAST, check_eval_precision, eval_autocast
from lightning_precision._core.plugin_repr import plugin_repr
from lightning_precision._core.probe_pass import in_probe_pass
from lightning_precision._core.process_effects import FABRIC_THROUGHPUT
from lightning_precision._upstream.lightning import convert_fp_tensor

__all__ = ["MatmulPrecision", "AutocastPrecision"]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
_MATMUL_PRECISIONS = ("highest", "high", "medium")
MatmulPrecision = Literal["highest", "high", "medium"]


def _module_device_types(module: Module | None) -> list[str]:
    """The device types the module's parameters and buffers live on, in order of first appearance (meta excluded)."""
    if module is None:
        return []
    seen: dict[str, None] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        seen.setdefault(tensor.device.type, None)
    return [t for t in seen if t != "meta"]


def _validate_device(owner: str, device: str | None) -> None:
    if device is not None and device not in _AUTOCAST_DEVICES:
        raise ValueError(
            f"`{owner}(device={device!r})` is not an autocast device. Use one of {_AUTOCAST_DEVICES}, or leave"
            " `device=None` to autocast for the device the model lives on."
        )


def _validate_reduce_dtype(owner: str, reduce_dtype: Any) -> None:
    # Not fp16: a gradient sum past 65504 becomes inf in the reduce-scatter, and a plugin without a loss scaler
    # would step it into every weight as NaN.
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"`{owner}(reduce_dtype={reduce_dtype!r})`: FSDP2 reduces gradients in torch.float32 (the default: sums of"
            " many ranks keep their precision) or torch.bfloat16 (half the bytes). float16 is refused: a sum past"
            " 65504 overflows to inf."
        )


def _validate_matmul_precision(owner: str, matmul_precision: str | None) -> None:
    if matmul_precision is not None and matmul_precision not in _MATMUL_PRECISIONS:
        raise ValueError(
            f"`{owner}(matmul_precision={matmul_precision!r})` is not a float32 matmul precision. Use one of"
            f" {_MATMUL_PRECISIONS} (see `torch.set_float32_matmul_precision`), or None to leave it as it is."
        )


class AutocastPrecision(FabricPrecision):
    """Fabric base of every autocast plugin: ``torch.autocast(device_type, dtype)`` with both always explicit.

    Subclasses set ``precision`` and pass ``compute_dtype``. The device type is resolved once, from the model, in one
    explicit step (``resolve_device``) after the model has been moved (Fabric and the Trainer both move it after
    ``convert_module``): the Trainer at ``connect``, Fabric at the first forward. That step runs the hardware checks
    and, for a sharded model, FSDP2's checks (one collective); no property read runs either.
    """

    # Whether the forward pass runs under autocast (the true-precision plugins cast the model instead): what an error
    # about the device says.
    autocasts = True
    # What `eval_precision` may name: the precision validation, test and predict run in (`_core/evaluation.py`).
    eval_precisions: tuple[str, ...] = EVAL_AUTOCAST
    # Class defaults too: a plugin made without `__init__` (an old pickle) evaluates as it trains.
    eval_precision: str | None = None
    _eval_depth = 0  # how many `eval_context`s are open: the one attribute the forward's hot path reads
    _eval_thread: int | None = None  # the thread that opened them

    def __init__(
        self,
        compute_dtype: torch.dtype,
        device: str | None = None,
        matmul_precision: MatmulPrecision | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        eval_precision: str | None = None,
    ) -> None:
        owner = type(self).__name__
        _validate_device(owner, device)
        _validate_matmul_precision(owner, matmul_precision)
        _validate_reduce_dtype(owner, reduce_dtype)
        check_eval_precision(owner, eval_precision, self.eval_precisions)
        self.eval_precision = eval_precision
        self._eval_depth = 0
        self.compute_dtype = compute_dtype
        self.device = device
        self.matmul_precision = matmul_precision
        self.reduce_dtype = reduce_dtype
        self._device_type: str | None = None
        self._checked_device: str | None = None
        self._module_ref: weakref.ref | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Here, not in `__init__`: a copy or an unpickled plugin (deepcopy, ddp_spawn's process) is made without
        # `__init__`, and the monitor would take it for fp32 once the original is collected.
        plugin = super().__new__(cls)
        plugin._install_throughput_dtype()
        return plugin

    def _install_throughput_dtype(self) -> None:
        """Teach Lightning's ThroughputMonitor this plugin's ``peak_flops_dtype`` (the Trainer classes add the Trainer's
        monitor): a process-wide effect (``_core/process_effects.py``)."""
        FABRIC_THROUGHPUT.hold(self, AutocastPrecision)

    @property
    def peak_flops_dtype(self) -> torch.dtype:
        """The dtype whose peak FLOPs bound this plugin's matmuls: what Lightning's ThroughputMonitor computes MFU
        against (it sees this instead of taking every plugin it does not know for fp32)."""
        return self.compute_dtype

    @property
    def mp_policy(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` that matches this plugin: parameters all-gathered in the compute dtype,
        gradients reduced in ``reduce_dtype`` (fp32 by default). Pass it to every ``fully_shard`` call:
        ``fully_shard(module, mesh=mesh, mp_policy=plugin.mp_policy)``."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # Inputs are left to autocast, which casts op by op (fp32 where it keeps fp32), as without sharding.
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype,
                                    cast_forward_inputs=False)

    # The questions every plugin answers, so that logging code written for one works with all; answered here for the
    # plugins without a loss scaler, and overridden by the one that has it (FP16MixedPrecision).

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale; ``None``: this plugin does no loss scaling."""
        return None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients had inf/nan: none without a loss scaler."""
        return 0

    def metrics(self) -> dict[str, Tensor]:
        """What the plugin has to log, keyed ``precision/<name>`` (``fabric.log_dict(plugin.metrics(), step)``): here
        nothing (no loss scale is invented where there is none)."""
        return {}

    @property
    def device_type(self) -> str:
        """The device type autocast runs for, as resolved (see ``resolve_device``); before that, where the model lives
        (the explicit ``device`` if given, cpu without a model), unchecked and not remembered. Reads no hardware."""
        if self._device_type is not None:
            return self._device_type
        module = self._module_ref() if self._module_ref is not None else None
        found = _module_device_types(module)
        if self.device is not None:
            return self.device
        if found:
            return next((t for t in found if t != "cpu"), found[0])
        return "meta" if module is not None and next(module.parameters(), None) is not None else "cpu"

    def resolve_device(self) -> str:
        """Resolve the autocast device from where the model lives, once, and check it: the explicit ``device`` must be
        one of those places, the hardware must support the plugin (``_on_device_resolved``), and a model FSDP2 has
        sharded passes ``_on_sharded`` (one collective). Called by the Trainer at ``connect`` and by Fabric's first
        forward; a check that raises leaves nothing remembered, so it is asked again at the next use.
        Before a model with real tensors is known, the explicit ``device`` is checked (once) and nothing is
        remembered."""
        if self._device_type is not None:
            return self._device_type
        module = self._module_ref() if self._module_ref is not None else None
        found = _module_device_types(module)
        if not found:
            # Nothing to look at yet (no model set up, a model without tensors, or one on meta): do not remember.
            if self.device is not None and self._checked_device != self.device:
                self._on_device_resolved(self.device)  # an explicit device is checked right away
                self._checked_device = self.device
            return self.device_type
        if self.device is not None and self.device not in found:
            lives = " and ".join(map(repr, found))
            if not self.autocasts:
                raise ValueError(
                    f"`{type(self).__name__}(device={self.device!r})` names the device the model trains on, but the"
                    f" model lives on {lives}. Move the model to {self.device!r} (the Trainer's or Fabric's"
                    " `accelerator`), or pass the device it lives on (or `device=None`: where it is)."
                )
            raise ValueError(
                f"`{type(self).__name__}(device={self.device!r})` autocasts for {self.device!r}, but the model lives"
                f" on {lives}: autocast would not touch its operations, and it would train"
                f" in fp32 while reporting precision={self.precision!r}. Move the model to {self.device!r} (the"
                f" Trainer's or Fabric's `accelerator`), or pass the device it lives on."
            )
        # Several device types (layers offloaded to the CPU): autocast for the accelerator.
        resolved = self.device or next((t for t in found if t != "cpu"), found[0])
        self._on_device_resolved(resolved)  # may raise (unsupported hardware): then nothing is remembered
        if module is not None and fsdp.is_sharded(module):  # sharded by now: the Trainer resolves at `connect`
            self._on_sharded(module)  # may raise too (a gloo that sums): asked again at the next use
        self._device_type = resolved
        return resolved

    def _on_device_resolved(self, device_type: str) -> None:
        """Hook for subclasses that hold device-bound state (the fp16 scaler) or must check the hardware."""

    def _on_sharded(self, module: Module) -> None:
        """Once, for a model that FSDP2 has sharded, before its first step."""
        fsdp.check_gloo_averages()
        fsdp.check_gather_dtype(type(self).__name__, module, self.compute_dtype)
        self._check_sharded_fp32_eval(module)

    def _check_sharded_fp32_eval(self, module: Module) -> None:
        """FSDP2 all-gathers the weights in its policy's dtype inside the forward, where no autocast widens them back:
        an fp32 evaluation would meet 16-bit weights at its first matmul (a crash at the first validation)."""
        if self.eval_precision != "32-true":
            return
        narrow = sorted({str(dtype).replace("torch.", "") for _, dtype in fsdp.gather_dtypes(module)} - {"float32"})
        if narrow:
            raise ValueError(
                f"`{type(self).__name__}(eval_precision='32-true')`: FSDP2 all-gathers the weights in"
                f" {' and '.join(narrow)} (the `mp_policy`'s `param_dtype`) inside the forward, where they cannot be"
                " widened to fp32. Evaluate in a 16-bit autocast (`eval_precision='bf16-mixed'`) or as the model"
                " trains (`eval_precision=None`), or shard with `MixedPrecisionPolicy(param_dtype=torch.float32)`."
            )

    @override
    def convert_module(self, module: Module) -> Module:
        # Called before the model is moved, so only remember it; the device is read on first use.
        self._module_ref = weakref.ref(module)
        self._device_type = None
        return module

    @contextmanager
    def _matmul_precision_scope(self) -> Generator[None, None, None]:
        # Scoped to the passes this plugin runs, so the process state is restored whatever happens, Fabric included
        # (Fabric never calls `teardown`).
        if self.matmul_precision is None:
            yield
            return
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.matmul_precision)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(previous)

    @contextmanager
    def _backward_scope(self) -> Generator[None, None, None]:
        """Around every backward pass, Trainer and Fabric alike."""
        with self._matmul_precision_scope():
            yield
        if not in_probe_pass():  # a callback's probe backward is no backward of the step
            self._after_backward()

    def _after_backward(self) -> None:
        """Hook for subclasses: runs after each successful backward pass."""

    @override
    def pre_backward(self, tensor: Tensor, module: Module | None) -> Any:
        self._before_backward(tensor)
        return super().pre_backward(tensor, module)

    def _before_backward(self, loss: Tensor) -> None:
        """Hook for subclasses: the loss about to be backpropagated, unscaled (the Trainer's seam calls it too)."""

    def autocast_context_manager(self) -> torch.autocast:
        # No weight cache: before pytorch#165068 (torch < 2.10 or so), a `no_grad` forward inside the autocast region
        # cached casts without grad history, and the next forward's backward failed (Lightning #20644). Lightning makes
        # the same choice; the cache only saves re-casting weights used twice in one forward.
        return torch.autocast(self.resolve_device(), dtype=self.compute_dtype, cache_enabled=False)

    @override
    def forward_context(self) -> Any:
        if self._eval_depth:
            return self._eval_forward_context()
        # Without a matmul precision to scope, the bare autocast: a generator-based scope per pass costs about 7 µs,
        # a measurable share of a small model's step (benchmarks/scaler_cost.py).
        if self.matmul_precision is None:
            return self.autocast_context_manager()
        return self._forward_scope()

    @contextmanager
    def _forward_scope(self) -> Generator[None, None, None]:
        with self._matmul_precision_scope(), self.autocast_context_manager():
            yield

    @contextmanager
    def eval_context(self) -> Generator[None, None, None]:
        """While open, the plugin's forward passes and input conversion run in ``eval_precision`` instead of the
        training precision (nothing changes with ``eval_precision=None``). The Trainer opens it around every validation,
        test and predict step; with Fabric: ``with torch.no_grad(), plugin.eval_context(): out = model(x)``. Re-entrant;
        whatever the model was changed for the evaluation (fp8 layers computing in high precision, a true-precision
        layer's fp32 stand-ins) is put back when the outermost one closes, also after an error."""
        if self.eval_precision is None:
            yield
            return
        self._check_eval_thread()
        with self._evaluation_scope() if not self._eval_depth else contextlib.nullcontext():
            self._eval_thread = threading.get_ident()
            self._eval_depth += 1
            try:
                yield
            finally:
                self._eval_depth -= 1

    def _check_eval_thread(self) -> None:
        # The evaluation changes the model itself (fp8 layers' classes, hooks) until the outermost context closes, in
        # whichever thread opened it: another thread's would end in fp8 or half-restored weights.
        if self._eval_depth and self._eval_thread != threading.get_ident():
            raise RuntimeError(
                f"`{type(self).__name__}.eval_context()` is open in another thread: the evaluation changes the shared"
                " model until that one closes. Evaluate from one thread at a time (or give each thread its own model"
                " and plugin)."
            )

    def _evaluation_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Hook: what the model needs for the whole of an evaluation (the outermost ``eval_context``)."""
        return contextlib.nullcontext()

    def _eval_forward_context(self) -> Any:
        """The forward's context under ``eval_context``."""
        assert self.eval_precision is not None
        return eval_autocast(self.eval_precision, self.resolve_device())

    def _eval_input(self, data: Any) -> Any:
        """The input conversion under ``eval_context`` (the Trainer's loops convert before the step's context)."""
        return data

    def _repr_kept(self) -> dict[str, Any]:
        """Constructor arguments this plugin keeps under another name, for ``repr``."""
        return {}

    def __repr__(self) -> str:
        return plugin_repr(self, self._repr_kept)

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        if self.matmul_precision is None:
            super().backward(tensor, model, *args, **kwargs)
            if not in_probe_pass():
                self._after_backward()
            return
        with self._backward_scope():
            super().backward(tensor, model, *args, **kwargs)

    @override
    def convert_output(self, data: Any) -> Any:
        # Casting a low-precision output up is exact, and code after the model (a loss outside the model, metrics)
        # then runs in full precision as it would without the plugin.
        return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    @override
    def teardown(self) -> None:
        self._module_ref = None
        self._device_type = None

    def __getstate__(self) -> dict[str, Any]:
        # A weak reference cannot be pickled (ddp_spawn pickles the plugin); the module is found again at setup.
        state = self.__dict__.copy()
        state["_module_ref"] = None
        state["_eval_depth"] = 0  # a copy made mid-evaluation starts outside it
        return state
