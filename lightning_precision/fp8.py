"""fp8 training, backend-neutral: which layers run in fp8, converting them (torchao or Transformer Engine), recipes.

The pure functions here are what ``FP8Precision`` calls; use them directly where a plugin cannot go (for example inside
``configure_model`` before FSDP2's ``fully_shard``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_precision import _imports
from lightning_precision.warnings import NoEffectWarning

ModuleFilter = Callable[[nn.Module, str], bool]

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TE_RECIPES = ("delayed", "current", "mxfp8", "block")
BACKENDS = ("torchao", "transformer_engine")

# Below these GEMM sizes fp8 is slower than bf16: the cast and scale kernels cost more than the faster matmul saves.
# They are torchao's thresholds, measured on H100 (torchao/float8 README). N = out_features, K = in_features.
# Per-tensor scaling (torchao tensorwise, TE delayed/current): skip when K <= 4096 and N <= 1024.
# Finer scaling (rowwise, blockwise, MXFP8) costs more per cast: skip when N <= 2048, K <= 1024,
# or N <= 4096 and K <= 2048.
_PER_TENSOR = ("tensorwise", "delayed", "current")


def _too_small(recipe_name: str, n: int, k: int) -> bool:
    if recipe_name in _PER_TENSOR:
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


@dataclass(frozen=True)
class LayerDecision:
    """Whether one linear layer runs in fp8, and why."""

    fqn: str
    in_features: int
    out_features: int
    fp8: bool
    reason: str


def select_fp8_layers(
    module: nn.Module,
    recipe_name: str = "tensorwise",
    module_filter: Optional[ModuleFilter] = None,
    skip_small_layers: bool = True,
    skip_first_last: bool = True,
) -> list[LayerDecision]:
    """Decide, for every ``nn.Linear`` in ``module``, whether it runs in fp8. Rules, in order:

    1. GEMM dims (in and out features) must be divisible by 16: the fp8 tensor-core requirement. Always applied.
    2. ``module_filter(module, fqn)``, when given, decides alone for the rest.
    3. Otherwise the first and last linear layers stay in high precision (``skip_first_last``): they see raw inputs
       and produce logits, where fp8's 3-bit (e4m3) mantissa hurts accuracy most, and they are usually small.
    4. Layers too small to gain are skipped (``skip_small_layers``; thresholds above).
    """
    linears = [(fqn, m) for fqn, m in module.named_modules() if isinstance(m, nn.Linear)]
    edge = {linears[0][0], linears[-1][0]} if linears else set()
    decisions = []
    for fqn, linear in linears:
        n, k = linear.out_features, linear.in_features
        if n % 16 or k % 16:
            fp8, reason = False, f"dims {k}x{n} not divisible by 16 (fp8 GEMM requirement)"
        elif module_filter is not None:
            fp8 = bool(module_filter(linear, fqn))
            reason = "module_filter" if fp8 else "excluded by module_filter"
        elif skip_first_last and fqn in edge:
            fp8, reason = False, "first or last linear layer (kept in high precision for accuracy)"
        elif skip_small_layers and _too_small(recipe_name, n, k):
            fp8, reason = False, f"too small to gain ({k}x{n} is under the {recipe_name} thresholds)"
        else:
            fp8, reason = True, "fp8"
        decisions.append(LayerDecision(fqn, k, n, fp8, reason))
    return decisions


def format_summary(decisions: list[LayerDecision]) -> str:
    n = sum(d.fp8 for d in decisions)
    lines = [f"fp8: {n} of {len(decisions)} linear layers run in fp8"]
    width = max((len(d.fqn) for d in decisions), default=5)
    for d in decisions:
        lines.append(f"  {d.fqn:<{width}}  {d.in_features:>6} -> {d.out_features:<6}  {'fp8 ' if d.fp8 else 'high'}  {d.reason}")
    return "\n".join(lines)


def warn_if_no_fp8(decisions: list[LayerDecision]) -> None:
    if not any(d.fp8 for d in decisions):
        warnings.warn(
            "FP8Precision: no linear layer runs in fp8, so it trains as plain mixed precision. "
            + (
                "Reasons: " + "; ".join(sorted({d.reason for d in decisions}))
                + ". Pass `module_filter=...` or `skip_small_layers=False`/`skip_first_last=False` to choose layers."
                if decisions
                else "The model has no nn.Linear."
            ),
            NoEffectWarning,
            stacklevel=3,
        )


# ---- torchao ---------------------------------------------------------------------------------------------------------


def torchao_config(recipe: Any, emulate: bool) -> Any:
    """A ``Float8LinearConfig`` from a recipe name or a config, with ``emulate`` applied."""
    _imports.require(_imports._TORCHAO_AVAILABLE, "torchao", "FP8Precision(backend='torchao')")
    from torchao.float8 import Float8LinearConfig

    if isinstance(recipe, Float8LinearConfig):
        config = recipe
    elif isinstance(recipe, str) and recipe in TORCHAO_RECIPES:
        config = Float8LinearConfig.from_recipe_name(recipe)
    else:
        raise ValueError(
            f"`FP8Precision(backend='torchao', recipe={recipe!r})`: use one of {TORCHAO_RECIPES} or a"
            " `torchao.float8.Float8LinearConfig`."
        )
    return dataclasses.replace(config, emulate=True) if emulate and not config.emulate else config


def torchao_recipe_name(config: Any) -> str:
    """The threshold family of a torchao config: per-tensor scaling or finer."""
    from torchao.float8.config import ScalingGranularity

    granularity = config.cast_config_input.scaling_granularity
    return "tensorwise" if granularity == ScalingGranularity.TENSORWISE else "rowwise"


def convert_with_torchao(module: nn.Module, config: Any, decisions: list[LayerDecision]) -> nn.Module:
    from torchao.float8 import convert_to_float8_training

    chosen = {d.fqn for d in decisions if d.fp8}
    return convert_to_float8_training(module, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)


# ---- Transformer Engine ----------------------------------------------------------------------------------------------


def _te():
    """``(transformer_engine.pytorch, transformer_engine.common.recipe)``, or an error naming the extra."""
    _imports.require(_imports._TRANSFORMER_ENGINE_AVAILABLE, "transformer-engine", "FP8Precision(backend='transformer_engine')")
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te

    return te, te_recipe


def te_recipe(recipe: Any) -> Any:
    """A Transformer Engine recipe from a name (``"delayed"``, ``"current"``, ``"mxfp8"``, ``"block"``), a mapping
    ``{"name": ..., **recipe_kwargs}``, or a recipe object (returned as is)."""
    _, recipes = _te()
    classes = {
        "delayed": recipes.DelayedScaling,
        "current": recipes.Float8CurrentScaling,
        "mxfp8": recipes.MXFP8BlockScaling,
        "block": recipes.Float8BlockScaling,
    }
    if isinstance(recipe, recipes.Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in classes:
        return classes[recipe]()
    if isinstance(recipe, Mapping) and recipe.get("name") in classes:
        kwargs = {k: v for k, v in recipe.items() if k != "name"}
        return classes[recipe["name"]](**kwargs)
    raise ValueError(
        f"`FP8Precision(backend='transformer_engine', recipe={recipe!r})`: use one of {TE_RECIPES}, a mapping such as"
        " {'name': 'delayed', 'amax_history_len': 16}, or a `transformer_engine.common.recipe` object."
    )


def te_recipe_name(recipe: Any) -> str:
    _, recipes = _te()
    for name, cls in (("delayed", "DelayedScaling"), ("current", "Float8CurrentScaling"),
                      ("mxfp8", "MXFP8BlockScaling"), ("block", "Float8BlockScaling")):
        if isinstance(recipe, getattr(recipes, cls)):
            return name
    return "custom"


def convert_with_te(module: nn.Module, decisions: list[LayerDecision]) -> nn.Module:
    """Replace the chosen ``nn.Linear`` layers and every ``nn.LayerNorm`` over the last dim with TE modules, weights
    copied. ``LayerNorm(elementwise_affine=False)`` (which crashes Lightning's conversion, #21755) becomes a TE
    LayerNorm with weight 1 and bias 0, frozen: the same function."""
    te, _ = _te()
    chosen = {d.fqn for d in decisions if d.fp8}
    for fqn, child in list(module.named_modules()):
        if fqn in chosen:
            replacement = te.Linear(
                child.in_features, child.out_features, bias=child.bias is not None,
                params_dtype=child.weight.dtype, device=child.weight.device,
            )
            with torch.no_grad():
                replacement.weight.copy_(child.weight)
                if child.bias is not None:
                    replacement.bias.copy_(child.bias)
        elif isinstance(child, nn.LayerNorm) and len(child.normalized_shape) == 1:
            affine = child.weight is not None
            like = child.weight if affine else next(module.parameters(), torch.empty(0))
            replacement = te.LayerNorm(child.normalized_shape[0], eps=child.eps, params_dtype=like.dtype, device=like.device)
            with torch.no_grad():
                replacement.weight.copy_(child.weight if affine else torch.ones_like(replacement.weight))
                replacement.bias.copy_(child.bias if child.bias is not None else torch.zeros_like(replacement.bias))
            if not affine:
                replacement.weight.requires_grad_(False)
                replacement.bias.requires_grad_(False)
        else:
            continue
        _set_submodule(module, fqn, replacement)
    return module


def _set_submodule(root: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, name = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, name, new)


# ---- hardware --------------------------------------------------------------------------------------------------------


# fp8 tensor cores: Ada and Hopper (8.9, 9.0); MXFP8 block scaling: Blackwell (10.0).
FP8_MIN_CAPABILITY = (8, 9)
MXFP8_MIN_CAPABILITY = (10, 0)


def fp8_capable(capability: tuple[int, int]) -> bool:
    return capability >= FP8_MIN_CAPABILITY


def fp8_gpu_available() -> bool:
    """A CUDA device that runs fp8 GEMMs for real."""
    return torch.cuda.is_available() and fp8_capable(torch.cuda.get_device_capability())


def check_fp8_hardware(device_type: str, backend: str, recipe_name: str, emulate: bool) -> None:
    """fp8 GEMMs need CUDA compute capability >= 8.9 (Ada, Hopper), MXFP8 >= 10.0 (Blackwell); ``emulate=True``
    (torchao only) runs the same numerics anywhere."""
    if emulate:
        if backend != "torchao":
            raise ValueError(
                "`FP8Precision(backend='transformer_engine', emulate=True)`: Transformer Engine has no emulation."
                " Use `backend='torchao'` to emulate fp8 numerics without an fp8 GPU."
            )
        return
    need = MXFP8_MIN_CAPABILITY if recipe_name == "mxfp8" else FP8_MIN_CAPABILITY
    if device_type != "cuda":
        raise RuntimeError(
            f"FP8Precision needs a CUDA GPU with compute capability >= {need[0]}.{need[1]} for fp8 matmuls; the model"
            f" is on {device_type!r}. Pass `emulate=True` (torchao backend) to run the fp8 numerics emulated here."
        )
    found = torch.cuda.get_device_capability()
    if found < need:
        raise RuntimeError(
            f"FP8Precision ({recipe_name}) needs CUDA compute capability >= {need[0]}.{need[1]}, found"
            f" {torch.cuda.get_device_name()!r} with {found[0]}.{found[1]}. Use `BF16MixedPrecision()` on this GPU,"
            " or `FP8Precision(emulate=True)` to check fp8 numerics (slowly)."
        )


def recipe_name_of(backend: str, recipe: Any) -> str:
    return torchao_recipe_name(recipe) if backend == "torchao" else te_recipe_name(recipe)

