"""``make_plan``: a ``PrecisionPlan`` made before training by running the model on some batches: the shape rules, the
numerics of the layers they leave measured in one pass, then the decision (``_decision``): the plan
``FP8Precision(layers="auto")`` would make.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_precision.fp8._decision import chooses_formats
from lightning_precision.fp8._plan import PrecisionPlan
from lightning_precision.fp8._plan_setup import check_candidates, check_root_layer, planning_policies, recording_edges
from lightning_precision.fp8._plan_types import HighLabel, MeasuredSpeed, PlanRule, high_label
from lightning_precision.fp8._selection import (
    FP8LayerPolicy,
    ModuleFilter,
    ScalingFamily,
    format_family,
    resolve_layer_policy,
    select_fp8_layers,
)
from lightning_precision.fp8._sensitivity import (
    LayerSensitivity,
    LossFn,
    fp8_sensitivity,
    measure_candidates,
    probe_config,
)
from lightning_precision.fp8._torchao import MXFP8Recipe, torchao_scaling_family

__all__ = ["make_plan"]


def make_plan(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFn | None = None,
    recipe: Any = "tensorwise",
    plan_rule: PlanRule | None = None,
    module_filter: ModuleFilter | None = None,
    skip_small_layers: bool = True,
    skip_first_last: bool = True,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
    *,
    layer_policy: FP8LayerPolicy | None = None,
    candidates: Iterable[str] | None = None,
    device: str | None = None,
    benchmark: bool = False,
) -> PrecisionPlan:
    """Shape rules, then what fp8 would cost each layer they leave, measured on ``batches``, then the decision: the
    plan ``FP8Precision(layers="auto")`` would make, before training (the Fabric route: pass it as ``layers=``).
    Arguments as ``fp8_sensitivity`` and ``FP8Precision``: the layer choice is ``layer_policy`` or the flat
    ``module_filter``, ``skip_small_layers`` and ``skip_first_last`` (not both). The weights are not updated.

    ``candidates`` (format names, e.g. ``("tensorwise", "rowwise", "mxfp8")``): choose among them per layer
    (``PrecisionPlan.choose``): each is measured in the same pass over ``batches``, its step-time saving predicted for
    ``device`` (a GPU's name; default this process's GPU; without one, or one the speed table lacks, a prediction for
    an H100 SXM, or for a B200 where a candidate needs Blackwell: MXFP8, NVFP4; ``_speed.planning_device``) or, with
    ``benchmark=True`` on a CUDA GPU, timed on the layer's own shapes (eager; ``_timing.time_shapes``, cached), the plan
    then saying "measured on <GPU>" instead of "predicted for <GPU>"; the plan takes the most saving within
    ``plan_rule`` (its per-layer bounds and ``error_budget``). Without ``candidates`` (and without an error budget),
    ``recipe`` alone is measured and each layer is fp8 or high precision by the per-layer bounds, as before; so is
    one candidate without an error budget, measured in its own format (``_decision.chooses_formats``: the plugin's
    rule). A model that is itself an ``nn.Linear`` is refused (``check_root_layer``), and so is MXFP8 under
    ``autocast_dtype=torch.float16`` (torchao's MXFP8 casts take bf16 or fp32; the plugin refuses it too)."""
    check_root_layer("`make_plan(model=nn.Linear(...))`", model)
    if plan_rule is not None and not isinstance(plan_rule, PlanRule):
        raise ValueError(f"`make_plan(plan_rule={plan_rule!r})`: pass a `PlanRule` (`PlanRule()` for the defaults).")
    policy = resolve_layer_policy("make_plan", layer_policy, module_filter=module_filter,
                                  skip_small_layers=skip_small_layers, skip_first_last=skip_first_last)
    names = check_candidates(f"`make_plan(candidates={candidates!r})`", candidates) if candidates is not None \
        else None
    _check_fp16_mxfp8(recipe, names, autocast_dtype)
    if not chooses_formats(names, plan_rule):
        if device is not None or benchmark:
            raise ValueError("`make_plan(device=..., benchmark=...)`: savings are weighed when choosing among formats;"
                             " pass several `candidates=(...)`, or an error budget"
                             " (`plan_rule=PlanRule(error_budget=...)`), too.")
        if names is None:
            config = probe_config(recipe, "make_plan")
            family = torchao_scaling_family(config)

            def measure(layers: list[str]) -> dict[str, LayerSensitivity]:
                return fp8_sensitivity(model, batches, config, loss_fn, layers, autocast_dtype)
        else:
            fmt = names[0]  # measured in its own format, as the plugin measures its one candidate
            family = format_family(fmt)

            def measure(layers: list[str]) -> dict[str, LayerSensitivity]:
                return measure_candidates(model, batches, (fmt,), loss_fn, layers, autocast_dtype)[fmt]
        return _decided(model, policy, family, plan_rule, high_label(autocast_dtype), measure)
    names = names or check_candidates("`make_plan(candidates=None)`", (recipe,))
    if benchmark and not torch.cuda.is_available():
        raise ValueError("`make_plan(benchmark=True)`: timing the layers' formats needs a CUDA GPU; there is none"
                         " here. Leave `benchmark` off: the speed model predicts the savings (and says so).")
    # The speed model judges what is too small to gain, per format: the shape rule's size thresholds stand aside.
    shape_policy, measuring_policy = planning_policies(policy, choosing=True)
    with recording_edges(model, policy) as edges:
        measuring = select_fp8_layers(model, "tensorwise", layer_policy=measuring_policy)
        measured = measure_candidates(model, batches, names, loss_fn, [d.fqn for d in measuring if d.fp8],
                                      autocast_dtype)
    decisions = select_fp8_layers(model, "tensorwise", layer_policy=shape_policy, edges=edges())
    high = high_label(autocast_dtype)
    savings = _timed_savings(model, measured, high) if benchmark else None
    return PrecisionPlan.choose(decisions, measured, plan_rule, device, high, policy.skip_small_layers,
                                savings=savings)


def _check_fp16_mxfp8(recipe: Any, names: tuple[str, ...] | None, autocast_dtype: torch.dtype | None) -> None:
    """torchao's MXFP8 casts take bf16 or fp32, not fp16: a plan with MXFP8 layers made under fp16 autocast would be
    refused by the plugin that applies it (``FP8Precision(compute_dtype=torch.float16)``, ``args._check_fp16_mxfp8``),
    so it is refused here as there, before measuring."""
    if autocast_dtype != torch.float16:
        return
    fix = "pass `autocast_dtype=torch.bfloat16` (the default), or leave MXFP8 out"
    if names is not None and "mxfp8" in names:
        raise ValueError(f"`make_plan(candidates={names!r}, autocast_dtype=torch.float16)`: torchao's MXFP8 casts take"
                         f" bf16 or fp32, not fp16; {fix} of `candidates`.")
    if names is None and (isinstance(recipe, MXFP8Recipe) or (isinstance(recipe, str) and recipe == "mxfp8")):
        raise ValueError(f"`make_plan(recipe={recipe!r}, autocast_dtype=torch.float16)`: torchao's MXFP8 casts take"
                         f" bf16 or fp32, not fp16; {fix}.")


def _decided(model: nn.Module, policy: FP8LayerPolicy, scaling_family: ScalingFamily, plan_rule: PlanRule | None,
             high: HighLabel, measure: Callable[[list[str]], dict[str, LayerSensitivity]]) -> PrecisionPlan:
    """The plan between one format (``scaling_family``'s shape rules, measured by ``measure`` on the layers they
    leave) and high precision."""
    _, measuring_policy = planning_policies(policy, choosing=False)
    with recording_edges(model, policy) as edges:
        measuring = select_fp8_layers(model, scaling_family, layer_policy=measuring_policy)
        sensitivity = measure([d.fqn for d in measuring if d.fp8])
    decisions = select_fp8_layers(model, scaling_family, layer_policy=policy, edges=edges())
    return PrecisionPlan.decide(decisions, sensitivity, plan_rule, scaling_family, high=high)


def _timed_savings(model: nn.Module, measured: dict[str, dict[str, LayerSensitivity]],
                   high: HighLabel) -> MeasuredSpeed:
    """Each measured layer timed on this GPU in the high dtype and in each format, on its own shapes, eager."""
    from lightning_precision.fp8._timing import CudaTimer, layer_shape, time_shapes

    shapes = {fqn: layer_shape(model, fqn, s.tokens) for by_layer in measured.values() for fqn, s in by_layer.items()}
    return time_shapes(shapes, measured, high, False, CudaTimer())
