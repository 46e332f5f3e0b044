"""fp8 training, backend-neutral: which layers run in fp8, converting them (torchao or Transformer Engine), recipes.

The pure functions here are what ``FP8Precision`` calls; use them directly where a plugin cannot go (for example inside
``configure_model`` before FSDP2's ``fully_shard``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_precision import _fsdp, _imports
from lightning_precision._checks import one_config
from lightning_precision._warnings import NoEffectWarning, _deprecated_alias, deprecated, warn

__all__ = [
    "BACKENDS",
    "BLOCK_SCALED",
    "FP8LayerPolicy",
    "FP8_MIN_CAPABILITY",
    "HYBRID_FORMAT",
    "LayerDecision",
    "MXFP8Recipe",
    "MXFP8_MIN_CAPABILITY",
    "MXFP8_TOKENS",
    "ModuleFilter",
    "RecipeLike",
    "TENSORS",
    "TE_NVFP4",
    "TE_RECIPES",
    "TORCHAO_RECIPES",
    "check_fp8_hardware",
    "check_module_filter",
    "convert_with_te",
    "convert_with_torchao",
    "demote_torchao_layer",
    "float8_all_gather_possible",
    "format_summary",
    "fp8_capable",
    "fp8_gpu_available",
    "functional_linears",
    "gemm_divisor",
    "replace_modules",
    "scaling_family_of",
    "select_fp8_layers",
    "te_recipe",
    "te_scaling_family",
    "mxfp8_after_first_step",
    "to_mxfp8_linear",
    "torchao_config",
    "torchao_scaling_family",
    "with_float8_all_gather",
]

ModuleFilter = Callable[[nn.Module, str], bool]
# A recipe: its name ("tensorwise", "delayed", ...), a TE mapping {"name": "delayed", ...}, or the recipe object itself
# (torchao's Float8LinearConfig, a TE recipe). Those classes live in optional packages, hence the `Any`.
RecipeLike = Union[str, Mapping[str, Any], Any]

# The tensors of a linear layer that fp8 casts, and the format each is cast to by default (TE's HYBRID format, and
# torchao's tensorwise recipe): e4m3fn forward, e5m2 gradients.
TENSORS = ("input", "weight", "grad_output")
HYBRID_FORMAT = {"input": "e4m3fn", "weight": "e4m3fn", "grad_output": "e5m2"}

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
TE_RECIPES = ("delayed", "current", "mxfp8", "block")
# NVFP4 is not fp8: its own plugin (NVFP4Precision) names it; the TE table below holds it beside the fp8 recipes.
TE_NVFP4 = "nvfp4"

# The GEMM dims a recipe needs divisible: 16 for fp8 tensor cores; a block-scaled recipe's block size (MXFP8 casts
# blocks of 32 along K in the forward and along N and the tokens in the backward; NVFP4 blocks of 16, and Transformer
# Engine asks 32 of its NVFP4 GEMMs' dims).
_DIVISOR = {"mxfp8": 32, TE_NVFP4: 32}
BLOCK_SCALED = tuple(_DIVISOR)


def gemm_divisor(scaling_family: str) -> int:
    """What a layer's in and out features must be divisible by to run in fp8 with ``scaling_family``.

    Example:
        >>> gemm_divisor("tensorwise"), gemm_divisor("rowwise"), gemm_divisor("mxfp8"), gemm_divisor("nvfp4")
        (16, 16, 32, 32)
    """
    return _DIVISOR.get(scaling_family, 16)
BACKENDS = ("torchao", "transformer_engine")

# Below these GEMM sizes fp8 is slower than bf16: the cast and scale kernels cost more than the faster matmul saves.
# They are torchao's thresholds, measured on H100 (torchao/float8 README). N = out_features, K = in_features.
# Per-tensor scaling (torchao tensorwise, TE delayed/current): skip when K <= 4096 and N <= 1024.
# Finer scaling (rowwise, blockwise, MXFP8) costs more per cast: skip when N <= 2048, K <= 1024,
# or N <= 4096 and K <= 2048.
_PER_TENSOR = ("tensorwise", "delayed", "current")


def _too_small(scaling_family: str, n: int, k: int) -> bool:
    if scaling_family in _PER_TENSOR:
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


@dataclass(frozen=True)
class LayerDecision:
    """Whether one linear layer runs in fp8, and why. ``aliases`` are its other paths in the model (one module
    registered under several names is one layer, converted once)."""

    fqn: str
    in_features: int
    out_features: int
    fp8: bool
    reason: str
    aliases: tuple[str, ...] = ()


def _linear_layers(module: nn.Module) -> list[tuple[str, nn.Linear, tuple[str, ...]]]:
    """Each ``nn.Linear`` once, with its first path and its other paths, in module order."""
    paths: dict[int, list[str]] = {}
    layers: dict[int, nn.Linear] = {}
    for fqn, m in module.named_modules(remove_duplicate=False):
        if isinstance(m, nn.Linear):
            layers.setdefault(id(m), m)
            if fqn not in paths.setdefault(id(m), []):
                paths[id(m)].append(fqn)
    return [(paths[i][0], layers[i], tuple(paths[i][1:])) for i in layers]


def functional_linears(module: nn.Module) -> dict[int, str]:
    """``nn.Linear`` layers whose forward never runs because their owner uses the weight functionally, with why.
    ``nn.MultiheadAttention`` passes ``out_proj.weight`` to ``F.multi_head_attention_forward``."""
    return {
        id(m.out_proj): "nn.MultiheadAttention uses its weight functionally (its forward never runs, so it cannot be fp8)"
        for m in module.modules()
        if isinstance(m, nn.MultiheadAttention) and isinstance(m.out_proj, nn.Linear)
    }


def select_fp8_layers(
    module: nn.Module,
    scaling_family: str = "tensorwise",
    module_filter: Optional[ModuleFilter] = None,
    skip_small_layers: bool = True,
    skip_first_last: bool = True,
    *,
    layer_policy: Optional[FP8LayerPolicy] = None,
    recipe_name: Optional[str] = None,
) -> list[LayerDecision]:
    """Decide, for every ``nn.Linear`` in ``module``, whether it runs in fp8. ``scaling_family`` is what the rules
    depend on: the per-tensor, per-row or block scaling of the recipe (``FP8Precision.scaling_family``; torchao's
    ``rowwise_with_gw_hp`` is ``"rowwise"``); ``recipe_name=`` is its deprecated name. The choice is ``layer_policy`` (an
    :class:`FP8LayerPolicy`) or, as before, the flat ``module_filter``, ``skip_small_layers`` and ``skip_first_last``;
    not both. Rules, in order:

    1. GEMM dims (in and out features) must be divisible by 16, the fp8 tensor-core requirement, or by the block of a
       block-scaled recipe (32 for MXFP8 and NVFP4, ``gemm_divisor``). Always applied.
    2. A layer whose forward never runs (``nn.MultiheadAttention.out_proj``) stays as it is. Always applied.
    3. ``module_filter(module, fqn)``, when given, decides alone for the rest.
    4. Otherwise the first and last linear layers in registration order, among those that run as modules (rule 2's
       are passed over), stay in high precision (``skip_first_last``). The aim is the input projection and the
       classifier head, where e4m3's 3 explicit mantissa bits cost the most accuracy and which are usually small; that
       holds when a model registers its layers in forward order (in a bare ``nn.TransformerEncoder`` the first is the
       first feed-forward ``linear1``).
    5. Layers too small to gain are skipped (``skip_small_layers``; thresholds above).

    A layer registered under several names is decided (and converted) once, under its first name.

    Example:
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10))
        >>> for d in select_fp8_layers(model):
        ...     print(d.fqn, d.fp8, d.reason)
        0 False first linear layer that runs as a module (kept in high precision for accuracy)
        1 False too small to gain (64x64 is under the tensorwise thresholds)
        2 False dims 64x10 not divisible by 16 (tensorwise GEMM requirement)
        >>> [d.fp8 for d in select_fp8_layers(model, skip_small_layers=False)]
        [False, True, False]
        >>> [d.fp8 for d in select_fp8_layers(model, module_filter=lambda module, fqn: fqn == "0")]
        [True, False, False]
    """
    if recipe_name is not None:
        deprecated("select_fp8_layers(recipe_name=...)", "select_fp8_layers(scaling_family=...)")
        if scaling_family not in ("tensorwise", recipe_name):  # two different families: neither may win silently
            raise ValueError(f"`select_fp8_layers(scaling_family={scaling_family!r}, recipe_name={recipe_name!r})`:"
                             " `recipe_name` is the deprecated name of `scaling_family`; pass one.")
        scaling_family = recipe_name
    policy = _resolve_layer_policy("select_fp8_layers", layer_policy, module_filter=module_filter,
                                  skip_small_layers=skip_small_layers, skip_first_last=skip_first_last)
    module_filter, skip_small_layers, skip_first_last = (
        policy.module_filter, policy.skip_small_layers, policy.skip_first_last
    )
    linears = _linear_layers(module)
    functional = functional_linears(module)
    # MultiheadAttention's out_proj is registered first in a TransformerEncoder layer but never runs: choosing it would
    # protect nothing and send the first layer that runs to fp8.
    runs = [fqn for fqn, linear, _ in linears if id(linear) not in functional]
    edge = {runs[-1]: "last", runs[0]: "first"} if runs else {}  # a lone layer: "first"
    decisions = []
    divisor = gemm_divisor(scaling_family)
    for fqn, linear, aliases in linears:
        n, k = linear.out_features, linear.in_features
        if n % divisor or k % divisor:
            fp8, reason = False, f"dims {k}x{n} not divisible by {divisor} ({scaling_family} GEMM requirement)"
        elif id(linear) in functional:
            fp8, reason = False, functional[id(linear)]
        elif module_filter is not None:
            fp8 = bool(module_filter(linear, fqn))
            reason = "module_filter" if fp8 else "excluded by module_filter"
        elif skip_first_last and fqn in edge:
            fp8, reason = False, f"{edge[fqn]} linear layer that runs as a module (kept in high precision for accuracy)"
        elif skip_small_layers and _too_small(scaling_family, n, k):
            fp8, reason = False, f"too small to gain ({k}x{n} is under the {scaling_family} thresholds)"
        else:
            fp8, reason = True, "fp8"
        decisions.append(LayerDecision(fqn, k, n, fp8, reason, aliases))
    return decisions


def check_module_filter(owner: str, module_filter: Any) -> None:
    """``module_filter`` must be callable as ``module_filter(module, fqn)``: checked now, not mid-setup."""
    if module_filter is None:
        return
    if not callable(module_filter):
        raise ValueError(f"`{owner}(module_filter={module_filter!r})`: pass a callable (module, fqn) -> bool.")
    try:
        inspect.signature(module_filter).bind(nn.Identity(), "fqn")
    except TypeError as err:
        raise ValueError(
            f"`{owner}(module_filter={module_filter!r})`: it is called as module_filter(module, fqn) -> bool, with two"
            f" arguments, and cannot take them ({err}). Example: `module_filter=lambda module, fqn: 'attn' in fqn`."
        ) from None
    except ValueError:  # no signature to inspect (a builtin): trust it
        pass


@dataclass(frozen=True)
class FP8LayerPolicy:
    """Which ``nn.Linear`` layers run in fp8, beyond the rules that always hold (GEMM dims divisible by the recipe's
    block, a forward that runs): ``FP8Precision(layer_policy=FP8LayerPolicy(skip_first_last=False))``. The rules and
    their order are those of :func:`select_fp8_layers`.

    Example:
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10))
        >>> [d.fp8 for d in select_fp8_layers(model, layer_policy=FP8LayerPolicy(skip_small_layers=False))]
        [False, True, False]
    """

    # `(module, fqn) -> bool`: when given, it alone decides for every layer the hard rules leave (the two flags below
    # then do not apply). Use it to keep attention or a known-sensitive block in high precision.
    module_filter: Optional[ModuleFilter] = None
    # Keep layers too small to gain from fp8 in high precision: below the thresholds above, the casts cost more time
    # than the fp8 GEMM saves.
    skip_small_layers: bool = True
    # Keep the first and last linear layers that run as modules in high precision: usually the input projection and the
    # classifier head, where e4m3's 3 mantissa bits cost the most accuracy, and small.
    skip_first_last: bool = True

    def validate(self, owner: str) -> None:
        check_module_filter(owner, self.module_filter)
        for name in ("skip_small_layers", "skip_first_last"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{owner}({name}={getattr(self, name)!r})`: pass True or False.")


def _resolve_layer_policy(owner: str, policy: Optional[FP8LayerPolicy], **flat: Any) -> FP8LayerPolicy:
    """One validated policy from ``layer_policy=`` or the flat arguments (either, not both)."""
    resolved: FP8LayerPolicy = one_config(owner, "layer_policy", FP8LayerPolicy, policy, flat)
    resolved.validate(owner)
    return resolved


def replace_modules(root: nn.Module, replacements: dict[int, nn.Module]) -> nn.Module:
    """Put ``replacements[id(old)]`` wherever ``old`` is registered in ``root`` (every path, aliases included), so one
    module stays one module. Returns the new root if ``root`` itself is replaced."""
    if id(root) in replacements:
        return replacements[id(root)]
    targets = [(fqn, m) for fqn, m in root.named_modules(remove_duplicate=False) if id(m) in replacements]
    for fqn, old in targets:
        parent_name, _, name = fqn.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, name, replacements[id(old)])
    return root


def format_summary(decisions: list[LayerDecision]) -> str:
    """``select_fp8_layers``'s decisions as the table ``FP8Precision`` logs: one line per layer, with why.

    Example:
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10))
        >>> print(format_summary(select_fp8_layers(model, skip_first_last=False, skip_small_layers=False)))
        fp8: 1 of 2 linear layers run in fp8
          0      32 -> 64      fp8   fp8
          1      64 -> 10      high  dims 64x10 not divisible by 16 (tensorwise GEMM requirement)
    """
    n = sum(d.fp8 for d in decisions)
    lines = [f"fp8: {n} of {len(decisions)} linear layers run in fp8"]
    width = max((len(d.fqn) for d in decisions), default=5)
    for d in decisions:
        also = f" (also {', '.join(d.aliases)})" if d.aliases else ""
        lines.append(f"  {d.fqn:<{width}}  {d.in_features:>6} -> {d.out_features:<6}  {'fp8 ' if d.fp8 else 'high'}"
                     f"  {d.reason}{also}")
    return "\n".join(lines)


def _warn_if_no_fp8(decisions: list[LayerDecision], owner: str = "FP8Precision", fmt: str = "fp8") -> None:
    if not any(d.fp8 for d in decisions):
        warn(
            f"{owner}: no linear layer runs in {fmt}, so it trains as plain mixed precision. "
            + (
                "Reasons: " + "; ".join(sorted({d.reason for d in decisions}))
                + ". Choose layers with `layer_policy=FP8LayerPolicy(skip_small_layers=False, skip_first_last=False)`"
                " or `FP8LayerPolicy(module_filter=...)`."
                if decisions
                else "The model has no nn.Linear."
            ),
            NoEffectWarning,
        )


_NEVER_RAN = ("converted, but its forward did not run in the first training step (its weight is used elsewhere, or no"
              " input reached it): not fp8 until it runs")


class _ForwardWatch:
    """Counts forward calls of the layers chosen for fp8. ``settle()`` (at the first backward) returns the layers that
    have not run and keeps watching only them; ``ran()`` (at each later backward) returns those that have run since:
    a layer no input reached at first (an expert a mixture of experts does not call while no token is routed to it)
    computes in fp8 from the step it runs. The hooks are bound methods (the model pickles) and leave as layers run.
    Until the backward after their first call (the first backward; later for an idle expert), MXFP8 layers leave their
    fallback warnings to the plugin, which gives them once it knows what ran (``mxfp8_after_first_step``); ``close()``
    hands them back to the layers still watched."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self.layers = layers
        self.calls = dict.fromkeys(layers, 0)
        self.settled = False
        for m in layers.values():
            if getattr(m, _MXFP8, False):
                m._mxfp8_quiet = True
        self._handles = {fqn: m.register_forward_pre_hook(functools.partial(self._count, fqn))
                         for fqn, m in layers.items()}

    def _count(self, fqn: str, module: nn.Module, args: Any) -> None:
        self.calls[fqn] += 1

    def ran(self) -> list[str]:
        """The layers watched that have run, no longer watched."""
        ran = [fqn for fqn in self._handles if self.calls[fqn]]
        for fqn in ran:
            self._handles.pop(fqn).remove()
        return ran

    def settle(self) -> list[str]:
        """At the first backward: the layers that have not run (still watched)."""
        self.settled = True
        self.ran()
        return list(self._handles)

    @property
    def watching(self) -> bool:
        return bool(self._handles)

    def close(self) -> None:
        for fqn, handle in self._handles.items():
            handle.remove()
            # Its MXFP8 fallbacks were left to the plugin, which no longer watches it: the layer says them itself again.
            if getattr(self.layers[fqn], _MXFP8, False):
                self.layers[fqn]._mxfp8_quiet = False
        self._handles.clear()


