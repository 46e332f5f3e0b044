"""The Transformer Engine backend: recipes by name, and ``nn.Linear``/``nn.LayerNorm`` replaced by TE modules that hold
the same Parameter objects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from lightning_precision import _imports
from lightning_precision.fp8._selection import (
    TE_NVFP4,
    TE_RECIPES,
    LayerDecision,
    ScalingFamily,
    linear_layers,
    replace_modules,
)

__all__ = ["adopt_parameters", "convert_with_te", "import_te", "te_recipe", "te_scaling_family"]


def import_te():
    """``(transformer_engine.pytorch, transformer_engine.common.recipe)``, or an error naming the extra."""
    _imports.require(_imports.TRANSFORMER_ENGINE_AVAILABLE, "transformer-engine",
                     "FP8Precision(backend='transformer_engine')")
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
    _, recipes = import_te()
    if isinstance(recipe, recipes.Recipe):
        return recipe
    name = recipe if isinstance(recipe, str) else recipe.get("name") if isinstance(recipe, Mapping) else None
    if name in _TE_RECIPE_CLASSES:
        cls = getattr(recipes, _TE_RECIPE_CLASSES[name], None)
        if cls is None:
            raise ImportError(f"`{owner}(recipe={name!r})`: Transformer Engine"
                              f" {_imports.version_of('transformer-engine')}"
                              f" has no {_TE_RECIPE_CLASSES[name]}; upgrade Transformer Engine.")
        kwargs = {k: v for k, v in recipe.items() if k != "name"} if isinstance(recipe, Mapping) else {}
        return cls(**kwargs)
    raise ValueError(
        f"`{owner}(backend='transformer_engine', recipe={recipe!r})`: use one of {TE_RECIPES + (TE_NVFP4,)}, a mapping"
        " such as {'name': 'delayed', 'amax_history_len': 16}, or a `transformer_engine.common.recipe` object."
    )


def te_scaling_family(recipe: Any) -> ScalingFamily:
    _, recipes = import_te()
    for name, cls in _TE_RECIPE_CLASSES.items():
        if hasattr(recipes, cls) and isinstance(recipe, getattr(recipes, cls)):
            return cast(ScalingFamily, name)
    return "custom"


def convert_with_te(module: nn.Module, decisions: list[LayerDecision]) -> nn.Module:
    """Replace the chosen ``nn.Linear`` layers and every ``nn.LayerNorm`` over the last dim with TE modules that hold
    the *same* Parameter objects (so an optimizer built before the conversion, as with Fabric, still trains them).
    ``LayerNorm(elementwise_affine=False)`` (which crashes Lightning's conversion) becomes a TE LayerNorm with
    weight 1 and bias 0, frozen: the same function. A module registered under several names is replaced once."""
    te, _ = import_te()
    chosen = {d.fqn for d in decisions if d.fp8}
    linears = {id(m) for fqn, m, _ in linear_layers(module) if fqn in chosen}
    replacements: dict[int, nn.Module] = {}
    for child in module.modules():
        if id(child) in replacements:
            continue
        if id(child) in linears:
            replacement = te.Linear(
                child.in_features, child.out_features, bias=child.bias is not None,
                params_dtype=child.weight.dtype, device=child.weight.device,
            )
            adopt_parameters(replacement, child)
        elif isinstance(child, nn.LayerNorm) and len(child.normalized_shape) == 1:
            affine = child.weight is not None
            like = child.weight if affine else next(module.parameters(), torch.empty(0))
            replacement = te.LayerNorm(child.normalized_shape[0], eps=child.eps, params_dtype=like.dtype,
                                       device=like.device)
            if affine:
                adopt_parameters(replacement, child)
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


def adopt_parameters(new: nn.Module, old: nn.Module) -> None:
    """Give ``new`` the Parameter objects of ``old`` (same name, shape, dtype, device), keeping the attributes the new
    module set on its own Parameters (TE's tensor-parallel marks) and TE's deferred-init records
    (``param_init_meta``)."""
    init_meta = dict(getattr(new, "param_init_meta", {}) or {})
    for name, fresh in list(new.named_parameters(recurse=False)):
        kept = getattr(old, name, None)
        if not isinstance(kept, nn.Parameter):
            # the old module had none (LayerNorm(elementwise_affine=False)): the new one's identity init stands
            continue
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
        new.param_init_meta.update(init_meta)  # type: ignore[union-attr,operator]  # TE's attribute
