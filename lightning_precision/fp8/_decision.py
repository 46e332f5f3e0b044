"""A measured plan's decision, as pure functions over the numbers measured: which of the two rules applies
(``chooses_formats``), the entries of a plan that decides between one format and high precision (``decide_layers``),
those of a plan that chooses among formats (``choose_layers``: the most predicted saving within the rule's per-layer
bounds and error budget, solved exactly), and the layers a rule moves back to high precision (``demotions``). They
return entries; ``PrecisionPlan.decide`` and ``PrecisionPlan.choose`` hold them in a plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

from lightning_precision._warnings import warn
from lightning_precision.fp8._choice import choose_within
from lightning_precision.fp8._plan_types import (
    FP8,
    HIGH,
    FormatOption,
    HighLabel,
    LayerPlan,
    MeasuredSpeed,
    PlanRule,
    error_contribution,
    measured_numbers,
)
from lightning_precision.fp8._selection import LayerDecision, ScalingFamily, format_family, gemm_divisor

if TYPE_CHECKING:
    from lightning_precision.fp8._sensitivity import LayerSensitivity
    from lightning_precision.fp8._speed import GemmDevice

__all__ = ["Choice", "choose_layers", "chooses_formats", "decide_layers", "demotions"]

ELIGIBLE = "eligible"  # a format's verdict when it is within the rule (and, with skip_small_layers, saves time)
# The formats whose scaling family a chosen plan records (the first candidate's); any other: tensorwise.
_RECORDED_FAMILIES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def chooses_formats(candidates: Sequence[str] | None, plan_rule: PlanRule | None) -> bool:
    """Whether a measured plan chooses among formats (``choose_layers``) rather than deciding, per layer, between one
    format and high precision (``decide_layers``). The rule: it chooses where there are several distinct
    ``candidates``, or where ``plan_rule`` has a finite ``error_budget`` (a budget is spent by choosing); one candidate
    and no budget decides, on that candidate's numbers. ``candidates`` None: one recipe, as asked for. The one rule
    of ``make_plan``, the plan command and ``FP8Precision(layers="auto")``.

    Example:
        >>> chooses_formats(("tensorwise", "mxfp8"), None), chooses_formats(("rowwise",), None)
        (True, False)
        >>> chooses_formats(None, PlanRule(error_budget=0.05))
        True
    """
    return len(set(candidates or ())) > 1 or math.isfinite((plan_rule or PlanRule()).error_budget)


def demotions(sensitivity: Mapping[str, LayerSensitivity], rule: PlanRule | None = None) -> dict[str, str]:
    """The measured layers that ``rule`` rejects, each with why: what ``FP8Guard`` moves back to high precision."""
    rule = rule or PlanRule()
    failed = {fqn: rule.why_not(s) for fqn, s in sensitivity.items()}
    return {fqn: why for fqn, why in failed.items() if why}


def decide_layers(decisions: Sequence[LayerDecision], sensitivity: Mapping[str, LayerSensitivity], rule: PlanRule,
                  not_measured: str | None = None, high: HighLabel = HIGH,
                  speed: MeasuredSpeed | None = None) -> tuple[LayerPlan, ...]:
    """Per layer of the shape rules' ``decisions``, fp8 or ``high``: a layer the rules keep in high precision stays
    there for their reason; a layer they leave but ``sensitivity`` lacks stays there for ``not_measured`` (else
    because it did not run); a measured layer is fp8 where ``rule`` accepts its numbers and, where ``speed`` was timed
    (one format, on a CUDA GPU), where it was measured faster."""
    layers = []
    for d in decisions:
        s = sensitivity.get(d.fqn)
        if not d.fp8:
            layers.append(LayerPlan(d.fqn, high, d.reason))
        elif s is None:
            layers.append(LayerPlan(d.fqn, high, not_measured or "did not run while measured: nothing to judge"))
        else:
            why = rule.why_not(s)
            timed = speed is not None and d.fqn in speed.high_seconds
            fmt = next(iter(speed.low_seconds)) if speed is not None and timed else ""
            if why is None and speed is not None and timed and speed.saving(fmt, d.fqn) <= 0:
                why = speed.said(fmt, d.fqn)
            reason = "measured within the rule" + (f"; {speed.said(fmt, d.fqn)}" if speed is not None and timed
                                                   else "")
            layers.append(LayerPlan(d.fqn, high if why else FP8, why or reason, measured_numbers(s)))
    return tuple(layers)


class Choice(NamedTuple):
    """A plan that chose among formats: ``PrecisionPlan``'s fields but its ``rule``."""

    layers: tuple[LayerPlan, ...]
    scaling_family: ScalingFamily
    batches: int
    device: str
    device_here: bool
    benchmarked: bool
    baseline: float