def _warn_never_ran(paths: list[str]) -> None:
    warn(
        f"FP8Precision: {len(paths)} layer(s) chosen for fp8 did not run their forward in the first training step:"
        f" {', '.join(paths)}. If another module uses their weights directly (as nn.MultiheadAttention does with"
        " out_proj), they never compute in fp8: exclude them with `module_filter` to silence this. If no input reached"
        " them (an expert a mixture of experts skips while no token is routed to it), they compute in fp8 from the"
        " step they run. `plugin.layer_decisions` lists them as high precision until they do.",
        NoEffectWarning,
    )


# torchao's float8 training tensors do not run under torch.inference_mode (aten.to.dtype is not implemented there),
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


def _leave_inference_mode(module: nn.Module, args: Any) -> None:
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


def _restore_inference_mode(module: nn.Module, args: Any, output: Any) -> None:
    if _compiled_training():
        return
    stack = getattr(_INFERENCE_EXITS, "stack", None)
    if not stack:  # the pre-hook was traced (and stood aside) while this one runs eagerly: nothing to undo
        return
    exits = stack.pop()
    if exits is not None:
        exits.close()


_INFERENCE_HOOKS = "_lightning_precision_inference_hooks"


def _run_outside_inference_mode(layer: nn.Module) -> None:
    """Make ``layer`` (a torchao ``Float8Linear``) work under ``torch.inference_mode``: see above."""
    setattr(layer, _INFERENCE_HOOKS, (layer.register_forward_pre_hook(_leave_inference_mode),
                                      layer.register_forward_hook(_restore_inference_mode, always_call=True)))


