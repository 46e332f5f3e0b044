"""``FP8Precision``'s arguments, checked at construction (a bad plan path or an impossible combination fails there, not
mid-fit): each error repeats the call and says the fix.

``fp8._plan`` is imported where it is used: imported with this module, it would take the Trainer plugin's chain of
imports past the 8 levels allowed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_precision import _imports
from lightning_precision._core.scaling.scaler import ScalerConfig, resolve_scaler_config
from lightning_precision._warnings import warn
from lightning_precision.fp8._selection import BACKENDS, TE_NVFP4, FP8LayerPolicy, ModuleFilter, resolve_layer_policy

if TYPE_CHECKING:
    from lightning_precision._core.fp8.backend import FP8Backend
    from lightning_precision.fp8._plan import PlanLike, PlanRule, PrecisionPlan

__all__ = ["FP8Args", "check_backend_name", "check_eval_gather", "check_fp8_args", "check_plan_formats",
           "check_precision_args", "decision_format", "shown_layers"]


@dataclass(frozen=True)
class FP8Args:
    """Which layers run in fp8 and how they are chosen, checked (the arguments of ``FP8Precision`` of those names)."""

    fsdp_float8_all_gather: bool | None
    layers: PlanLike | None
    calibration_batches: int | None
    plan_rule: PlanRule | None
    candidates: tuple[str, ...]  # with `layers="auto"`, the formats each layer chooses among
    plan: PrecisionPlan | None  # the plan `layers` gives, loaded


def check_eval_gather(owner: str, eval_precision: str | None, fsdp_float8_all_gather: bool | None) -> None:
    """Evaluation without fp8 runs each fp8 layer as a plain linear layer, which a weight all-gathered in fp8 (a
    torchao tensor subclass that casts in every forward) cannot."""
    if eval_precision is not None and fsdp_float8_all_gather is True:
        raise ValueError(
            f"`{owner}(fsdp_float8_all_gather=True, eval_precision={eval_precision!r})`: the fp8 layers' weights"
            " are then torchao tensor subclasses that cast to fp8 in every forward, so evaluation cannot run without"
            " fp8. Drop one: `eval_precision=None` evaluates in fp8, as it trains."
        )


def check_backend_name(owner: str, name: Any) -> None:
    if name not in BACKENDS:
        raise ValueError(f"`{owner}(backend={name!r})`: use 'torchao' or 'transformer_engine'.")


def check_precision_args(owner: str, backend: Any, compute_dtype: torch.dtype, layer_policy: FP8LayerPolicy | None,
                         module_filter: ModuleFilter | None, skip_small_layers: bool, skip_first_last: bool,
                         scaler: ScalerConfig | None, max_consecutive_skips: int | None
                         ) -> tuple[FP8LayerPolicy, ScalerConfig | None]:
    """The backend's name, the compute dtype, the layer policy (one, from ``layer_policy`` or the flat arguments) and
    the loss scaler's config (fp16 compute only): what is checked before the plugin's base class is built."""
    check_backend_name(owner, backend)
    if compute_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"`{owner}(compute_dtype={compute_dtype})`: the high-precision parts run in torch.bfloat16 (default)"
            " or torch.float16."
        )
    policy = resolve_layer_policy(owner, layer_policy, module_filter=module_filter,
                                  skip_small_layers=skip_small_layers, skip_first_last=skip_first_last)
    if scaler is not None and compute_dtype != torch.float16:
        raise ValueError(
            f"`{owner}(scaler={scaler!r})`: bf16 has fp32's exponent range, so gradients do not underflow and need"
            " no loss scaling. Remove `scaler`, or pass `compute_dtype=torch.float16` to scale the loss."
        )
    # fp16 compute always scales the loss: fp16 flushes gradients below 2**-24 where bf16 keeps them.
    config = (resolve_scaler_config(owner, scaler, max_consecutive_skips=max_consecutive_skips)
              if compute_dtype == torch.float16 else None)
    return policy, config


def check_fp8_args(owner: str, backend: FP8Backend, nvfp4: bool, recipe: Any, compute_dtype: torch.dtype,
                   policy: FP8LayerPolicy, fsdp_float8_all_gather: bool | None, layers: PlanLike | None,
                   calibration_batches: int | None, plan_rule: PlanRule | None, candidates: tuple[str, ...] | None
                   ) -> FP8Args:
    """The arguments about fp8 layers, checked against the backend (``recipe``: as passed, for the messages)."""
    if (backend.scaling_family == TE_NVFP4) != nvfp4:
        raise ValueError(f"`{owner}(recipe={recipe!r})`: NVFP4 is 4-bit, not fp8: use `NVFP4Precision()`."
                         if not nvfp4 else
                         f"`{owner}(recipe={recipe!r})`: an NVFP4 recipe ('nvfp4', a mapping"
                         " {'name': 'nvfp4', ...} or TE's NVFP4BlockScaling); `FP8Precision` takes the fp8 ones.")
    if fsdp_float8_all_gather not in (None, True, False):
        raise ValueError(f"`{owner}(fsdp_float8_all_gather={fsdp_float8_all_gather!r})`: pass None, True or False.")
    if fsdp_float8_all_gather and not backend.gathers_in_fp8():
        raise ValueError(
            f"`{owner}(fsdp_float8_all_gather=True)`: torchao all-gathers in fp8 with tensorwise scaling only; this"
            f" plugin uses {backend.name} ({backend.scaling_family}). Use `backend='torchao', recipe='tensorwise'`, or"
            " leave"
            " `fsdp_float8_all_gather` unset."
        )
    plan = _check_layers(owner, backend, layers, calibration_batches, plan_rule, fsdp_float8_all_gather,
                         policy.module_filter)
    chosen = _check_candidates(owner, backend, candidates, recipe is not None, layers, plan_rule)
    chosen = _check_fp16_mxfp8(owner, backend, recipe, compute_dtype, chosen, candidates is None, plan, layers)
    return FP8Args(fsdp_float8_all_gather, layers, calibration_batches, plan_rule, chosen, plan)


def _check_layers(owner: str, backend: FP8Backend, layers: Any, batches: Any, plan_rule: Any,
                  fsdp_float8_all_gather: bool | None, module_filter: ModuleFilter | None) -> PrecisionPlan | None:
    """``layers`` and its companions (``calibration_batches``, ``plan_rule``); a plan file loaded now (a bad path fails
    here, not mid-fit)."""
    from lightning_precision.fp8._plan import PlanRule, PrecisionPlan, as_plan

    auto = layers == "auto"
    if batches is not None:
        if not auto:
            raise ValueError(f"`{owner}(calibration_batches=...)` applies to `layers='auto'` only.")
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"`{owner}(calibration_batches={batches!r})`: a positive number of training steps,"
                             " e.g. 8.")
    if plan_rule is not None and not auto:
        raise ValueError(f"`{owner}(plan_rule=...)` applies to `layers='auto'` only.")
    if plan_rule is not None and not isinstance(plan_rule, PlanRule):
        raise ValueError(f"`{owner}(plan_rule={plan_rule!r})`: pass a `lightning_precision.fp8.PlanRule`.")
    if layers is None:
        return None
    if auto:
        _imports.require(_imports.TORCHAO_AVAILABLE, "torchao", f"{owner}(layers='auto'), which measures with torchao,")
        if fsdp_float8_all_gather:
            raise ValueError(f"`{owner}(layers='auto', fsdp_float8_all_gather=True)`: layers cannot be chosen"
                             " during sharded training. Measure first and pass the plan: see docs/plan.md.")
        return None
    if not isinstance(layers, (PrecisionPlan, str)) and not hasattr(layers, "__fspath__"):
        raise ValueError(f"`{owner}(layers={layers!r})`: None, 'auto', a PrecisionPlan or the path of a saved plan.")
    if module_filter is not None:
        raise ValueError(f"`{owner}(layers=<plan>, module_filter=...)`: a plan names its fp8 layers itself; pass one"
                         " or the other.")
    plan = as_plan(layers)
    shown = shown_layers(layers)
    check_plan_formats(plan, f"`{owner}(layers={shown})`", backend, fsdp_float8_all_gather)
    # Warned, not refused: the plan is still a valid choice of layers, and some plugins can only be given a plan
    # measured with another cast (Transformer Engine under FSDP2, block-scaled recipes that cannot be measured).
    mismatch = plan.recipe_mismatch(backend.scaling_family)
    if mismatch:
        warn(f"`{owner}(layers={shown})`: {mismatch}")
    return plan


def _check_candidates(owner: str, backend: FP8Backend, candidates: Any, recipe_given: bool, layers: Any,
                      plan_rule: PlanRule | None) -> tuple[str, ...]:
    """``candidates`` checked, or its default: the recipe asked for (one candidate: fp8 or high precision, as
    before), else what the backend and the device run."""
    from lightning_precision.fp8._decision import chooses_formats
    from lightning_precision.fp8._plan import check_candidates

    if candidates is None:
        return backend.default_candidates(recipe_given)
    if layers != "auto":
        raise ValueError(f"`{owner}(candidates={candidates!r})` applies to `layers='auto'` only: the formats it"
                         " chooses among. A plan names each layer's format itself.")
    call = f"`{owner}(layers='auto', candidates={candidates!r})`"
    checked = check_candidates(call, candidates, backend.candidates_known, backend.name, backend.candidates_example())
    backend.check_candidates(call, checked)
    if not chooses_formats(checked, plan_rule) and checked != (backend.recipe_format,):
        # Deciding measures the plugin's recipe alone, which then runs: another format would be ignored silently.
        raise ValueError(f"{call}: one candidate and no error budget decide between this plugin's recipe"
                         f" ({backend.recipe_format!r}) and high precision. Pass `recipe={checked[0]!r}` to measure and"
                         " run it, or several candidates (or `PlanRule(error_budget=...)`) to choose among formats.")
    return checked


def _check_fp16_mxfp8(owner: str, backend: FP8Backend, recipe: Any, compute_dtype: torch.dtype,
                      candidates: tuple[str, ...], default_candidates: bool, plan: PrecisionPlan | None,
                      layers: Any) -> tuple[str, ...]:
    """torchao's MXFP8 casts take bf16 or fp32 ("torch.float16 is not supported yet"): with fp16 compute an MXFP8
    recipe, candidate or plan layer is refused now, not at its first forward (after ``layers="auto"`` measured);
    the default candidates leave MXFP8 out."""
    if backend.mxfp8_takes_fp16 or compute_dtype != torch.float16:
        return candidates
    fix = "pass `compute_dtype=torch.bfloat16` (the default), or leave MXFP8 out"
    if backend.recipe_format == "mxfp8":
        raise ValueError(f"`{owner}(recipe={recipe!r}, compute_dtype=torch.float16)`: torchao's MXFP8 casts take"
                         f" bf16 or fp32, not fp16; {fix}.")
    if default_candidates:
        candidates = tuple(c for c in candidates if c != "mxfp8") or ("tensorwise",)
    elif "mxfp8" in candidates:
        raise ValueError(f"`{owner}(layers='auto', candidates={candidates!r}, compute_dtype=torch.float16)`:"
                         f" torchao's MXFP8 casts take bf16 or fp32, not fp16; {fix} of `candidates`.")
    mx = [p.fqn for p in plan.layers if decision_format(p.precision, backend.recipe_format) == "mxfp8"] if plan else []
    if mx:
        raise ValueError(f"`{owner}(layers={shown_layers(layers)}, compute_dtype=torch.float16)`: the plan runs"
                         f" {len(mx)} layer(s) in MXFP8 ({mx[0]!r}: 'mxfp8'), whose torchao casts take bf16 or fp32,"
                         f" not fp16; {fix} of the plan (write another format for those layers).")
    return candidates


def shown_layers(layers: Any) -> str:
    """A plan given as ``layers``, as a message shows it: its path, or ``<PrecisionPlan>``."""
    return repr(str(layers)) if isinstance(layers, str) or hasattr(layers, "__fspath__") else "<PrecisionPlan>"


def decision_format(precision: str, recipe_format: str) -> str | None:
    """The ``LayerDecision.format`` of a plan's low-precision layer: None where it runs the plugin's recipe (``"fp8"``,
    or the recipe's own name ``recipe_format``), else the format's name."""
    from lightning_precision.fp8._plan import FP8

    return None if precision in (FP8, recipe_format) else precision


def check_plan_formats(plan: PrecisionPlan, where: str, backend: FP8Backend,
                       fsdp_float8_all_gather: bool | None) -> None:
    """The formats a plan names must run on the backend: torchao's side by side; under Transformer Engine, the
    plugin's one recipe."""
    formats = {p.fqn: decision_format(p.precision, backend.recipe_format) for p in plan.layers if p.low}
    backend.check_plan_formats(formats, where, fsdp_float8_all_gather)