# One format weighed for a layer, and the numbers the layer's entry keeps if it is chosen.
_Weighed = tuple[FormatOption, dict[str, float]]


@dataclass(frozen=True)
class _Weighing:
    """What each layer's formats are weighed by: their numbers (format -> layer), the rule, the GPU the savings are
    for, the high dtype they are against, and the savings timed (``savings``) instead of predicted."""

    measured: Mapping[str, Mapping[str, LayerSensitivity]]
    rule: PlanRule
    gpu: GemmDevice
    high_dtype: str
    skip_small_layers: bool
    backend: str | None
    savings: Mapping[str, Mapping[str, float]] | None
    not_measured: str | None
    speed: MeasuredSpeed | None  # the timings behind ``savings``, where the plugin timed them

    def weigh(self, d: LayerDecision, fmt: str) -> _Weighed:
        """``fmt`` for layer ``d``: its error and saving, and ``ELIGIBLE`` or why it is out."""
        from lightning_precision.fp8._speed import predicted_saving, runs

        s = self.measured[fmt].get(d.fqn)
        divisor = gemm_divisor(fmt)
        if d.in_features % divisor or d.out_features % divisor:
            why = f"dims {d.in_features}x{d.out_features} not divisible by {divisor}"
            return FormatOption(fmt, math.inf, 0.0, why), {}
        if s is None:
            return FormatOption(fmt, math.inf, 0.0, self.not_measured or "did not run while measured"), {}
        if self.savings is not None:  # timed: only what was timed is eligible, never a prediction beside timings
            saving = self.savings.get(fmt, {}).get(d.fqn)
            if saving is None:
                why = (f"{fmt} not timed: the layer took no rows while measured" if fmt in self.savings else
                       f"the {self.speed.device} does not run {fmt} (not timed)" if self.speed is not None
                       else f"{fmt} not timed (not in `savings`)")
                return FormatOption(fmt, math.inf, 0.0, why), measured_numbers(s)
        elif not runs(self.gpu, fmt, self.backend):
            return FormatOption(fmt, math.inf, 0.0, f"the {self.gpu.name} does not run {fmt}"), measured_numbers(s)
        else:
            saving = predicted_saving(fmt, s.tokens, s.in_features, s.out_features, self.gpu, self.high_dtype,
                                      self.backend)
        why_not = self.rule.why_not(s)
        if why_not is None and self.skip_small_layers and saving <= 0:
            why_not = (self.speed.said(fmt, d.fqn) if self.speed is not None else
                       f"measured slower than {self.high_dtype} on {self.gpu.name}" if self.savings is not None else
                       f"predicted slower than {self.high_dtype} on {self.gpu.name}")
        return FormatOption(fmt, error_contribution(s), saving, why_not or ELIGIBLE), measured_numbers(s)

    def baseline(self, d: LayerDecision) -> float:
        """The layer's GEMM seconds per step in the high dtype, on the most tokens any format saw it take."""
        from lightning_precision.fp8._speed import high_time

        if self.speed is not None:
            return self.speed.high_seconds.get(d.fqn, 0.0)
        tokens = max((by[d.fqn].tokens for by in self.measured.values() if d.fqn in by), default=0.0)
        return high_time(tokens, d.in_features, d.out_features, self.gpu, self.high_dtype)