def demote_torchao_layer(layer: nn.Module) -> None:
    """Turn a torchao ``Float8Linear`` back into an ``nn.Linear``, in place: the same module object, so its Parameters
    (and the optimizer's state of them), every hook on it and every reference to it stay valid, and ``torch.compile``
    recompiles (it guards on the module's type). ``Float8Linear`` is an ``nn.Linear`` holding the same ``weight`` and
    ``bias``; only its forward differs."""
    Float8Linear = _imports.import_quietly("torchao.float8.float8_linear").Float8Linear
    if not isinstance(layer, Float8Linear) and not getattr(layer, _MXFP8, False):
        raise TypeError(f"demote_torchao_layer: {type(layer).__name__} is not torchao's Float8Linear nor an MXFP8 layer.")
    if type(layer.weight) is not nn.Parameter:  # float8 all-gather's weight subclass casts in every forward
        raise RuntimeError("demote_torchao_layer: the layer's weight is a torchao tensor subclass (float8 all-gather"
                           " under FSDP2); it cannot return to high precision in place.")
    for handle in getattr(layer, _INFERENCE_HOOKS, ()):
        handle.remove()
    layer.__dict__.pop(_INFERENCE_HOOKS, None)
    for attribute in (_MXFP8, "kernel_preference", "scale_calculation_mode", "wgrad_with_hp", *_MXFP8_RECORD):
        layer.__dict__.pop(attribute, None)
    layer.__class__ = nn.Linear


