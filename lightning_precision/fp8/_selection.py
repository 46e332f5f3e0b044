"""Which ``nn.Linear`` layers run in fp8: the scaling families and their GEMM rules, the layer policy, the decisions and
their summary. Backend-neutral: the torchao and Transformer Engine conversions take these decisions."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from torch import nn

from lightning_precision._checks import one_config
from lightning_precision._warnings import NoEffectWarning, warn

__all__ = [
    "BACKENDS",
    "BLOCK_SCALED",
    "HYBRID_FORMAT",
    "LADDER",
    "TENSORS",
    "TE_CANDIDATES",
    "TE_NVFP4",
    "TE_RECIPES",
    "TORCHAO_CANDIDATES",
    "TORCHAO_RECIPES",
    "FP8LayerPolicy",
    "LayerDecision",
    "ModuleFilter",
    "RecipeLike",
    "SCALING_FAMILIES",
    "ScalingFamily",
    "check_module_filter",
    "format_summary",
    "functional_linears",
    "gemm_divisor",
    "linear_layers",
    "replace_modules",
    "resolve_layer_policy",
    "select_fp8_layers",
    "warn_if_no_fp8",
]

ModuleFilter = Callable[[nn.Module, str], bool]
# A recipe: its name ("tensorwise", "delayed", ...), a TE mapping {"name": "delayed", ...}, or the recipe object itself
# (torchao's Float8LinearConfig, a TE recipe). Those classes live in optional packages, hence the `Any`.
RecipeLike = str | Mapping[str, Any] | Any

# The tensors of a linear layer that fp8 casts, and the format each is cast to by default (TE's HYBRID format, and
# torchao's tensorwise recipe): e4m3fn forward, e5m2 gradients.
TENSORS = ("input", "weight", "grad_output")
HYBRID_FORMAT = {"input": "e4m3fn", "weight": "e4m3fn", "grad_output": "e5m2"}

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
TE_RECIPES = ("delayed", "current", "mxfp8", "block")
# NVFP4 is not fp8: its own plugin (NVFP4Precision) names it; the TE table below holds it beside the fp8 recipes.
TE_NVFP4 = "nvfp4"

# The formats a layer may run in (a plan's per-layer choice), and FP8Guard's ladder, most aggressive first: "fp8"
# stands for the per-tensor and per-row formats (tensorwise, rowwise, rowwise_with_gw_hp, delayed, current, block);
# below the last rung is high precision.
TORCHAO_CANDIDATES = TORCHAO_RECIPES
TE_CANDIDATES = ("delayed", "current", "mxfp8", "block", TE_NVFP4)
LADDER = (TE_NVFP4, "mxfp8", "fp8")

# The scaling family: what the layer rules, the hardware checks and a plan depend on. torchao's recipes fall in three
# (tensorwise; rowwise, rowwise_with_gw_hp included; mxfp8), Transformer Engine's recipes are each their own (delayed,
# current, mxfp8, block, nvfp4), and "custom" is a TE recipe object of another class.
ScalingFamily = Literal["tensorwise", "rowwise", "mxfp8", "nvfp4", "delayed", "current", "block", "custom"]
SCALING_FAMILIES: tuple[ScalingFamily, ...] = get_args(ScalingFamily)

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
    registered under several names is one layer, converted once). ``format``: the format it runs in when fp8 (None:
    the plugin's recipe)."""

    fqn: str
    in_features: int
    out_features: int
    fp8: bool
    reason: str
    aliases: tuple[str, ...] = ()
    format: str | None = None


def linear_layers(module: nn.Module) -> list[tuple[str, nn.Linear, tuple[str, ...]]]:
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
        id(m.out_proj): "nn.MultiheadAttention uses its weight functionally (its forward never runs, so it cannot be"
                        " fp8)"
        for m in module.modules()
        if isinstance(m, nn.MultiheadAttention) and isinstance(m.out_proj, nn.Linear)
    }


def select_fp8_layers(
    module: nn.Module,
    scaling_family: str = "tensorwise",
    module_filter: ModuleFilter | None = None,
    skip_small_layers: bool = True,
    skip_first_last: bool = True,
    *,
    layer_policy: FP8LayerPolicy | None = None,
) -> list[LayerDecision]:
    """Decide, for every ``nn.Linear`` in ``module``, whether it runs in fp8. ``scaling_family`` is what the rules
    depend on: the per-tensor, per-row or block scaling of the recipe (``FP8Precision.scaling_family``; torchao's
    ``rowwise_with_gw_hp`` is ``"rowwise"``). The choice is ``layer_policy`` (an
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
    policy = resolve_layer_policy("select_fp8_layers", layer_policy, module_filter=module_filter,
                                  skip_small_layers=skip_small_layers, skip_first_last=skip_first_last)
    module_filter, skip_small_layers, skip_first_last = (
        policy.module_filter, policy.skip_small_layers, policy.skip_first_last
    )
    linears = linear_layers(module)
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
    module_filter: ModuleFilter | None = None
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


def resolve_layer_policy(owner: str, policy: FP8LayerPolicy | None, **flat: Any) -> FP8LayerPolicy:
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


def warn_if_no_fp8(decisions: list[LayerDecision], owner: str = "FP8Precision", fmt: str = "fp8") -> None:
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