def choose_layers(decisions: Sequence[LayerDecision], measured: Mapping[str, Mapping[str, LayerSensitivity]],
                  rule: PlanRule, device: str | None = None, high: HighLabel = HIGH, skip_small_layers: bool = True,
                  backend: str | None = None, savings: Mapping[str, Mapping[str, float]] | MeasuredSpeed | None = None,
                  not_measured: str | None = None) -> Choice:
    """``PrecisionPlan.choose``'s plan (the arguments are its own, ``rule`` given): per layer the shape rules leave,
    the format or high precision of the exact choice, every format weighed kept in the entry. ``savings`` as a
    ``MeasuredSpeed``: timed on this process's GPU, which the plan names."""
    # The speed model loads torchao's conversion: imported when a plan chooses, not with every plan.
    from lightning_precision.fp8._speed import planning_device

    speed = savings if isinstance(savings, MeasuredSpeed) else None
    saved = speed.savings() if speed is not None else cast("Mapping[str, Mapping[str, float]] | None", savings)
    gpu, prediction = planning_device(device, measured, backend)
    weighing = _Weighing(measured, rule, gpu, high if high != HIGH else "bf16", skip_small_layers, backend, saved,
                         not_measured, speed)
    rows = [(d, [weighing.weigh(d, fmt) for fmt in measured] if d.fp8 else []) for d in decisions]
    baseline = sum((weighing.baseline(d) for d in decisions if d.fp8), 0.0)
    picks = _picks(rows, rule, skip_small_layers, len(measured))
    budgeted = math.isfinite(rule.error_budget)
    timed = savings is not None
    layers = tuple(_entry(d, options, pick, high, budgeted, timed)
                   for (d, options), pick in zip(rows, picks, strict=True))
    batches = max((s.batches for by in measured.values() for s in by.values()), default=0)
    first = next(iter(measured), "")
    family = format_family(first) if first in _RECORDED_FAMILIES else "tensorwise"
    if speed is not None:  # the GPU this process timed on, by its own name
        return Choice(layers, family, batches, speed.device, True, True, baseline)
    return Choice(layers, family, batches, gpu.name, not prediction, timed, baseline)


def _picks(rows: list[tuple[LayerDecision, list[_Weighed]]], rule: PlanRule, skip_small_layers: bool,
           formats: int) -> list[int]:
    """The knapsack: per layer, 0 for its high precision (no error, no saving), else 1 + the index of its format."""
    bonus = 0.0 if skip_small_layers else 1.0  # > any layer's saving: a layer in low precision first
    table = [[(0.0, 0.0)] + [(o.error if o.verdict == ELIGIBLE else math.inf, o.predicted_saving + bonus)
                             for o, _ in options] for _, options in rows]
    picks, given_up = choose_within(table, rule.error_budget)
    if given_up > 0:
        warn(f"PrecisionPlan.choose: the exact choice among {formats} formats for {len(rows)} layers would"
             f" take too long (their savings track their errors too closely: a hard knapsack); the plan is the"
             f" best for an error budget at most {given_up:.3g} smaller than {rule.error_budget:g} (never above"
             " it).")
    return picks


def _entry(d: LayerDecision, options: list[_Weighed], pick: int, high: HighLabel, budgeted: bool,
           timed: bool) -> LayerPlan:
    """Layer ``d``'s entry: the format picked, or high precision and why, with every format weighed."""
    if not d.fp8:
        return LayerPlan(d.fqn, high, d.reason)
    alternatives = tuple(dataclasses.replace(o, verdict="chosen") if j + 1 == pick else o
                         for j, (o, _) in enumerate(options))
    if pick:
        chosen, numbers = options[pick - 1]
        reason = (f"{chosen.format}: the most {'measured' if timed else 'predicted'} saving"
                  f"{' within the error budget' if budgeted else ''} among the formats within the rule")
        return LayerPlan(d.fqn, chosen.format, reason, numbers, alternatives, chosen.predicted_saving)
    eligible = [o.format for o, _ in options if o.verdict == ELIGIBLE]
    if eligible:
        reason = (f"high precision: {', '.join(eligible)} within the rule, but the error budget went to layers that"
                  " save more for their error")
    elif not options:
        reason = "no format to measure"
    else:
        reason = "no format within the rule: " + "; ".join(f"{o.format}: {o.verdict}" for o, _ in options)
    numbers = min(options, key=lambda weighed: weighed[0].error)[1] if options else {}
    return LayerPlan(d.fqn, high, reason, numbers, alternatives, 0.0)