# ---- torchao ---------------------------------------------------------------------------------------------------------


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
        _mxfp8_linear()  # fails now, with the version, if this torchao has no MXFP8 training layer
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


def torchao_scaling_family(config: Any) -> str:
    """The threshold family of a torchao config: per-tensor scaling, finer, or MXFP8."""
    if isinstance(config, MXFP8Recipe):
        return "mxfp8"
    ScalingGranularity = _imports.import_quietly("torchao.float8.config").ScalingGranularity

    granularity = config.cast_config_input.scaling_granularity
    return "tensorwise" if granularity == ScalingGranularity.TENSORWISE else "rowwise"


def convert_with_torchao(module: nn.Module, config: Any, decisions: list[LayerDecision]) -> nn.Module:
    """The chosen layers as torchao ``Float8Linear`` (same Parameter objects), by module: a layer registered under
    several names becomes one ``Float8Linear`` under all of them."""
    convert_to_float8_training = _imports.import_quietly("torchao.float8").convert_to_float8_training

    chosen = {d.fqn for d in decisions if d.fp8}
    if isinstance(config, MXFP8Recipe):
        for fqn, m, _ in _linear_layers(module):
            if fqn in chosen:
                to_mxfp8_linear(m, config, fqn)
        return module
    # torchao's public verb converts a bare nn.Linear into its Float8Linear, reusing weight and bias.
    replacements = {id(m): convert_to_float8_training(m, config=config) for fqn, m, _ in _linear_layers(module)
                    if fqn in chosen}
    for layer in replacements.values():
        layer.__class__ = _float8_linear_class()
    return replace_modules(module, replacements)


