"""The core of the true-precision plugins: weights, gradients and activations in bf16/fp16, the user's optimizer
stepped in fp32 (``step``), every step checked for inf/nan before it is taken.

No autocast: the model is cast to the 16-bit dtype (the layers of ``keep_fp32`` excepted), floating inputs are cast to
it, and new tensors default to it inside the forward pass, as Lightning's ``bf16-true``/``16-true`` do. What differs is
the optimizer step: Lightning's runs the optimizer in the weights' dtype, where an update under half an ulp is lost
(bf16) or Adam's second moment flushes and the update divides by zero (fp16).
"""

from __future__ import annotations

import functools
import numbers
import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision import _imports
from lightning_precision._checks import is_positive_int
from lightning_precision._core import fsdp
from lightning_precision._core.evaluation import EVAL_TRUE
from lightning_precision._core.process_effects import STATE_INIT_HOOK
from lightning_precision._core.scaled import ScaledPrecision
from lightning_precision._core.scaling.scaler import InStepScaler, ScalerConfig
from lightning_precision._core.scaling.step_policy import GuardedStep, closure_driven
from lightning_precision._core.true.fp32_eval import FP32Evaluation
from lightning_precision._core.true.rounding import UPDATES
from lightning_precision._core.true.step import OPTIMIZER_STATES, ClipRequest, TrueStep, is_stepping
from lightning_precision._upstream.lightning import convert_fp_tensor
from lightning_precision._upstream.torch import foreach_mul, foreach_mul_, version_counter

__all__ = ["DEFAULT_STEP_CHUNK", "DEFAULT_UPDATE", "TruePrecision"]

# Measured on the 64x64 regression of docs/true_precision.md: "stochastic" tracks fp32 with 16-bit optimizer states
# (8 bytes a parameter with Adam, half of bf16-mixed's 16); "compensated" tracks it as closely but adds 2 bytes.
DEFAULT_UPDATE = "stochastic"
# Elements widened to fp32 at once in the optimizer step: bounds the step's transient memory (about 16 bytes an
# element with Adam: weight, gradient and two states in fp32) at 256 MiB, whatever the model's size.
DEFAULT_STEP_CHUNK = 2**24


@contextmanager
def default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _to_fp32(data: Any) -> Any:
    return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor, dst_type=torch.float32)


