"""Which ``nn.Linear`` layers run in fp8: the scaling families and their GEMM rules, the layer policy, the decisions and
their summary. Backend-neutral: the torchao and Transformer Engine conversions take these decisions."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

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
    "block_stack",
    "check_module_filter",
    "format_family",
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

# The formats a layer may compute in, per backend: what `FP8Precision(candidates=...)` chooses among and what a plan's
# `precision` may name besides "fp8" (the plugin's own recipe) and the high labels.
TORCHAO_CANDIDATES = TORCHAO_RECIPES
TE_CANDIDATES = (*TE_RECIPES, TE_NVFP4)
# The rungs a failing layer steps down, most aggressive first; "fp8" stands for every per-tensor or per-row format
# (tensorwise, rowwise, rowwise_with_gw_hp, delayed, current, block). Below the last rung is high precision.
LADDER = ("nvfp4", "mxfp8", "fp8")

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


def format_family(fmt: str) -> ScalingFamily:
    """The scaling family of a format name (a candidate): what its GEMM rules and hardware checks depend on.

    Example:
        >>> format_family("rowwise_with_gw_hp"), format_family("mxfp8"), format_family("delayed")
        ('rowwise', 'mxfp8', 'delayed')
    """
    if fmt == "rowwise_with_gw_hp":
        return "rowwise"
    if fmt not in SCALING_FAMILIES or fmt == "custom":
        known = ", ".join(dict.fromkeys(TORCHAO_CANDIDATES + TE_CANDIDATES))
        raise ValueError(f"{fmt!r} is not a format; one of {known}.")
    return cast(ScalingFamily, fmt)


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
    registered under several names is one layer, converted once). ``format``: the format an fp8 layer computes in
    when it is not the plugin's recipe (``None``), e.g. ``"rowwise"`` or ``"mxfp8"`` beside tensorwise layers."""

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
    edges: Mapping[str, str] | None = None,
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
    4. Otherwise the model's edges stay in high precision (``skip_first_last``): the layers that read its input (or
       its embedding) and those that write its logits, where e4m3's 3 explicit mantissa bits cost the most accuracy.
       ``edges`` (``{fqn: reason}``, from :class:`~lightning_precision.fp8._edges.EdgeRecorder` on a forward) names
       them as seen: on DistilBERT layer 0's ``q_lin``, ``k_lin`` and ``v_lin`` and the classifier. Without ``edges``
       (or with an empty mapping: no forward was seen) the first and last linear layers in registration order stand
       in for them, among those that run as modules (rule 2's are passed over); that holds when a model registers
       its layers in forward order and its input is read by one layer (in a bare ``nn.TransformerEncoder`` the first
       is the first feed-forward ``linear1``). Besides, with ``first_last_blocks=N`` (Megatron's rule), every linear
       layer in the first and last N blocks of :func:`block_stack` stays in high precision.
    5. Layers too small to gain are skipped (``skip_small_layers``; thresholds above).

    A layer registered under several names is decided (and converted) once, under its first name; ``edges`` may name
    it by any of them. A name in ``edges`` that is no ``nn.Linear`` of ``module`` is an error (a plan of another
    model, or the names of a wrapper).

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
        >>> [d.reason for d in select_fp8_layers(model, edges={"1": "writes the logits"})][1]
        'writes the logits (kept in high precision for accuracy)'
    """
    policy = resolve_layer_policy("select_fp8_layers", layer_policy, module_filter=module_filter,
                                  skip_small_layers=skip_small_layers, skip_first_last=skip_first_last)
    module_filter, skip_small_layers, skip_first_last = (
        policy.module_filter, policy.skip_small_layers, policy.skip_first_last
    )
    linears = linear_layers(module)
    functional = functional_linears(module)
    if edges:
        edge = _named_edges(linears, edges)
    else:
        # MultiheadAttention's out_proj is registered first in a TransformerEncoder layer but never runs: choosing it
        # would protect nothing and send the first layer that runs to fp8.
        runs = [fqn for fqn, linear, _ in linears if id(linear) not in functional]
        ends = {runs[-1]: "last", runs[0]: "first"} if runs else {}  # a lone layer: "first"
        edge = {fqn: f"{end} linear layer that runs as a module" for fqn, end in ends.items()}
    blocks = _edge_blocks(module, linears, policy.first_last_blocks) if policy.first_last_blocks else {}
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
            fp8, reason = False, f"{edge[fqn]} (kept in high precision for accuracy)"
        elif id(linear) in blocks:
            fp8, reason = False, blocks[id(linear)]
        elif skip_small_layers and _too_small(scaling_family, n, k):
            fp8, reason = False, f"too small to gain ({k}x{n} is under the {scaling_family} thresholds)"
        else:
            fp8, reason = True, "fp8"
        decisions.append(LayerDecision(fqn, k, n, fp8, reason, aliases))
    return decisions


def _named_edges(linears: list[tuple[str, nn.Linear, tuple[str, ...]]], edges: Mapping[str, str]) -> dict[str, str]:
    """``edges`` keyed by each layer's first name; a name that is no linear layer of the model is an error: a silent
    miss would send an edge to fp8."""
    if not isinstance(edges, Mapping):
        raise TypeError(f"`select_fp8_layers(edges={edges!r})`: pass a mapping {{fqn: reason}}, as"
                        " `EdgeRecorder.edges()` and `edges_of` return.")
    first = {name: fqn for fqn, _, aliases in linears for name in (fqn, *aliases)}
    unknown = sorted(set(edges) - set(first))
    if unknown:
        raise ValueError(f"`select_fp8_layers(edges=...)`: {', '.join(unknown)} is no nn.Linear of this model (its"
                         f" layers: {', '.join(fqn for fqn, _, _ in linears) or 'none'}). Record the edges on this"
                         " model, under its own names (`EdgeRecorder`, `edges_of`).")
    out: dict[str, str] = {}
    for name, reason in edges.items():
        out.setdefault(first[name], reason)
    return out


def block_stack(module: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The model's stack of repeated blocks, as Megatron counts its layers: ``(path, blocks)`` of the first
    ``nn.ModuleList`` or ``nn.Sequential`` in registration order (a container before what it holds) of which at least
    two children hold an ``nn.Linear``, all of one class; the blocks are those children, in order (children without a
    linear layer, an activation or a dropout, are not blocks). None when the model has no such stack.

    DistilBERT: ``distilbert.transformer.layer`` (its ``TransformerBlock`` modules); ``nn.TransformerEncoder``: its
    ``layers``; an ``nn.Sequential`` MLP: its linear layers. A model wrapped in an ``nn.Sequential`` beside other
    modules (an input projection, a head) is passed over for the stack inside. Only the first stack counts: an
    encoder-decoder's decoder blocks are not in it.

    Example:
        >>> encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2), 3, enable_nested_tensor=False)
        >>> model = nn.Sequential(nn.Linear(8, 16), encoder)
        >>> path, blocks = block_stack(model)
        >>> path, len(blocks), type(blocks[0]).__name__
        ('1.layers', 3, 'TransformerEncoderLayer')
    """
    for path, container in module.named_modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            holders = [child for child in container if any(isinstance(m, nn.Linear) for m in child.modules())]
            if len(holders) >= 2 and len({type(child) for child in holders}) == 1:
                return path, holders
    return None


def _edge_blocks(module: nn.Module, linears: list[tuple[str, nn.Linear, tuple[str, ...]]], n: int) -> dict[int, str]:
    """``{id(linear): reason}`` for the linear layers in the first and last ``n`` blocks of ``block_stack``."""
    stack = block_stack(module)
    if stack is None:
        warn(f"FP8LayerPolicy(first_last_blocks={n}): the model has no stack of repeated blocks (an nn.ModuleList or"
             " nn.Sequential of two or more blocks of one class holding nn.Linear layers), so no block is kept in high"
             " precision. Drop first_last_blocks and name the layers with `module_filter` instead.", NoEffectWarning)
        return {}
    path, blocks = stack
    if 2 * n >= len(blocks):
        warn(f"FP8LayerPolicy(first_last_blocks={n}): `{path}` has {len(blocks)} blocks, so the first and last {n}"
             f" are all of them: no linear layer in them runs in fp8. Pass at most {(len(blocks) - 1) // 2} to keep"
             " some (0: off).")
    kept = {id(linear) for _, linear, _ in linears}
    out: dict[int, str] = {}
    for i, block in enumerate(blocks):
        if i < n or i >= len(blocks) - n:
            end = "first" if i < n else "last"
            for m in block.modules():
                if id(m) in kept:
                    out.setdefault(id(m), f"in block {i} of {len(blocks)} of `{path}`, among the {end} {n}"
                                          f" (first_last_blocks={n}: kept in high precision for accuracy)")
    return out


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
    # Megatron's "first/last N layers in high precision": every linear layer in the first and last N blocks of the
    # model's stack of repeated blocks (`block_stack`: DistilBERT's `transformer.layer`) stays in high precision.
    # 0: off. Beside `skip_first_last`, not instead of it: the embedding's readers and the head are outside the stack.
    first_last_blocks: int = 0

    def validate(self, owner: str) -> None:
        check_module_filter(owner, self.module_filter)
        for name in ("skip_small_layers", "skip_first_last"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{owner}({name}={getattr(self, name)!r})`: pass True or False.")
        n = self.first_last_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"`{owner}(first_last_blocks={n!r})`: pass a whole number of blocks, 0 (off) or more:"
                             " `FP8LayerPolicy(first_last_blocks=2)` keeps the first two and the last two blocks in"
                             " high precision.")
        if n and self.module_filter is not None:
            raise ValueError(f"`{owner}(module_filter=..., first_last_blocks={n})`: the module_filter decides alone,"
                             " so the blocks would not be kept. Keep them in the filter, or drop module_filter.")


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
    """``select_fp8_layers``'s decisions as the table ``FP8Precision`` logs: one line per layer, with why. An fp8 layer
    shows its own format where it has one (``LayerDecision.format``), ``fp8`` where it runs the plugin's recipe; the
    head counts each format when they are mixed.

    Example:
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10))
        >>> print(format_summary(select_fp8_layers(model, skip_first_last=False, skip_small_layers=False)))
        fp8: 1 of 2 linear layers run in fp8
          0      32 -> 64      fp8   fp8
          1      64 -> 10      high  dims 64x10 not divisible by 16 (tensorwise GEMM requirement)
    """
    labels = [(d.format or "fp8") if d.fp8 else "high" for d in decisions]
    n = sum(d.fp8 for d in decisions)
    head = f"fp8: {n} of {len(decisions)} linear layers run in fp8"
    counts = {label: labels.count(label) for label in labels if label != "high"}
    if any(d.fp8 and d.format for d in decisions):
        head += " (" + ", ".join(f"{label} {count}" for label, count in counts.items()) + ")"
    lines = [head]
    width = max((len(d.fqn) for d in decisions), default=5)
    label_width = max([4, *(len(label) for label in labels)])
    for d, label in zip(decisions, labels, strict=True):
        also = f" (also {', '.join(d.aliases)})" if d.aliases else ""
        lines.append(f"  {d.fqn:<{width}}  {d.in_features:>6} -> {d.out_features:<6}  {label:<{label_width}}"
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