_NO_TOKENS_CLASS = "_Float8LinearNoTokens"
_CLASSES: dict[str, type] = {}


def _float8_linear_class() -> type:
    """torchao's ``Float8Linear``, able to run a call with no tokens. torchao's dynamic scale reduces the input's amax,
    which has no value over zero elements (tensorwise and rowwise alike fail): a mixture-of-experts expert that no
    token was routed to in a step would stop the fit. Such a call runs as the high-precision linear it is (zero tokens:
    an empty output, and a zero weight gradient, as fp8 would give). The class keeps torchao's name, so the model
    prints and is recognised as before, and is found again by ``lightning_precision.fp8.<its qualname>``: a converted
    model pickles (``torch.save(model)``) as torchao's did."""
    if _NO_TOKENS_CLASS not in _CLASSES:
        Float8Linear = _imports.import_quietly("torchao.float8.float8_linear").Float8Linear

        class Float8LinearNoTokens(Float8Linear):
            def forward(self, input: torch.Tensor) -> torch.Tensor:
                if input.numel() == 0:
                    return nn.functional.linear(input, self.weight, self.bias)
                return super().forward(input)

        Float8LinearNoTokens.__name__ = Float8Linear.__name__
        Float8LinearNoTokens.__qualname__ = _NO_TOKENS_CLASS
        Float8LinearNoTokens.__module__ = __name__
        _CLASSES[_NO_TOKENS_CLASS] = Float8LinearNoTokens
    return _CLASSES[_NO_TOKENS_CLASS]