class _KeepFP32:
    """Forward hooks of a layer kept in fp32: its floating inputs widened, its outputs back in the compute dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def before(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return _to_fp32(args), _to_fp32(kwargs)

    def after(self, _: nn.Module, __: Any, output: Any) -> Any:
        return apply_to_collection(output, function=convert_fp_tensor, dtype=Tensor, dst_type=self.dtype)


class TruePrecision(ScaledPrecision):
    """Fabric base of ``BF16TruePrecision`` and ``FP16TruePrecision``; see those for the arguments."""

    scaler_class = InStepScaler
    autocasts = False
    reads_encoded_states = True
    clips_in_step = True
    eval_precisions = EVAL_TRUE

    def __init__(
        self,
        compute_dtype: torch.dtype,
        *,
        update: str,
        optimizer_states: str,
        keep_fp32: tuple[type[nn.Module], ...],
        seed: int,
        step_chunk: int,
        scaler: ScalerConfig | None,
        skip_schedulers_on_overflow: bool,
        device: str | None,
        max_consecutive_skips: int | None,
        eval_precision: str | None = None,
    ) -> None:
        owner = type(self).__name__
        if update not in UPDATES:
            raise ValueError(f"`{owner}(update={update!r})`: choose one of {UPDATES} (default"
                             f" {DEFAULT_UPDATE!r}).")
        if optimizer_states not in OPTIMIZER_STATES:
            raise ValueError(f"`{owner}(optimizer_states={optimizer_states!r})`: choose one of {OPTIMIZER_STATES}:"
                             " 'weight' keeps them in the weights' dtype (the default), 'float32' in fp32, '8bit' in"
                             " torchao's 8-bit optimizer states.")
        if optimizer_states == "8bit":
            _imports.require(_imports.TORCHAO_AVAILABLE, "torchao", f"`{owner}(optimizer_states='8bit')`")
        if not isinstance(keep_fp32, tuple) or not all(isinstance(t, type) and issubclass(t, nn.Module)
                                                        for t in keep_fp32):
            raise ValueError(f"`{owner}(keep_fp32={keep_fp32!r})`: pass a tuple of module classes, e.g."
                             " `(torch.nn.LayerNorm,)`, or `()` to keep every layer in the 16-bit dtype.")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"`{owner}(seed={seed!r})`: pass an int >= 0 (it seeds the stochastic rounding).")
        if not is_positive_int(step_chunk):
            raise ValueError(f"`{owner}(step_chunk={step_chunk!r})`: pass a positive int (elements widened to fp32"
                             f" at once in the optimizer step), e.g. {DEFAULT_STEP_CHUNK} (the default).")
        super().__init__(compute_dtype, scaler, skip_schedulers_on_overflow, device, None, torch.float32,
                         skip_nonfinite=True, max_consecutive_skips=max_consecutive_skips,
                         eval_precision=eval_precision)
        self.update: str = update
        self.optimizer_states: str = optimizer_states
        self.keep_fp32: tuple[type[nn.Module], ...] = keep_fp32
        self.seed = int(seed)
        self.step_chunk = step_chunk
        # The fp32 step, where the weights are rounded: GradientUnderflowMonitor hangs its meter on it.
        self.true_step: TrueStep = TrueStep(compute_dtype, update, optimizer_states, self.seed, step_chunk)
        self._clips: dict[int, ClipRequest] = {}
        # Per optimizer, the scaled gradients kept while the hooks see them unscaled, and what they were shown
        # (``unscale_for_hooks``).
        self._shown: dict[int, tuple[dict[Tensor, Tensor], dict[Tensor, tuple[Tensor, int]]]] = {}
        self._kept: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._keep_hooks: _KeepFP32 = _KeepFP32(compute_dtype)  # every kept layer's: fp32 evaluation retargets it

    # --- the model ------------------------------------------------------------------------------------------------

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        module.to(dtype=self.compute_dtype)
        STATE_INIT_HOOK.hold(self)  # a process-wide effect (`_core/process_effects.py`), until `teardown`
        if self.keep_fp32:
            hooks = self._keep_hooks
            for layer in module.modules():
                if isinstance(layer, self.keep_fp32):
                    layer.float()
                    if layer not in self._kept:
                        self._kept.add(layer)
                        layer.register_forward_pre_hook(hooks.before, with_kwargs=True)
                        layer.register_forward_hook(hooks.after)
        return module

    @override
    def tensor_init_context(self) -> Any:
        return default_dtype(self.compute_dtype)

    @override
    def module_init_context(self) -> Any:
        return default_dtype(self.compute_dtype)

    @override
    def forward_context(self) -> Any:
        if self._eval_depth:
            return self._eval_forward_context()
        # Resolved at the first forward (as the autocast plugins resolve in their autocast): Fabric's one moment
        # after the model is set up, sharded and moved; the Trainer resolves at `connect`, before it.
        self.resolve_device()
        return default_dtype(self.compute_dtype)

    @override
    def convert_input(self, data: Any) -> Any:
        if self._eval_depth:
            return _to_fp32(data)
        return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype)

    # --- evaluation in fp32 (`eval_precision="32-true"`) ------------------------------------------------------------

    @override
    def _eval_forward_context(self) -> Any:
        self.resolve_device()
        return default_dtype(torch.float32)

    @override
    def _eval_input(self, data: Any) -> Any:
        return _to_fp32(data)  # an fp32 batch is not rounded to 16 bits first

    @override
    @contextmanager
    def _evaluation_scope(self) -> Generator[None, None, None]:
        module = self._module_ref() if self._module_ref is not None else None
        owner = type(self).__name__
        if module is None:
            raise RuntimeError(f"`{owner}.eval_context()`: no model is set up yet. Set it up first"
                               " (`fabric.setup(model)`), then evaluate inside the context.")
        if fsdp.is_sharded(module):
            self._refuse_sharded_fp32_eval()
        self._keep_hooks.dtype = torch.float32  # a kept layer's output stays fp32 too
        try:
            with FP32Evaluation(module, owner, self.compute_dtype):
                yield
        finally:
            self._keep_hooks.dtype = self.compute_dtype

    def _refuse_sharded_fp32_eval(self) -> None:
        raise ValueError(
            f"`{type(self).__name__}(eval_precision='32-true')` widens each layer's weights to fp32 for its forward,"
            " which FSDP2's sharded parameters do not allow (they are gathered inside the forward). Evaluate as the"
            " model trains: `eval_precision=None`."
        )

    @property
    @override
    def mp_policy(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` of true precision: parameters stay in their (16-bit) dtype, sharded and
        all-gathered so; gradients reduced in it too. ``fully_shard(module, mesh=mesh, mp_policy=plugin.mp_policy)``,
        or no policy at all: the same."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, cast_forward_inputs=False)

    @override
    def _on_sharded(self, module: nn.Module) -> None:
        if self.eval_precision == "32-true":  # before training, not at the first validation
            self._refuse_sharded_fp32_eval()
        fsdp.check_gloo_averages()
        if self.keep_fp32:
            self._check_kept_layers_sharded_apart(module)

    def _check_kept_layers_sharded_apart(self, module: nn.Module) -> None:
        """FSDP2 refuses, at the first forward, a sharded module whose own trainable parameters mix dtypes ("FSDP
        expects uniform original parameter dtype"): a layer kept in fp32 must be sharded apart from 16-bit ones."""
        mixed = []
        sharded = {id(m) for m in fsdp.fsdp_modules(module)}
        for name, m in module.named_modules():
            if id(m) not in sharded:
                continue
            nested = {id(p) for sub in fsdp.fsdp_modules(m) if sub is not m for p in sub.parameters()}
            # torch checks the trainable parameters only: a frozen one may have any dtype
            if len({p.dtype for p in m.parameters() if id(p) not in nested and p.requires_grad}) > 1:
                mixed.append(name or "<root>")
        if not mixed:
            return
        owner, dtype = type(self).__name__, str(self.compute_dtype).replace("torch.", "")
        kept = ", ".join(t.__name__ for t in self.keep_fp32)
        raise ValueError(
            f"`{owner}(keep_fp32=({kept},))` keeps those layers in fp32, but FSDP2 shards {len(mixed)} module(s)"
            f" whose own parameters mix fp32 and {dtype}: {', '.join(mixed[:4])}. FSDP2 refuses that at the first"
            " forward. Apply `fully_shard` to each kept layer on its own before the module that holds it (e.g."
            f" `for layer in model.modules(): if isinstance(layer, {self.keep_fp32[0].__name__}):"
            " fully_shard(layer, mesh=mesh)`, then the blocks and the root), or pass `keep_fp32=()` to train them in"
            f" {dtype} too."
        )

    # --- the step -------------------------------------------------------------------------------------------------

    def clip_in_step(self, optimizer: Optimizable, max_norm: float | None = None, max_value: float | None = None,
                     norm_type: float = 2.0) -> None:
        """Clip ``optimizer``'s gradients at its next step, in fp32 inside it (Fabric's ``clip_gradients`` clips the
        16-bit gradients in place, where an fp16 norm at a loss scale overflows): by their total norm
        (``max_norm``), or each element (``max_value``)."""
        if (max_norm is None) == (max_value is None):
            raise ValueError(f"`{type(self).__name__}.clip_in_step`: pass one of `max_norm` and `max_value`.")
        bound = max_norm if max_norm is not None else max_value
        if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or not bound > 0:
            raise ValueError(f"`{type(self).__name__}.clip_in_step`: the bound must be a number > 0, got {bound!r}.")
        self._clips[id(_unwrap(optimizer))] = ClipRequest(max_norm=max_norm, norm_type=float(norm_type),
                                                          max_value=max_value)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler_config is not None:
            raise RuntimeError(
                f"`{type(self).__name__}` keeps fp16 gradients at the loss scale and unscales them in fp32 inside the"
                " optimizer step (unscaled in fp16 the small ones would flush), so they cannot be clipped in place."
                f" Clip inside the step instead: `plugin.clip_in_step(optimizer, max_norm=...)` before"
                " `optimizer.step()` (the Trainer's `gradient_clip_val` does this by itself)."
            )
        super().unscale_gradients(optimizer)

    def _check_steppable(self, optimizer: Any, kwargs: dict[str, Any]) -> None:
        if closure_driven(optimizer) or "closure" in kwargs:
            raise ValueError(
                f"`{type(self).__name__}` cannot step `{type(optimizer).__name__}` with a closure: it steps the"
                " optimizer on fp32 stand-ins of the weights once the gradients exist, and a closure would compute"
                " them inside the step, on the stand-ins. Use an optimizer that steps on existing gradients (SGD,"
                " Adam, AdamW, ...), or Lightning's `precision='bf16-true'` for LBFGS."
            )

    @property
    def _steps_plainly(self) -> bool:
        """Lightning's bf16-true, as it steps: the optimizer in bf16 on the bf16 weights (for comparison)."""
        return self.update == "nearest" and self.optimizer_states == "weight" and self.compute_dtype == torch.bfloat16

    def take_state_init(self, optimizer: Optimizer) -> None:
        """Take, through this plugin's step, a step at lr 0 on an optimizer of this plugin's model that has no state
        yet: torch's distributed checkpoint takes one (zero gradients, every lr set to 0) to learn the states' layout
        before it loads a checkpoint into them, and loads only the keys that step created. Run by the optimizer itself
        on the 16-bit weights, it creates none of this plugin's keys (the remainders, the rounding counters, fp16's
        state exponents: the checkpoint's are then left out of the load) and, under fp16, writes NaN into every weight
        (Adam's 0 / (0 + an eps that fp16 flushes to 0), times lr 0). Here the states are created as the plugin's step
        creates them and the weights keep their values (an update of 0 rounds to the same 16-bit weight); the
        optimizer's own step then finds no gradient and does nothing."""
        module = self._module_ref() if self._module_ref is not None else None
        if (module is None or self._steps_plainly or is_stepping(optimizer)  # (this plugin's own step)
                or not all(_zero(group.get("lr")) for group in optimizer.param_groups)):
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        ours = {id(p) for p in module.parameters()}
        if not any(id(p) in ours for p in params):
            return
        self.true_step.step(optimizer, None, None)
        for p in params:
            p.grad = None

    def unscale_for_hooks(self, optimizer: Optimizable) -> None:
        """Under a loss scale: unscale ``optimizer``'s 16-bit gradients in place for the hooks that read them (the
        Trainer's ``on_before_optimizer_step``, as Lightning's contract has it), keeping a copy of the scaled ones
        (unscaled in fp16 the smallest flush) that the step unscales in fp32, unless a hook changes the gradients.
        Three ops, and two bytes a parameter until the step."""
        torch_optimizer = _unwrap(optimizer)
        inverse = self._inverse_scale()
        if inverse is None:
            return
        params = [p for group in torch_optimizer.param_groups for p in group["params"] if p.grad is not None]
        dense = [p for p in params if p.grad.layout == torch.strided]
        kept: dict[Tensor, Tensor] = {}
        if dense:
            grads = [p.grad for p in dense]
            kept.update(zip(dense, foreach_mul(grads, 1), strict=True))  # (x * 1 keeps every bit)
            foreach_mul_(grads, inverse.to(grads[0].device))
        for p in params:
            if p.grad.layout != torch.strided:  # a sparse one: shown as a new tensor
                kept[p] = p.grad
                p.grad = p.grad * inverse.to(p.grad.device)
        if kept:
            self._shown[id(torch_optimizer)] = (kept, {p: (p.grad, version_counter(p.grad)) for p in params})

    def _inverse_scale(self) -> Tensor | None:
        scaler = self.step_policy.loss_scaler
        return None if scaler is None else scaler.carried_scale().double().reciprocal().float()

    @override
    def _scaler_step(self, optimizer: Optimizable, closure_step: Callable[[], Any] | None = None,
                     **kwargs: Any) -> Any:
        torch_optimizer: Optimizer = _unwrap(optimizer)
        self._check_steppable(torch_optimizer, kwargs if closure_step is None else {"closure": closure_step})
        policy = self.step_policy
        assert isinstance(policy, GuardedStep)  # true precision always checks its steps
        clip = self._clips.pop(id(torch_optimizer), None)
        if self._steps_plainly:
            self.true_step.check_written_by(torch_optimizer)  # (the other plugin's states, read plainly, are garbage)
            step = functools.partial(_plain_step, torch_optimizer, clip)
        else:
            factor, grads = self._inverse_scale(), None
            shown = self._shown.pop(id(torch_optimizer), None)
            if shown is not None:
                kept, versions = shown
                if all(p.grad is grad and version_counter(grad) == version for p, (grad, version) in versions.items()):
                    grads = kept  # the hooks left the gradients as shown: the scaled ones, unscaled in fp32
                else:
                    factor = None  # a hook changed them (a clip by hand): its unscaled gradients, as they are
            step = functools.partial(self.true_step.step, torch_optimizer, factor, clip, grads)
        policy.step_checked(torch_optimizer, step)
        return None

    @override
    def teardown(self) -> None:
        STATE_INIT_HOOK.release(self)
        super().teardown()

    def __getstate__(self) -> dict[str, Any]:
        # Weak references do not pickle (ddp_spawn pickles the plugin): the copy knows no layer, and hooks the ones of
        # the model it converts (hooks registered twice on one layer cast what is already cast: a no-op).
        state = super().__getstate__()
        state["_kept"] = None
        state["_shown"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._kept = weakref.WeakSet()


def _zero(lr: Any) -> bool:
    """Whether a learning rate is torch's state-layout step's 0: a plain 0.0, or a CPU tensor of 0 where the lr was a
    tensor. A tensor on a device is never that step (and reading it would wait for the device)."""
    if isinstance(lr, Tensor):
        return lr.device.type == "cpu" and lr.numel() == 1 and float(lr) == 0
    return isinstance(lr, numbers.Real) and lr == 0


def _plain_step(optimizer: Optimizer, clip: ClipRequest | None) -> None:
    if clip is not None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if clip.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip.max_norm, clip.norm_type)
        else:
            torch.nn.utils.clip_grad_value_(params, clip.max_value)  # type: ignore[arg-type]
    optimizer.step()


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer behind Fabric's or the Trainer's wrapper."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, Optimizer) else optimizer
