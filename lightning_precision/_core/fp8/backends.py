"""The two backends of ``FP8Precision``, one class each behind the protocol of ``_core.fp8.backend``: torchao's fp8
layers (tensorwise, rowwise and MXFP8 side by side, emulated anywhere, movable in place) and Transformer Engine's (one
recipe per model, under ``te.autocast``). ``make_backend`` is the one place that reads the ``backend`` argument:
everything else asks the backend object."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module

from lightning_precision._core.fp8.args import check_backend_name
from lightning_precision._core.fp8.backend import FP8Backend, LayerMover
from lightning_precision.fp8._hardware import check_fp8_hardware
from lightning_precision.fp8._selection import (
    BLOCK_SCALED,
    TE_CANDIDATES,
    TORCHAO_CANDIDATES,
    LayerDecision,
    ScalingFamily,
    format_family,
)
from lightning_precision.fp8._te import convert_with_te, import_te, te_recipe, te_scaling_family
from lightning_precision.fp8._torchao import (
    convert_with_torchao,
    float8_all_gather_possible,
    high_precision_layers,
    layer_format,
    recipe_format,
    run_outside_inference_mode,
    set_layer_format,
    torchao_config,
    torchao_format_name,
    torchao_scaling_family,
    with_float8_all_gather,
)

__all__ = ["ResolvedRecipe", "TEBackend", "TorchaoBackend", "make_backend"]

# Transformer Engine's layers compute in the one recipe of the `te.autocast` around the forward.
ONE_RECIPE = (
    "Transformer Engine runs every layer in the one recipe of `te.autocast(recipe=...)`. A different format per layer"
    " needs Transformer Engine >= 2.16's experimental `CustomRecipe` (its quantizer factory sees each module's name,"
    " `QuantizerRole.name`), which lightning-precision does not drive. Mixed per-layer formats run under"
    " `backend='torchao'` (tensorwise, rowwise, rowwise_with_gw_hp and mxfp8 side by side; `emulate=True` anywhere)."
)


def _fp8_layers(module: Module, decisions: list[LayerDecision]) -> dict[str, Module]:
    return {d.fqn: module.get_submodule(d.fqn) for d in decisions if d.fp8}


@dataclass
class ResolvedRecipe:
    """What both backends hold: the recipe resolved, and what it is."""

    name: ClassVar[str]
    precisions: ClassVar[dict[torch.dtype, str]]
    recipe: Any
    emulate: bool
    scaling_family: ScalingFamily
    recipe_format: str

    def lightning_precision(self, compute_dtype: torch.dtype) -> str:
        return self.precisions[compute_dtype]

    def check_hardware(self, device_type: str, families: Iterable[str], owner: str) -> None:
        # Block-scaled first: MXFP8 asks the most of the device.
        for family in sorted(families, key=lambda family: (family not in BLOCK_SCALED, family)):
            check_fp8_hardware(device_type, self.name, family, self.emulate, owner)


@dataclass
class TorchaoBackend(ResolvedRecipe):
    """torchao: ``Float8Linear`` and its MXFP8 layer inside bf16/fp16 autocast, each layer in its own format."""

    name: ClassVar[str] = "torchao"
    # The high-precision parts run in bf16/fp16 autocast: Lightning's own strings for them.
    precisions: ClassVar[dict[torch.dtype, str]] = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
    candidates_known: ClassVar[tuple[str, ...]] = TORCHAO_CANDIDATES
    mxfp8_takes_fp16: ClassVar[bool] = False  # "torch.float16 is not supported yet"
    moves_layers: ClassVar[bool] = True

    @classmethod
    def resolve(cls, recipe: Any, emulate: bool, owner: str) -> TorchaoBackend:
        config = torchao_config(recipe if recipe is not None else "tensorwise", emulate)
        family = torchao_scaling_family(config)
        # A config that is none of the named recipes goes by its scaling family.
        return cls(config, emulate, family, torchao_format_name(config) or family)

    def gathers_in_fp8(self) -> bool:
        return self.scaling_family == "tensorwise"

    def candidates_example(self) -> str:
        return "candidates=('tensorwise', 'rowwise')"

    def default_candidates(self, recipe_given: bool) -> tuple[str, ...]:
        # Emulated, the choice would be one of speed that emulation does not have: the recipe asked for alone.
        if recipe_given or self.emulate:
            return (self.recipe_format,)
        # What this process's GPU runs (an H100's when there is none: the plan's savings are then predicted for one).
        from lightning_precision.fp8._speed import speed_device, supported_candidates

        return supported_candidates(speed_device()[0], "torchao") or ("tensorwise",)

    def check_candidates(self, call: str, candidates: tuple[str, ...]) -> None:
        """Every torchao format runs beside the others."""

    def check_plan_formats(self, formats: Mapping[str, str | None], where: str,
                           fsdp_float8_all_gather: bool | None) -> None:
        other = {fqn: f for fqn, f in formats.items() if f is not None and f not in TORCHAO_CANDIDATES}
        if other:
            fqn, fmt = next(iter(other.items()))
            raise ValueError(f"{where}: the plan runs {len(other)} layer(s) in a format torchao does not have"
                             f" ({fqn!r}: {fmt!r}); torchao's are {', '.join(TORCHAO_CANDIDATES)} (or 'fp8': the"
                             f" plugin's recipe). Write one of them, or use the backend whose format it is.")
        if fsdp_float8_all_gather and any(format_family(f) != "tensorwise" for f in formats.values() if f is not None):
            raise ValueError(f"{where}, fsdp_float8_all_gather=True: torchao all-gathers in fp8 with tensorwise"
                             " scaling only, and the plan runs layers in other formats. Leave"
                             " `fsdp_float8_all_gather` unset, or make those layers tensorwise.")

    def float8_all_gather(self, asked: bool | None, sharded: Callable[[], bool], families: set[str],
                          owner: str) -> bool:
        if asked is False or (asked is None and not sharded()):
            return False
        # Every fp8 layer must be tensorwise: one layer of another format is enough to refuse.
        why_not = next(filter(None, map(float8_all_gather_possible, sorted(families or {self.scaling_family}))), None)
        if why_not is None:
            return True
        if asked:  # asked for explicitly (tensorwise is checked at construction)
            raise RuntimeError(f"`{owner}(fsdp_float8_all_gather=True)`: {why_not}. Leave it unset to all-gather in"
                               " the policy's dtype.")
        rank_zero_info(f"fp8: weights are all-gathered in the policy's dtype, not in fp8: {why_not}.")
        return False

    def probe_config(self) -> Any:
        return self.recipe

    def convert(self, module: Module, decisions: list[LayerDecision], float8_all_gather: bool
                ) -> tuple[Module, dict[str, Module]]:
        recipe = with_float8_all_gather(self.recipe) if float8_all_gather else self.recipe
        module = convert_with_torchao(module, recipe, decisions)
        layers = _fp8_layers(module, decisions)
        for layer in layers.values():
            run_outside_inference_mode(layer)
        return module, layers

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # Float8Linear casts to fp8 by itself

    def high_precision_context(self, module: Module | None) -> contextlib.AbstractContextManager[Any]:
        return high_precision_layers(module)  # each layer computes as the nn.Linear it is

    def movable(self, where: str) -> LayerMover:
        return self

    def layer_format(self, module: Module) -> str | None:
        return layer_format(module)

    def set_layer_format(self, module: Module, fmt: str | None, fqn: str) -> Module:
        # The plugin's own recipe where it is that format: a custom `Float8LinearConfig` keeps its settings.
        config = self.recipe if fmt is not None and recipe_format(self.recipe) == fmt else fmt
        return set_layer_format(module, config, self.emulate, fqn)

    def per_tensor_rung(self) -> str:
        own = recipe_format(self.recipe)
        return own if own in TORCHAO_CANDIDATES and own != "mxfp8" else "tensorwise"


@dataclass
class TEBackend(ResolvedRecipe):
    """Transformer Engine: ``nn.Linear``/``nn.LayerNorm`` replaced by TE modules, every layer in the one recipe of the
    ``te.autocast`` around the forward; no emulation, no format changed in place."""

    name: ClassVar[str] = "transformer_engine"
    precisions: ClassVar[dict[torch.dtype, str]] = {torch.bfloat16: "transformer-engine",
                                                    torch.float16: "transformer-engine-float16"}
    candidates_known: ClassVar[tuple[str, ...]] = TE_CANDIDATES
    mxfp8_takes_fp16: ClassVar[bool] = True
    moves_layers: ClassVar[bool] = False  # TE's modules are replaced, not swapped in place

    @classmethod
    def resolve(cls, recipe: Any, emulate: bool, owner: str) -> TEBackend:
        if emulate:
            check_fp8_hardware("cpu", cls.name, "", emulate=True)  # its error: TE has no emulation
        resolved = te_recipe(recipe if recipe is not None else "delayed", owner)
        family = te_scaling_family(resolved)
        return cls(resolved, emulate, family, family)

    def gathers_in_fp8(self) -> bool:
        return False  # torchao's, tensorwise only

    def candidates_example(self) -> str:
        return f"candidates=({self.recipe_format!r},)"

    def default_candidates(self, recipe_given: bool) -> tuple[str, ...]:
        return (self.recipe_format,)  # one recipe per model: the plugin's is its one candidate

    def check_candidates(self, call: str, candidates: tuple[str, ...]) -> None:
        if candidates != (self.recipe_format,):
            raise ValueError(f"{call}: this plugin's recipe is {self.recipe_format!r}. {ONE_RECIPE}")

    def check_plan_formats(self, formats: Mapping[str, str | None], where: str,
                           fsdp_float8_all_gather: bool | None) -> None:
        named = {fqn: f for fqn, f in formats.items() if f is not None}
        if not named:
            return
        distinct = sorted(set(named.values()))
        if any(f not in TE_CANDIDATES for f in distinct):
            fix = (f"Transformer Engine's are {', '.join(TE_CANDIDATES)} (or 'fp8': the plugin's recipe); torchao's"
                   " formats run with `backend='torchao'`.")
        elif len(distinct) == 1:
            fix = (f"This plugin's recipe is {self.recipe_format!r}: pass `recipe={distinct[0]!r}` to run them in"
                   f" it. {ONE_RECIPE}")
        else:
            fix = ONE_RECIPE
        shown = ", ".join(f"{fqn}: {f}" for fqn, f in list(named.items())[:4]) + (", ..." if len(named) > 4 else "")
        raise ValueError(f"{where}: the plan runs layers in {', '.join(map(repr, distinct))} beside this plugin's"
                         f" {self.recipe_format!r} ({shown}). {fix}")

    def float8_all_gather(self, asked: bool | None, sharded: Callable[[], bool], families: set[str],
                          owner: str) -> bool:
        return False  # refused at construction: torchao's, tensorwise only

    def probe_config(self) -> Any:
        # Block-scaled recipes are measured with their own block casts; per-tensor ones through torchao's emulation of
        # the same per-tensor scaling.
        if self.scaling_family in (*BLOCK_SCALED, "block"):
            return self.scaling_family
        return torchao_config("tensorwise", emulate=True)

    def convert(self, module: Module, decisions: list[LayerDecision], float8_all_gather: bool
                ) -> tuple[Module, dict[str, Module]]:
        module = convert_with_te(module, decisions)
        return module, _fp8_layers(module, decisions)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        te, _ = import_te()
        with te.autocast(enabled=True, recipe=self.recipe):
            yield

    def high_precision_context(self, module: Module | None) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # outside `te.autocast` TE's modules compute in their parameters' dtype

    def movable(self, where: str) -> LayerMover:
        raise RuntimeError(f"{where}: Transformer Engine layers cannot return to high precision in place, nor change"
                           " format (NVFP4 included); only torchao's can (backend='torchao').")


def make_backend(name: str, owner: str, recipe: Any = None, emulate: bool = False,
                 like: FP8Backend | None = None) -> FP8Backend:
    """The backend ``name`` (``"torchao"`` or ``"transformer_engine"``) with ``recipe`` resolved now, so that a bad
    recipe or a missing package fails at construction, not mid-setup; or, with ``like``, holding ``like``'s resolved
    recipe as it is (the plugin's ``backend`` set by hand)."""
    check_backend_name(owner, name)
    cls: type[TorchaoBackend | TEBackend] = TorchaoBackend if name == "torchao" else TEBackend
    if like is not None:
        return cls(like.recipe, like.emulate, like.scaling_family, like.recipe_format)
    return cls.resolve(recipe, emulate, owner)