def __getattr__(name: str) -> Any:
    # Unpickling a converted model looks the class up here by name; it is made on first use (torchao is optional).
    if name == _NO_TOKENS_CLASS:
        return _float8_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class MXFP8Recipe:
    """torchao's MXFP8 training (``torchao.prototype.moe_training``'s ``MXFP8Linear``): e4m3 with an e8m0 scale per
    32 elements, the scale rounded up (``"rceil"``), for input, weight and gradients. ``emulate`` runs the same casts
    with torch ops (any device); ``wgrad_with_hp`` computes the weight gradient in high precision."""

    emulate: bool = False
    wgrad_with_hp: bool = False


_MXFP8 = "_lightning_precision_mxfp8"
MXFP8_TOKENS = 32  # the backward casts the tokens (batch x sequence) in blocks of 32 too


def _mxfp8_linear() -> Any:
    """torchao's MXFP8 training layer, or an error naming what this torchao lacks. It moved between torchao releases
    (``mx_formats.mx_linear.MXLinear`` up to 0.11); one API is supported, the current one."""
    _imports.require(_imports.TORCHAO_AVAILABLE, "torchao", "FP8Precision(recipe='mxfp8')")
    try:
        return _imports.import_quietly("torchao.prototype.moe_training.mxfp8_linear")
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


def to_mxfp8_linear(layer: nn.Linear, recipe: MXFP8Recipe, name: Optional[str] = None) -> None:
    """Make ``layer`` compute in MXFP8, in place (the same module and Parameters, as ``demote_torchao_layer`` undoes).
    ``name``: its path in the model, named when a call falls back to high precision."""
    mx = _mxfp8_linear()
    kernels = _imports.import_quietly("torchao.quantization.quantize_.common").KernelPreference
    modes = _imports.import_quietly("torchao.prototype.mx_formats.config").ScaleCalculationMode
    layer.kernel_preference = kernels.EMULATED if recipe.emulate else kernels.AUTO
    layer.scale_calculation_mode = modes.RCEIL
    layer.wgrad_with_hp = recipe.wgrad_with_hp
    for attribute, value in _MXFP8_RECORD.items():
        setattr(layer, attribute, value)
    layer._mxfp8_name = name
    setattr(layer, _MXFP8, True)
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
            def forward(self, input: torch.Tensor) -> torch.Tensor:
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
                if training and not self._mxfp8_ran:
                    self._mxfp8_ran = True
                with torch.autocast(device, enabled=False):  # torchao's casts take contiguous tensors only
                    return _mxfp8_forward(self, input.to(dtype).contiguous(), self.weight.to(dtype))

        _MXFP8_CLASS[base] = AutocastMXFP8Linear
    return _MXFP8_CLASS[base]


def _mxfp8_fallback_message(name: Optional[str], tokens: int, dtype: torch.dtype) -> str:
    layer = f"layer {name!r}" if name else "an MXFP8 layer"
    return (f"MXFP8: {layer} ran a call of {tokens} tokens in {dtype}: not a multiple of {MXFP8_TOKENS}, the block"
            " MXFP8's backward casts the tokens (batch x sequence) in. Its calls of a multiple of 32 tokens run in"
            " MXFP8, so it stays an MXFP8 layer. To run every step in MXFP8: `drop_last=True` in the DataLoader (an"
            " epoch's short last batch), or batch x sequence a multiple of 32.")


def _short_reason(tokens: int, dtype: torch.dtype) -> str:
    return (f"MXFP8 layer, but every training call so far had {tokens} tokens, not a multiple of {MXFP8_TOKENS} (the"
            f" block MXFP8's backward casts tokens in): it ran in {dtype}, not fp8")


def mxfp8_after_first_step(layers: Mapping[str, nn.Module], dtype: torch.dtype, owner: str = "FP8Precision",
                           ran: Optional[Iterable[str]] = None) -> dict[str, str]:
    """After the first training backward: the MXFP8 layers among ``layers`` whose every call fell back to ``dtype``
    (tokens not a multiple of 32), each with the reason it is not fp8 (a ``LayerDecision.reason``), said in one
    warning with a fix that works for them. A layer that ran some calls in MXFP8 stays an MXFP8 layer, its fallback
    warned (named). From here on, each layer warns by itself at its first fallback. ``ran``: the layers judged now
    (default: all of ``layers``); the others (an expert no token reached in the first step) stay quiet until the
    backward after their first call, when this is called again with them in ``ran`` (``layers`` still all of them, so
    the fix knows whether other layers ran in MXFP8)."""
    judged = set(layers) if ran is None else set(ran)
    every = {fqn: m for fqn, m in layers.items() if getattr(m, _MXFP8, False)}
    mx = {fqn: m for fqn, m in every.items() if fqn in judged}
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
               f" {set(short)!r}` (it replaces the default layer rules), or give them a multiple of 32 tokens (a"
               " batch size that is, for a head that sees one token per sample).")
    else:
        fix = ("No MXFP8 layer ran in MXFP8: batch x sequence is what is short. Make it a multiple of 32 (pad sequences"
               " to a multiple of 32, e.g. a tokenizer's `pad_to_multiple_of=32`, or choose such a batch size).")
    warn(f"{owner}(recipe='mxfp8'): {len(short)} layer(s) ran every training call of the first step they ran in"
         f" {dtype}, not in MXFP8, because the tokens reaching them are not a multiple of {MXFP8_TOKENS} (the block"
         f" MXFP8's backward casts tokens in): {named}. `layer_decisions` and `precision/fp8_layers` count them as not"
         f" fp8 (and as fp8 again if a later call runs in MXFP8). {fix}", NoEffectWarning)
    return {fqn: _short_reason(tokens, dtype) for fqn, tokens in short.items()}


