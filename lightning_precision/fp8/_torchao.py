"""The torchao backend: ``Float8Linear`` (tensorwise and rowwise scaling) and torchao's MXFP8 training layer, converted
in place or by module, able to run under inference mode, and turned back into ``nn.Linear`` in place."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_precision import _imports
from lightning_precision._core import fsdp
from lightning_precision._upstream import torchao as upstream
from lightning_precision._warnings import NoEffectWarning, warn
from lightning_precision.fp8._selection import (
    TORCHAO_CANDIDATES,
    TORCHAO_RECIPES,
    LayerDecision,
    ScalingFamily,
    linear_layers,
    replace_modules,
)

__all__ = [
    "MXFP8_FLAG",
    "MXFP8_TOKENS",
    "MARKS_RAN",
    "NO_TOKENS_CLASS",
    "RAN_FLAG",
    "MXFP8Recipe",
    "convert_with_torchao",
    "demote_torchao_layer",
    "float8_all_gather_possible",
    "float8_linear_class",
    "high_precision_layers",
    "layer_config",
    "layer_format",
    "mark_ran",
    "mxfp8_after_first_step",
    "mxfp8_linear_module",
    "recipe_format",
    "run_outside_inference_mode",
    "set_layer_format",
    "to_mxfp8_linear",
    "torchao_config",
    "torchao_format_name",
    "torchao_scaling_family",
    "with_float8_all_gather",
]

# which Lightning's validate/test/predict use by default. Each converted layer leaves inference mode for its own
# forward, with gradients off: the same fp8 numerics as training, an ordinary (non-inference) output tensor, and the
# rest of the model stays in inference mode. A forward hook with always_call=True restores the mode on errors too.
_INFERENCE_EXITS = threading.local()


def _compiled_training() -> bool:
    """Under torch.compile with gradients on (training), the hooks do nothing: reading the inference mode is a graph
    break, which split a compiled fp8 model at every fp8 layer. Both checks are traced without a break, and grad mode is
    the same at both hooks of a call in that case, so they stay paired. Evaluation (gradients off) still leaves
    inference mode, a break per fp8 layer: torch 2.7's AOT graph cannot run torchao's casts under inference mode."""
    return torch.compiler.is_compiling() and torch.is_grad_enabled()


def leave_inference_mode(module: nn.Module, args: Any) -> None:
    if _compiled_training():
        return
    stack = getattr(_INFERENCE_EXITS, "stack", None)
    if stack is None:
        stack = _INFERENCE_EXITS.stack = []
    if torch.is_inference_mode_enabled():
        exits = contextlib.ExitStack()
        exits.enter_context(torch.inference_mode(False))
        exits.enter_context(torch.no_grad())
        stack.append(exits)
    else:
        stack.append(None)


def restore_inference_mode(module: nn.Module, args: Any, output: Any) -> None:
    if _compiled_training():
        return
    stack = getattr(_INFERENCE_EXITS, "stack", None)
    if not stack:  # the pre-hook was traced (and stood aside) while this one runs eagerly: nothing to undo
        return
    exits = stack.pop()
    if exits is not None:
        exits.close()


_INFERENCE_HOOKS = "_lightning_precision_inference_hooks"

# Whether a converted layer's forward has run (``ForwardWatch`` reads it after each backward). Every call writes True
# and no call reads it: under torch.compile a module attribute the graph reads is guarded on (and its change
# recompiles), one it only writes is not. The layer classes below set it in their forward (``MARKS_RAN``); other
# layers (Transformer Engine's) get ``mark_ran`` as a forward pre-hook that stays, since removing a hook recompiles too.
RAN_FLAG = "_lightning_precision_ran"
MARKS_RAN = "_lightning_precision_marks_ran"


def mark_ran(module: nn.Module, *args: Any) -> None:
    """Record that ``module``'s forward ran (``RAN_FLAG``); a forward pre-hook's signature."""
    module.__dict__[RAN_FLAG] = True  # not nn.Module.__setattr__: a plain attribute, set at every call


def run_outside_inference_mode(layer: nn.Module) -> None:
    """Make ``layer`` (a torchao ``Float8Linear``) work under ``torch.inference_mode``: see above."""
    setattr(layer, _INFERENCE_HOOKS, (layer.register_forward_pre_hook(leave_inference_mode),
                                      layer.register_forward_hook(restore_inference_mode, always_call=True)))


def demote_torchao_layer(layer: nn.Module) -> None:
    """Turn a torchao ``Float8Linear`` back into an ``nn.Linear``, in place: the same module object, so its Parameters
    (and the optimizer's state of them), every hook on it and every reference to it stay valid, and ``torch.compile``
    recompiles (it guards on the module's type). ``Float8Linear`` is an ``nn.Linear`` holding the same ``weight`` and
    ``bias``; only its forward differs."""
    Float8Linear = _imports.import_quietly("torchao.float8.float8_linear").Float8Linear
    if not isinstance(layer, Float8Linear) and not getattr(layer, MXFP8_FLAG, False):
        raise TypeError(f"demote_torchao_layer: {type(layer).__name__} is not torchao's Float8Linear nor an MXFP8"
                        " layer.")
    if type(layer.weight) is not nn.Parameter:  # float8 all-gather's weight subclass casts in every forward
        raise RuntimeError("demote_torchao_layer: the layer's weight is a torchao tensor subclass (float8 all-gather"
                           " under FSDP2); it cannot return to high precision in place.")
    for handle in getattr(layer, _INFERENCE_HOOKS, ()):
        handle.remove()
    layer.__dict__.pop(_INFERENCE_HOOKS, None)
    for attribute in (MXFP8_FLAG, RAN_FLAG, "kernel_preference", "scale_calculation_mode", "wgrad_with_hp",
                      *_MXFP8_RECORD):
        layer.__dict__.pop(attribute, None)
    layer.__class__ = nn.Linear


@contextlib.contextmanager
def high_precision_layers(module: nn.Module | None) -> Iterator[None]:
    """torchao's converted layers of ``module`` compute as the ``nn.Linear`` each is, for the context's duration
    (evaluation without fp8): only the class changes, and back whatever happens (Python only, no op; the same
    Parameters, hooks and attributes, unlike ``demote_torchao_layer``, which removes the layer's own). A weight that is
    a torchao tensor subclass (float8 all-gather under FSDP2) casts in every forward: refused."""
    Float8Linear = _imports.import_quietly("torchao.float8.float8_linear").Float8Linear
    layers = [] if module is None else [m for m in module.modules()
                                        if isinstance(m, Float8Linear) or getattr(m, MXFP8_FLAG, False)]
    if any(type(layer.weight) is not nn.Parameter for layer in layers):
        raise RuntimeError("eval_precision: the fp8 layers' weights are torchao tensor subclasses (float8 all-gather"
                           " under FSDP2), which cast to fp8 in every forward: they cannot evaluate in high precision."
                           " Pass `fsdp_float8_all_gather=False`, or `eval_precision=None` (evaluate in fp8).")
    classes = [(layer, layer.__class__) for layer in layers]
    try:
        for layer, _ in classes:
            layer.__class__ = nn.Linear
        yield
    finally:
        for layer, cls in classes:
            layer.__class__ = cls


def torchao_config(recipe: Any, emulate: bool) -> Any:
    """A ``Float8LinearConfig`` from a recipe name or a config, with ``emulate`` applied."""
    _imports.require(_imports.TORCHAO_AVAILABLE, "torchao", "FP8Precision(backend='torchao')")
    try:
        Float8LinearConfig = _imports.import_quietly("torchao.float8").Float8LinearConfig
    except Exception as err:  # a torchao built for another torch fails in many ways (AttributeError, OSError, ...)
        raise ImportError(
            f"FP8Precision(backend='torchao'): torchao {_imports.version_of('torchao')} does not import beside torch"
            f" {torch.__version__} ({type(err).__name__}: {err}). Install the torchao release built for your torch"
            " (see the compatibility table in the README)."
        ) from err

    if isinstance(recipe, MXFP8Recipe):
        return dataclasses.replace(recipe, emulate=True) if emulate else recipe
    if recipe == "mxfp8":
        mxfp8_linear_module()  # fails now, with the version, if this torchao has no MXFP8 training layer
        return MXFP8Recipe(emulate=emulate)
    if isinstance(recipe, Float8LinearConfig):
        config = recipe
    elif isinstance(recipe, str) and recipe in TORCHAO_RECIPES:
        config = Float8LinearConfig.from_recipe_name(recipe)
    else:
        raise ValueError(
            f"`FP8Precision(backend='torchao', recipe={recipe!r})`: use one of {TORCHAO_RECIPES}, a"
            " `torchao.float8.Float8LinearConfig` or a `lightning_precision.fp8.MXFP8Recipe`."
        )
    return dataclasses.replace(config, emulate=True) if emulate and not config.emulate else config


def torchao_scaling_family(config: Any) -> ScalingFamily:
    """The threshold family of a torchao config: per-tensor scaling, finer, or MXFP8."""
    if isinstance(config, MXFP8Recipe):
        return "mxfp8"
    ScalingGranularity = _imports.import_quietly("torchao.float8.config").ScalingGranularity

    granularity = config.cast_config_input.scaling_granularity
    return "tensorwise" if granularity == ScalingGranularity.TENSORWISE else "rowwise"


def torchao_format_name(config: Any) -> str | None:
    """The format name (``TORCHAO_CANDIDATES``) of a torchao config, whatever its emulation and float8 all-gather; None
    for a config that is none of the named recipes (its options changed)."""
    if isinstance(config, MXFP8Recipe):
        return "mxfp8"
    plain = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
    return next((name for name in TORCHAO_CANDIDATES
                 if name != "mxfp8" and plain == torchao_config(name, config.emulate)), None)


def layer_config(config: Any, fmt: str | None) -> Any:
    """What a layer in format ``fmt`` converts with, under a plugin whose torchao config is ``config``: ``config``
    itself for ``None`` (the plugin's recipe, its options included), else the named recipe with ``config``'s
    emulation. Float8 all-gather carries over to a tensorwise layer only (torchao all-gathers tensorwise weights
    only)."""
    if fmt is None:
        return config
    if fmt not in TORCHAO_CANDIDATES:
        raise ValueError(f"{fmt!r} is not a torchao format; one of {', '.join(TORCHAO_CANDIDATES)}.")
    layer = torchao_config(fmt, config.emulate)
    if getattr(config, "enable_fsdp_float8_all_gather", False) and torchao_scaling_family(layer) == "tensorwise":
        layer = with_float8_all_gather(layer)
    return layer


def convert_with_torchao(module: nn.Module, config: Any, decisions: list[LayerDecision]) -> nn.Module:
    """The chosen layers as torchao fp8 layers (same Parameter objects): ``Float8Linear`` by module (a layer registered
    under several names becomes one ``Float8Linear`` under all of them), MXFP8 in place. Each layer in its own format
    where its decision names one (``LayerDecision.format``: tensorwise, rowwise, rowwise_with_gw_hp and MXFP8 layers
    side by side), else in ``config``."""
    convert_to_float8_training = _imports.import_quietly("torchao.float8").convert_to_float8_training

    configs = {d.fqn: layer_config(config, d.format) for d in decisions if d.fp8}
    replacements = {}
    for fqn, m, _ in linear_layers(module):
        layer = configs.get(fqn)
        if isinstance(layer, MXFP8Recipe):
            to_mxfp8_linear(m, layer, fqn)
        elif layer is not None:
            # torchao's public verb converts a bare nn.Linear into its Float8Linear, reusing weight and bias.
            replacements[id(m)] = convert_to_float8_training(m, config=layer)
    for converted in replacements.values():
        converted.__class__ = float8_linear_class()
    return replace_modules(module, replacements)


NO_TOKENS_CLASS = "_Float8LinearNoTokens"
_CLASSES: dict[str, type] = {}


def float8_linear_class() -> type:
    """torchao's ``Float8Linear``, able to run a call with no tokens. torchao's dynamic scale reduces the input's amax,
    which has no value over zero elements (tensorwise and rowwise alike fail): a mixture-of-experts expert that no
    token was routed to in a step would stop the fit. Such a call runs as the high-precision linear it is (zero tokens:
    an empty output, and a zero weight gradient, as fp8 would give). The class keeps torchao's name, so the model
    prints and is recognised as before, and is found again by ``lightning_precision.fp8.<its qualname>``: a converted
    model pickles (``torch.save(model)``) as torchao's did."""
    if NO_TOKENS_CLASS not in _CLASSES:
        Float8Linear = _imports.import_quietly("torchao.float8.float8_linear").Float8Linear

        class Float8LinearNoTokens(Float8Linear):  # type: ignore[misc,valid-type]  # torchao's class, found at run time
            def forward(self, input: torch.Tensor) -> torch.Tensor:
                mark_ran(self)
                if input.numel() == 0:
                    return nn.functional.linear(input, self.weight, self.bias)
                device = input.device.type
                if device != "cuda" and self.hp_weight_gradient and torch.is_autocast_enabled(device):
                    # torchao casts the input to the autocast dtype under CUDA autocast only; emulated on a CPU, an
                    # fp32 input met a bf16 output gradient in rowwise_with_gw_hp's high-precision weight gradient and
                    # failed. Cast as on a GPU. (Only there: the fp8 casts of the other recipes take either dtype, and
                    # their CPU numerics stay torchao's own.)
                    input = input.to(torch.get_autocast_dtype(device))
                return super().forward(input)

            @property
            def hp_weight_gradient(self) -> bool:  # rowwise_with_gw_hp: the weight gradient's casts are off
                return self.config.cast_config_input_for_grad_weight.scaling_type.name == "DISABLED"

        setattr(Float8LinearNoTokens, MARKS_RAN, True)
        Float8LinearNoTokens.__name__ = Float8Linear.__name__
        Float8LinearNoTokens.__qualname__ = NO_TOKENS_CLASS
        Float8LinearNoTokens.__module__ = "lightning_precision.fp8"  # where pickles find it (its `__getattr__`)
        _CLASSES[NO_TOKENS_CLASS] = Float8LinearNoTokens
    return _CLASSES[NO_TOKENS_CLASS]


@dataclass(frozen=True)
class MXFP8Recipe:
    """torchao's MXFP8 training (``torchao.prototype.moe_training``'s ``MXFP8Linear``): e4m3 with an e8m0 scale per
    32 elements, the scale rounded up (``"rceil"``), for input, weight and gradients. ``emulate`` runs the same casts
    with torch ops (any device); ``wgrad_with_hp`` computes the weight gradient in high precision."""

    emulate: bool = False
    wgrad_with_hp: bool = False


MXFP8_FLAG = "_lightning_precision_mxfp8"
MXFP8_TOKENS = 32  # the backward casts the tokens (batch x sequence) in blocks of 32 too


def mxfp8_linear_module() -> Any:
    """torchao's MXFP8 training layer, or an error naming what this torchao lacks. It moved between torchao releases
    (``mx_formats.mx_linear.MXLinear`` up to 0.11); one API is supported, the current one."""
    _imports.require(_imports.TORCHAO_AVAILABLE, "torchao", "FP8Precision(recipe='mxfp8')")
    try:
        return upstream.mxfp8_linear_module()
    except Exception as err:
        raise ImportError(
            f"FP8Precision(backend='torchao', recipe='mxfp8') needs torchao's MXFP8 training layer"
            f" (torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear), which torchao"
            f" {_imports.version_of('torchao')} does not have ({type(err).__name__}: {err}). Upgrade torchao, or use"
            " backend='transformer_engine' on a GPU with compute capability >= 10.0."
        ) from err


# What an MXFP8 layer records of its calls, for the plugin to report what ran. Flags set once each (no counter): under
# torch.compile a module attribute that changes is a guard that fails, and a counter would recompile every step.
_MXFP8_RECORD = {
    "_mxfp8_ran": False,  # a training call (gradients on) ran in MXFP8
    "_mxfp8_short": None,  # the tokens of the first training call that fell back to high precision
    "_mxfp8_warned": False,  # the fallback was said (by the layer, or by the plugin for it)
    "_mxfp8_quiet": False,  # the plugin says it instead (until the first backward, when it knows what ran)
    "_mxfp8_name": None,  # the layer's path, named in the warning
}


def to_mxfp8_linear(layer: nn.Linear, recipe: MXFP8Recipe, name: str | None = None) -> None:
    """Make ``layer`` compute in MXFP8, in place (the same module and Parameters, as ``demote_torchao_layer`` undoes).
    ``name``: its path in the model, named when a call falls back to high precision."""
    mx = mxfp8_linear_module()
    layer.kernel_preference = upstream.kernel_preference(emulated=recipe.emulate)
    layer.scale_calculation_mode = upstream.rceil_scale_mode()
    setattr(layer, "wgrad_with_hp", recipe.wgrad_with_hp)  # noqa: B010  (torchao's attribute, not nn.Linear's)
    for attribute, value in _MXFP8_RECORD.items():
        setattr(layer, attribute, value)
    setattr(layer, "_mxfp8_name", name)  # noqa: B010  (an attribute of the class it becomes, not nn.Linear's)
    setattr(layer, MXFP8_FLAG, True)
    layer.__class__ = _autocast_mxfp8_class(mx.MXFP8Linear)


_MXFP8_CLASS: dict[type, type] = {}


def _autocast_mxfp8_class(base: type) -> type:
    """torchao's ``MXFP8Linear`` under autocast: its matmul takes input and weight as they come (an fp32 weight beside
    a bf16 input fails; fp32 inputs compute in fp32), and its backward needs the tokens in blocks of 32. This subclass
    casts both to the autocast dtype, as ``Float8Linear`` does, and runs a call whose tokens are not a multiple of 32
    (an epoch's last, short batch; a head over pooled tokens) in high precision with a warning naming the layer,
    instead of failing mid-run. It records whether its training calls ran in MXFP8 (``_MXFP8_RECORD``), so that the
    plugin reports a layer that never does as not fp8."""
    if base not in _MXFP8_CLASS:

        class AutocastMXFP8Linear(base):
            # What `_MXFP8_RECORD` and `to_mxfp8_linear` set on the layer.
            _mxfp8_short: int | None
            _mxfp8_warned: bool
            _mxfp8_quiet: bool
            _mxfp8_ran: bool
            _mxfp8_name: str | None
            scaled_mm = staticmethod(upstream.mxfp8_scaled_mm())  # resolved here: not an import in each forward

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                mark_ran(self)
                device = input.device.type
                dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else input.dtype
                tokens = input.numel() // max(input.shape[-1], 1)
                training = torch.is_grad_enabled()
                if tokens % MXFP8_TOKENS:
                    if training and self._mxfp8_short is None:
                        self._mxfp8_short = tokens
                    if not self._mxfp8_warned and not self._mxfp8_quiet:
                        self._mxfp8_warned = True
                        warn(_mxfp8_fallback_message(self._mxfp8_name, tokens, dtype), NoEffectWarning)
                    return nn.functional.linear(input, self.weight, self.bias)
                if training:  # written, not read (see RAN_FLAG): a read would recompile the step after it changes
                    self._mxfp8_ran = True
                with torch.autocast(device, enabled=False):  # torchao's casts take contiguous tensors only
                    return _mxfp8_forward(self, input.to(dtype).contiguous(), self.weight.to(dtype), self.scaled_mm)

        setattr(AutocastMXFP8Linear, MARKS_RAN, True)
        _MXFP8_CLASS[base] = AutocastMXFP8Linear
    return _MXFP8_CLASS[base]


def _mxfp8_fallback_message(name: str | None, tokens: int, dtype: torch.dtype) -> str:
    layer = f"layer {name!r}" if name else "an MXFP8 layer"
    return (f"MXFP8: {layer} ran a call of {tokens} tokens in {dtype}: not a multiple of {MXFP8_TOKENS}, the block"
            " MXFP8's backward casts the tokens (batch x sequence) in. Its calls of a multiple of 32 tokens run in"
            " MXFP8, so it stays an MXFP8 layer. To run every step in MXFP8: `drop_last=True` in the DataLoader (an"
            " epoch's short last batch), or batch x sequence a multiple of 32.")


def _short_reason(tokens: int, dtype: torch.dtype) -> str:
    return (f"MXFP8 layer, but every training call so far had {tokens} tokens, not a multiple of {MXFP8_TOKENS} (the"
            f" block MXFP8's backward casts tokens in): it ran in {dtype}, not fp8")


def mxfp8_after_first_step(layers: Mapping[str, nn.Module], dtype: torch.dtype, owner: str = "FP8Precision",
                           ran: Iterable[str] | None = None) -> dict[str, str]:
    """After the first training backward: the MXFP8 layers among ``layers`` whose every call fell back to ``dtype``
    (tokens not a multiple of 32), each with the reason it is not fp8 (a ``LayerDecision.reason``), said in one
    warning with a fix that works for them. A layer that ran some calls in MXFP8 stays an MXFP8 layer, its fallback
    warned (named). From here on, each layer warns by itself at its first fallback. ``ran``: the layers judged now
    (default: all of ``layers``); the others (an expert no token reached in the first step) stay quiet until the
    backward after their first call, when this is called again with them in ``ran`` (``layers`` still all of them, so
    the fix knows whether other layers ran in MXFP8)."""
    judged = set(layers) if ran is None else set(ran)
    every = {fqn: m for fqn, m in layers.items() if getattr(m, MXFP8_FLAG, False)}
    mx: dict[str, Any] = {fqn: m for fqn, m in every.items() if fqn in judged}  # the MXFP8 class's attributes
    for m in mx.values():
        m._mxfp8_quiet = False
    short = {fqn: m._mxfp8_short for fqn, m in mx.items() if m._mxfp8_short is not None and not m._mxfp8_ran}
    for fqn, m in mx.items():
        if m._mxfp8_short is not None and not m._mxfp8_warned:
            m._mxfp8_warned = True
            if fqn not in short:  # some of its calls ran in MXFP8: an MXFP8 layer, with a short call
                warn(_mxfp8_fallback_message(fqn, m._mxfp8_short, dtype), NoEffectWarning)
    if not short:
        return {}
    named = ", ".join(f"{fqn} ({tokens} tokens)" for fqn, tokens in short.items())
    if any(m._mxfp8_ran for m in every.values()):
        # Other MXFP8 layers got a multiple of 32: these see fewer tokens than the rest (a head over pooled tokens),
        # and no choice of sequence length helps them.
        fix = (f"They see fewer tokens than the model's other MXFP8 layers (a head over pooled tokens, say). Exclude"
               f" them, as they run in {dtype} anyway: `module_filter=lambda module, fqn: fqn not in"
               f" {set(short)!r}` (it replaces the default layer rules; with a plan, write them in high precision"
               " there), or give them a multiple of 32 tokens (a batch size that is, for a head that sees one token per"
               " sample).")
    else:
        fix = ("No MXFP8 layer ran in MXFP8: batch x sequence is what is short. Make it a multiple of 32 (pad sequences"
               " to a multiple of 32, e.g. a tokenizer's `pad_to_multiple_of=32`, or choose such a batch size).")
    warn(f"{owner} (MXFP8 layers): {len(short)} layer(s) ran every training call of the first step they ran in"
         f" {dtype}, not in MXFP8, because the tokens reaching them are not a multiple of {MXFP8_TOKENS} (the block"
         f" MXFP8's backward casts tokens in): {named}. `layer_decisions` and `precision/fp8_layers` count them as not"
         f" fp8 (and as fp8 again if a later call runs in MXFP8). {fix}", NoEffectWarning)
    return {fqn: _short_reason(tokens, dtype) for fqn, tokens in short.items()}


def _mxfp8_forward(layer: nn.Module, input: torch.Tensor, weight: torch.Tensor,
                   scaled_mm: Callable[..., Any]) -> torch.Tensor:
    """``MXFP8Linear.forward`` with the weight in the input's dtype: torchao's forward passes ``self.weight`` as is,
    so its (prototype) matmul function is called directly, as that forward does."""
    output = scaled_mm(input, weight, kernel_preference=layer.kernel_preference,
                       scale_calculation_mode=layer.scale_calculation_mode, wgrad_with_hp=layer.wgrad_with_hp)
    return output if layer.bias is None else output + layer.bias.to(output.dtype)


def with_float8_all_gather(config: Any) -> Any:
    """``config`` with torchao's float8 all-gather on: FSDP2 then all-gathers these layers' weights already cast to
    fp8 (a quarter of fp32's bytes). Tensorwise scaling only (torchao's rule)."""
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True)


def float8_all_gather_possible(scaling_family: str) -> str | None:
    """None if torchao's float8 all-gather can run here, else why not."""
    if scaling_family != "tensorwise":
        return f"torchao all-gathers in fp8 with tensorwise scaling only (these layers are {scaling_family})"
    if fsdp.process_group_backend() == "gloo" and not fsdp.custom_all_gather_supported():
        return (f"gloo has no float8 dtype, and torch {torch.__version__} cannot give FSDP2 the uint8 all-gather that"
                " carries it (torch >= 2.8 can)")
    return None


def layer_format(module: nn.Module) -> str | None:
    """The torchao format ``module`` computes in now: ``"mxfp8"`` (``to_mxfp8_linear``), ``"tensorwise"``,
    ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (a ``Float8Linear``, named by its config: the input's scaling
    granularity, and whether the weight gradient's input cast is disabled), None for a plain ``nn.Linear``. A
    ``Float8Linear`` of a custom config is named after the recipe it scales as."""
    if getattr(module, MXFP8_FLAG, False):
        return "mxfp8"
    Float8Linear = _imports.import_quietly("torchao.float8.float8_linear").Float8Linear
    return recipe_format(module.config) if isinstance(module, Float8Linear) else None


def recipe_format(config: Any) -> str:
    """The torchao format a ``Float8LinearConfig`` or ``MXFP8Recipe`` computes in (see ``layer_format``)."""
    if isinstance(config, MXFP8Recipe):
        return "mxfp8"
    if torchao_scaling_family(config) == "tensorwise":
        return "tensorwise"
    disabled = _imports.import_quietly("torchao.float8.config").ScalingType.DISABLED
    return "rowwise_with_gw_hp" if config.cast_config_input_for_grad_weight.scaling_type is disabled else "rowwise"


def set_layer_format(layer: nn.Module, fmt: Any, emulate: bool, name: str | None = None) -> nn.Module:
    """Make ``layer`` (an ``nn.Linear``, a ``Float8Linear`` or an MXFP8 layer) compute in ``fmt``, in place: a torchao
    format name (``TORCHAO_RECIPES``), a ``Float8LinearConfig`` or ``MXFP8Recipe``, or None for high precision. The
    same module object, so its Parameters (and the optimizer's state of them), hooks and references stay valid; a
    converted layer gets the inference-mode hooks the plugin's conversion gives it (``run_outside_inference_mode``).
    Returns the module that computes in ``fmt`` (with torchao, ``layer`` itself). ``name``: its path, named by an
    MXFP8 layer's warnings. A weight that is a torchao tensor subclass (float8 all-gather under FSDP2) cannot move:
    ``demote_torchao_layer``'s error."""
    if layer_format(layer) is not None:
        demote_torchao_layer(layer)  # a plain nn.Linear again: one way in, whatever the format it leaves
    if fmt is None:
        return layer
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"set_layer_format: {type(layer).__name__} is not an nn.Linear.")
    config = torchao_config(fmt, emulate)
    if isinstance(config, MXFP8Recipe):
        to_mxfp8_linear(layer, config, name)
    else:
        # torchao's own constructor fills the config's attributes (scaling types, matmul configs) on a weightless
        # twin; the layer takes them and the class, and keeps its Parameters.
        twin = float8_linear_class()(layer.in_features, layer.out_features, bias=False, config=config, device="meta")
        for attribute, value in vars(twin).items():
            if not attribute.startswith("_") and attribute not in ("in_features", "out_features", "training"):
                layer.__dict__[attribute] = value
        layer.__class__ = float8_linear_class()
    run_outside_inference_mode(layer)
    return layer