def _mxfp8_forward(layer: nn.Module, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``MXFP8Linear.forward`` with the weight in the input's dtype: torchao's forward passes ``self.weight`` as is,
    so its (prototype) matmul function is called directly, as that forward does."""
    mx = _mxfp8_linear()
    output = mx._to_mxfp8_then_scaled_mm(input, weight, kernel_preference=layer.kernel_preference,
                                        scale_calculation_mode=layer.scale_calculation_mode,
                                        wgrad_with_hp=layer.wgrad_with_hp)
    return output if layer.bias is None else output + layer.bias.to(output.dtype)


def with_float8_all_gather(config: Any) -> Any:
    """``config`` with torchao's float8 all-gather on: FSDP2 then all-gathers these layers' weights already cast to
    fp8 (a quarter of fp32's bytes). Tensorwise scaling only (torchao's rule)."""
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True)


def float8_all_gather_possible(scaling_family: str) -> Optional[str]:
    """None if torchao's float8 all-gather can run here, else why not."""
    if scaling_family != "tensorwise":
        return f"torchao all-gathers in fp8 with tensorwise scaling only (this recipe is {scaling_family})"
    if _fsdp.process_group_backend() == "gloo" and not _fsdp.custom_all_gather_supported():
        return (f"gloo has no float8 dtype, and torch {torch.__version__} cannot give FSDP2 the uint8 all-gather that"
                " carries it (torch >= 2.8 can)")
    return None


# ---- Transformer Engine ----------------------------------------------------------------------------------------------


def _te():
    """``(transformer_engine.pytorch, transformer_engine.common.recipe)``, or an error naming the extra."""
    _imports.require(_imports.TRANSFORMER_ENGINE_AVAILABLE, "transformer-engine", "FP8Precision(backend='transformer_engine')")
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te

    return te, te_recipe


# Transformer Engine's recipe classes by our names: the one table `te_recipe` and `te_scaling_family` read.
_TE_RECIPE_CLASSES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "mxfp8": "MXFP8BlockScaling",
    "block": "Float8BlockScaling",
    TE_NVFP4: "NVFP4BlockScaling",
}


def te_recipe(recipe: Any, owner: str = "FP8Precision") -> Any:
    """A Transformer Engine recipe from a name (``"delayed"``, ``"current"``, ``"mxfp8"``, ``"block"``, ``"nvfp4"``),
    a mapping ``{"name": ..., **recipe_kwargs}``, or a recipe object (returned as is)."""
    _, recipes = _te()
    if isinstance(recipe, recipes.Recipe):
        return recipe
    name = recipe if isinstance(recipe, str) else recipe.get("name") if isinstance(recipe, Mapping) else None
    if name in _TE_RECIPE_CLASSES:
        cls = getattr(recipes, _TE_RECIPE_CLASSES[name], None)
        if cls is None:
            raise ImportError(f"`{owner}(recipe={name!r})`: Transformer Engine {_imports.version_of('transformer-engine')}"
                              f" has no {_TE_RECIPE_CLASSES[name]}; upgrade Transformer Engine.")
        kwargs = {k: v for k, v in recipe.items() if k != "name"} if isinstance(recipe, Mapping) else {}
        return cls(**kwargs)
    raise ValueError(
        f"`{owner}(backend='transformer_engine', recipe={recipe!r})`: use one of {TE_RECIPES + (TE_NVFP4,)}, a mapping"
        " such as {'name': 'delayed', 'amax_history_len': 16}, or a `transformer_engine.common.recipe` object."
    )


def te_scaling_family(recipe: Any) -> str:
    _, recipes = _te()
    for name, cls in _TE_RECIPE_CLASSES.items():
        if hasattr(recipes, cls) and isinstance(recipe, getattr(recipes, cls)):
            return name
    return "custom"


def convert_with_te(module: nn.Module, decisions: list[LayerDecision]) -> nn.Module:
    """Replace the chosen ``nn.Linear`` layers and every ``nn.LayerNorm`` over the last dim with TE modules that hold
    the *same* Parameter objects (so an optimizer built before the conversion, as with Fabric, still trains them).
    ``LayerNorm(elementwise_affine=False)`` (which crashes Lightning's conversion, #21755) becomes a TE LayerNorm with
    weight 1 and bias 0, frozen: the same function. A module registered under several names is replaced once."""
    te, _ = _te()
    chosen = {d.fqn for d in decisions if d.fp8}
    linears = {id(m) for fqn, m, _ in _linear_layers(module) if fqn in chosen}
    replacements: dict[int, nn.Module] = {}
    for child in module.modules():
        if id(child) in replacements:
            continue
        if id(child) in linears:
            replacement = te.Linear(
                child.in_features, child.out_features, bias=child.bias is not None,
                params_dtype=child.weight.dtype, device=child.weight.device,
            )
            _adopt_parameters(replacement, child)
        elif isinstance(child, nn.LayerNorm) and len(child.normalized_shape) == 1:
            affine = child.weight is not None
            like = child.weight if affine else next(module.parameters(), torch.empty(0))
            replacement = te.LayerNorm(child.normalized_shape[0], eps=child.eps, params_dtype=like.dtype, device=like.device)
            if affine:
                _adopt_parameters(replacement, child)
            with torch.no_grad():
                if not affine:
                    replacement.weight.fill_(1.0)
                    replacement.weight.requires_grad_(False)
                if child.bias is None:
                    replacement.bias.zero_()
                    replacement.bias.requires_grad_(False)
        else:
            continue
        replacements[id(child)] = replacement
    return replace_modules(module, replacements)


def _adopt_parameters(new: nn.Module, old: nn.Module) -> None:
    """Give ``new`` the Parameter objects of ``old`` (same name, shape, dtype, device), keeping the attributes the new
    module set on its own Parameters (TE's tensor-parallel marks) and TE's deferred-init records (``param_init_meta``)."""
    init_meta = dict(getattr(new, "param_init_meta", {}) or {})
    for name, fresh in list(new.named_parameters(recurse=False)):
        kept = getattr(old, name, None)
        if not isinstance(kept, nn.Parameter):
            continue  # the old module had none (LayerNorm(elementwise_affine=False)): the new one's identity init stands
        if (kept.shape, kept.dtype, kept.device) != (fresh.shape, fresh.dtype, fresh.device):
            # Keeping the fresh one would train from random weights, silently: refuse.
            raise ValueError(
                f"Converting {type(old).__name__} to {type(new).__name__}: its `{name}` is {tuple(kept.shape)}"
                f" {kept.dtype} on {kept.device}, the converted module's {tuple(fresh.shape)} {fresh.dtype} on"
                f" {fresh.device}. The trained weights cannot be carried over; exclude this layer with `module_filter`."
            )
        for attribute, value in vars(fresh).items():
            setattr(kept, attribute, value)
        setattr(new, name, kept)
    if init_meta:
        new.param_init_meta.update(init_meta)


# ---- hardware --------------------------------------------------------------------------------------------------------


# fp8 tensor cores: Ada and Hopper (8.9, 9.0); MXFP8 and NVFP4 block scaling: Blackwell (10.0).
FP8_MIN_CAPABILITY = (8, 9)
MXFP8_MIN_CAPABILITY = (10, 0)


def fp8_capable(capability: tuple[int, int]) -> bool:
    return capability >= FP8_MIN_CAPABILITY


def fp8_gpu_available() -> bool:
    """A CUDA device that runs fp8 GEMMs for real."""
    return torch.cuda.is_available() and fp8_capable(torch.cuda.get_device_capability())


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
    need = MXFP8_MIN_CAPABILITY if scaling_family in BLOCK_SCALED else FP8_MIN_CAPABILITY
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


def scaling_family_of(backend: str, recipe: Any) -> str:
    """What the layer rules and hardware checks depend on: ``"tensorwise"``, ``"rowwise"`` or ``"mxfp8"`` for torchao,
    the recipe's name for Transformer Engine."""
    return torchao_scaling_family(recipe) if backend == "torchao" else te_scaling_family(recipe)


# The names before issue 14: each returned a threshold family, not a recipe name.
torchao_recipe_name = _deprecated_alias(torchao_scaling_family, "torchao_recipe_name")
te_recipe_name = _deprecated_alias(te_scaling_family, "te_recipe_name")
recipe_name_of = _deprecated_alias(scaling_family_of, "recipe_name_of")

