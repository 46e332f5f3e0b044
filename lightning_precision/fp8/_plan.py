"""``PrecisionPlan``: which linear layers run in fp8, decided from measured numerics, with the reasons and numbers.

Shape rules come first (``fp8.select_fp8_layers``: divisibility, layers that never run, ``module_filter``, first and
last layers, layers too small to gain); the layers they leave are judged by ``PlanRule`` on their
``sensitivity.LayerSensitivity``. A plan prints as a table, saves and loads as YAML or JSON (by the file's suffix) and
diffs against another; ``FP8Precision(layers=plan_or_path)`` applies one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, get_args

import torch
from torch import nn

from lightning_precision._io import atomic_write_text, json_safe
from lightning_precision._warnings import warn
from lightning_precision.fp8._choice import choose_within
from lightning_precision.fp8._edges import EdgeRecorder
from lightning_precision.fp8._selection import (
    BLOCK_SCALED,
    SCALING_FAMILIES,
    TE_NVFP4,
    TE_RECIPES,
    TENSORS,
    TORCHAO_RECIPES,
    FP8LayerPolicy,
    LayerDecision,
    ModuleFilter,
    ScalingFamily,
    gemm_divisor,
    linear_layers,
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
from lightning_precision.fp8._torchao import torchao_scaling_family

__all__ = [
    "FORMATS",
    "FP8",
    "FormatOption",
    "HIGH",
    "HIGH_LABELS",
    "HighLabel",
    "LayerPlan",
    "PLAN_VERSION",
    "PlanLike",
    "PlanRule",
    "PrecisionPlan",
    "as_plan",
    "check_candidates",
    "demotions",
    "error_contribution",
    "dump_plan",
    "edge_recorder",
    "high_label",
    "make_plan",
    "measured_numbers",
    "plan_suffix",
    "planning_policies",
]

# A layer's precision in a plan: "fp8", or the high precision it runs in: the real dtype where the plan's maker knows it
# (the plugin's compute dtype, make_plan's autocast dtype), "high" where it does not (a plan decided by hand).
HighLabel = Literal["high", "bf16", "fp16", "fp32"]
HIGH_LABELS: tuple[HighLabel, ...] = get_args(HighLabel)
FP8 = "fp8"
HIGH: HighLabel = "high"
# A layer's format in a plan that chose among several (``PrecisionPlan.choose``): the recipe names of the backends.
# "fp8" in a plan means the applying plugin's own recipe.
FORMATS: tuple[str, ...] = tuple(dict.fromkeys((*TORCHAO_RECIPES, *TE_RECIPES, TE_NVFP4)))
_HIGH_OF_DTYPE: dict[torch.dtype | None, HighLabel] = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def high_label(dtype: torch.dtype | None) -> HighLabel:
    """The label of a layer kept in high precision that runs in ``dtype`` (``"high"`` where it is not known).

    Example:
        >>> high_label(torch.float16), high_label(None)
        ('fp16', 'high')
    """
    return _HIGH_OF_DTYPE.get(dtype, "high")
PLAN_VERSION = 1


# ---- what a plan holds, checked where it is made: a plan built in Python and a plan read from a file pass the same
# checks, so `save` never writes what `load` refuses. `where` names the call or the file and field.

_KIND = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping",
         type(None): "empty"}

# The `recipe` a plan may record: a plugin's `scaling_family` (torchao's families, Transformer Engine's recipe names,
# and "custom" for a TE recipe object of another class).
_SCALING_FAMILIES = SCALING_FAMILIES


def _short(text: str, width: int = 48) -> str:
    """``text`` cut to ``width`` characters, an ellipsis saying so."""
    return text if len(text) <= width else text[: width - 3] + "..."


def _shown(value: Any) -> str:
    """``2 (an integer)``: a YAML file's ``fqn: 2`` reads as a string to its author; say what the parser made of it."""
    return f"{_short(repr(value), 80)} ({_KIND.get(type(value), type(value).__name__)})"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_bound(where: str, value: Any, default: float) -> None:
    if not _is_number(value) or math.isnan(value) or value < 0:
        raise ValueError(f"{where}: {_shown(value)} is not a number >= 0 (inf: no bound); the default is {default:g}.")


def _check_count(where: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: {_shown(value)} is not a whole number >= 0 of batches measured (0: a plan made"
                         " by hand or by the shape rules).")


def _check_recipe(where: str, value: Any) -> None:
    if value not in _SCALING_FAMILIES or not isinstance(value, str):
        raise ValueError(f"{where}: {_shown(value)} is not a scaling recipe; one of {', '.join(_SCALING_FAMILIES)}"
                         " (the `scaling_family` of the plugin that measured it).")


def _check_layer(field: Callable[[str], str], fqn: Any, precision: Any, reason: Any, numbers: Any) -> None:
    """One layer's fields; ``field("fqn")`` names one of them where the error is said (a call, or a file's entry)."""
    bare = "in YAML, quote it: a bare number, yes/no, true/false or null is not text"
    if not isinstance(fqn, str) or not fqn:
        raise ValueError(f"{field('fqn')}: {_shown(fqn)} is not a layer's path; write the path of an nn.Linear in the"
                         f" model (as `model.named_modules()` names it){'' if isinstance(fqn, str) else f' ({bare})'}.")
    if not isinstance(precision, str) or precision not in (FP8, *FORMATS, *HIGH_LABELS):
        raise ValueError(f"{field('precision')}: {precision!r} is not 'fp8' (the plugin's recipe), a format"
                         f" ({', '.join(map(repr, FORMATS))}) or a high precision"
                         f" ({', '.join(map(repr, HIGH_LABELS))}: the dtype the layer runs in); write one of them.")
    if not isinstance(reason, str):
        raise ValueError(f"{field('reason')}: {_shown(reason)} is not text; write it as a string ({bare}).")
    if not isinstance(numbers, Mapping):
        raise ValueError(f"{field('numbers')}: {_shown(numbers)} is not a mapping of names to numbers; write it as"
                         " `name: value` lines, or leave it out.")
    for key, value in numbers.items():
        if not isinstance(key, str):
            raise ValueError(f"{field('numbers')}: the name {_shown(key)} is not a string ({bare}).")
        if not _is_number(value):
            raise ValueError(f"{field('numbers.' + key)}: {_shown(value)} is not a number; write a number (inf, -inf"
                             " and nan as the strings 'inf', '-inf', 'nan').")


def _field_of_entry(where: str, i: int, name: str) -> str:
    """How an error names a field of a file's ``layers[i]``."""
    return f"{where}: `layers[{i}].{name}`"


def _check_unique(where: str, fqns: Iterable[str]) -> None:
    """A layer listed twice: the first entry would apply and ``fp8_layers`` report the other."""
    first: dict[str, int] = {}
    for i, fqn in enumerate(fqns):
        if fqn in first:
            raise ValueError(f"{where}: layer {fqn!r} is listed twice (layers[{first[fqn]}] and layers[{i}]); keep one"
                             " entry per layer.")
        first[fqn] = i


@dataclass(frozen=True)
class PlanRule:
    """When a measured layer stays in high precision: any tensor's cast below ``min_sqnr_db`` or above
    ``max_underflow`` / ``max_overflow``, or the layer's fp8 output or input-gradient error above its bound.

    Defaults (docs/plan.md; ``python benchmarks/plan_numerics.py``): the linear layers of the embedded ViT and
    DistilBERT recipes measure 31.4-32.5 dB (e4m3) and 25.4-33.8 dB (e5m2), flush at most 2.5e-4 of their non-zero
    values (median 1e-5), and err by 3.4-4.4% (output) and 3.3-6.4% (input gradient). Each bound sits well outside
    that: 10 dB below the lowest SQNR, 4x the highest underflow, 2.3x the highest errors.

    ``error_budget``: when a plan chooses among several formats (``candidates``), the most summed error the whole
    model may take, each layer contributing ``error_contribution`` of its format (its output's and input gradient's
    relative noise power); ``inf`` (default): no budget, each layer takes the format that saves most among those
    within the per-layer bounds. The choice under a budget is exact (``PrecisionPlan.choose``).
    """

    min_sqnr_db: float = 15.0
    max_underflow: float = 1e-3
    max_overflow: float = 0.0
    max_output_error: float = 0.1
    max_grad_input_error: float = 0.15
    error_budget: float = math.inf

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_bound(f"`PlanRule({f.name}={value!r})`", value, cast(float, f.default))

    def why_not(self, s: LayerSensitivity) -> str | None:
        """None when ``s`` passes, else every bound it fails, as the reason for keeping it in high precision."""
        failed = []
        for tensor, n in s.tensors().items():
            if n.sqnr_db < self.min_sqnr_db:
                failed.append(f"{tensor} SQNR {n.sqnr_db:.1f} dB < {self.min_sqnr_db:g}")
            if n.underflow > self.max_underflow:
                failed.append(f"{tensor} underflow {n.underflow:.2e} > {self.max_underflow:g}")
            if n.overflow > self.max_overflow:
                failed.append(f"{tensor} overflow {n.overflow:.2e} > {self.max_overflow:g}")
        if s.output_error > self.max_output_error:
            failed.append(f"output error {s.output_error:.3f} > {self.max_output_error:g}")
        if s.grad_input_error > self.max_grad_input_error:
            failed.append(f"input-gradient error {s.grad_input_error:.3f} > {self.max_grad_input_error:g}")
        return "; ".join(failed) or None


def measured_numbers(s: LayerSensitivity) -> dict[str, float]:
    """The numbers a plan keeps for a measured layer: per tensor SQNR, underflow, overflow; output and input-gradient
    errors."""
    out = {}
    for tensor, n in s.tensors().items():
        out.update({f"{tensor}_sqnr_db": n.sqnr_db, f"{tensor}_underflow": n.underflow,
                    f"{tensor}_overflow": n.overflow})
    out.update(output_error=s.output_error, grad_input_error=s.grad_input_error)
    return out


def error_contribution(s: LayerSensitivity) -> float:
    """What a layer in a format adds to a plan's error budget: the relative noise power of its output plus that of
    the gradient it passes back (``output_error**2 + grad_input_error**2``). Noise powers of independent casts add,
    so a sum over layers estimates the model's; inf when fp8's result was not finite.

    Example:
        >>> from lightning_precision.fp8 import LayerSensitivity, TensorNumerics
        >>> n = TensorNumerics(30.0, 0.0, 0.0)
        >>> round(error_contribution(LayerSensitivity("l", 64, 64, n, n, n, 0.03, 0.04, batches=1)), 6)
        0.0025
    """
    return s.output_error ** 2 + s.grad_input_error ** 2


@dataclass(frozen=True)
class FormatOption:
    """One format a plan weighed for a layer: its ``error`` (``error_contribution``, inf when not measured), its
    ``predicted_saving`` (seconds per training step against the high precision, negative when slower) and
    ``verdict``: ``"chosen"``, ``"eligible"`` (within the rule, not chosen) or why it was out."""

    format: str
    error: float
    predicted_saving: float
    verdict: str

    def __post_init__(self) -> None:
        if not isinstance(self.format, str) or self.format not in (*FORMATS, *HIGH_LABELS):
            raise ValueError(f"FormatOption(format={_shown(self.format)}): one of {', '.join(FORMATS)} or a high"
                             " precision.")
        for name in ("error", "predicted_saving"):
            value = getattr(self, name)
            if not _is_number(value) or math.isnan(value):  # inf error: not measured; nan means nothing
                shown = repr(value) if _is_number(value) else _shown(value)
                raise ValueError(f"FormatOption({name}={shown}): a number"
                                 f"{' (inf: never fits)' if name == 'error' else ' (seconds per training step)'}.")
        if not isinstance(self.verdict, str):
            raise ValueError(f"FormatOption(verdict={_shown(self.verdict)}): text.")


@dataclass(frozen=True)
class LayerPlan:
    """One layer: ``precision`` (``"fp8"``: the plugin's recipe; a format such as ``"rowwise"`` or ``"mxfp8"``; or
    the high precision, ``"bf16"``...), why, and the measured numbers behind it (empty for a shape rule). A plan that
    chose among formats also keeps every format weighed (``alternatives``) and the chosen one's ``predicted_saving``
    (seconds per training step)."""

    fqn: str
    precision: str
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)
    alternatives: tuple[FormatOption, ...] = ()
    predicted_saving: float = 0.0

    def __post_init__(self) -> None:
        _check_layer(lambda name: f"LayerPlan({self.fqn!r}).{name}", self.fqn, self.precision, self.reason,
                     self.numbers)
        object.__setattr__(self, "alternatives", tuple(self.alternatives))
        if not all(isinstance(a, FormatOption) for a in self.alternatives):
            raise ValueError(f"LayerPlan({self.fqn!r}).alternatives: a tuple of `FormatOption`s.")
        if not _is_number(self.predicted_saving) or math.isnan(self.predicted_saving):
            raise ValueError(f"LayerPlan({self.fqn!r}).predicted_saving: {_shown(self.predicted_saving)} is not a"
                             " number (seconds per training step).")

    @property
    def low(self) -> bool:
        """Whether the layer computes in a low-precision format (fp8, MXFP8, NVFP4), not in its high precision."""
        return self.precision not in HIGH_LABELS


@dataclass(frozen=True)
class PrecisionPlan:
    """Per linear layer, fp8 (or another low-precision format) or high precision, and why. ``scaling_family`` (the
    cast measured) and ``rule`` record how it was made, ``batches`` how many batches were measured (0 for a hand-made
    plan). A plan that chose among formats (``choose``) also records the GPU its savings are for (``device``),
    whether this process ran on it (``device_here``; False: a prediction, e.g. made on a CPU), whether the savings were
    timed on it (``benchmarked``) rather than predicted by the speed model, and ``baseline``: the measured layers'
    GEMM seconds per step in high precision, against which ``predicted_saving`` reads as a fraction."""

    layers: tuple[LayerPlan, ...]
    scaling_family: ScalingFamily = "tensorwise"
    rule: PlanRule = PlanRule()
    batches: int = 0
    device: str = ""
    device_here: bool = False
    benchmarked: bool = False
    baseline: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.layers, (tuple, list)):
            raise ValueError(f"PrecisionPlan(layers={_shown(self.layers)}): a tuple of `LayerPlan`s.")
        object.__setattr__(self, "layers", tuple(self.layers))  # a list would make equal plans compare unequal
        for i, p in enumerate(self.layers):
            if not isinstance(p, LayerPlan):
                raise ValueError(f"PrecisionPlan: layers[{i}] is {_shown(p)}; each layer is a"
                                 " `LayerPlan(fqn, precision, reason)`.")
        _check_recipe("PrecisionPlan(scaling_family=...)", self.scaling_family)
        _check_count("PrecisionPlan(batches=...)", self.batches)
        if not isinstance(self.rule, PlanRule):
            raise ValueError(f"PrecisionPlan(rule={self.rule!r}): pass a `PlanRule` (`PlanRule()` for the defaults).")
        _check_unique("PrecisionPlan", (p.fqn for p in self.layers))
        if not isinstance(self.device, str):
            raise ValueError(f"PrecisionPlan(device={_shown(self.device)}): the GPU's name, as text.")
        for name in ("device_here", "benchmarked"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PrecisionPlan({name}={_shown(getattr(self, name))}): True or False.")
        if not _is_number(self.baseline) or not self.baseline >= 0:
            raise ValueError(f"PrecisionPlan(baseline={_shown(self.baseline)}): seconds per step, >= 0.")

    @property
    def predicted_saving(self) -> float:
        """Seconds per training step the plan's formats save on ``device`` against high precision, summed over the
        layers (0.0 for a plan that did not choose among formats)."""
        return sum(p.predicted_saving for p in self.layers)

    def format_of(self, fqn: str) -> str | None:
        """The format layer ``fqn`` computes in: None for high precision (or a layer the plan does not list),
        ``"fp8"`` for the applying plugin's recipe, else the format's name (``"rowwise"``, ``"mxfp8"``...)."""
        entry = self.get(fqn)
        return entry.precision if entry is not None and entry.low else None

    @classmethod
    def choose(cls, decisions: list[LayerDecision], measured: Mapping[str, Mapping[str, LayerSensitivity]],
               rule: PlanRule | None = None, device: str | None = None, high: HighLabel = HIGH,
               skip_small_layers: bool = True, backend: str | None = None,
               savings: Mapping[str, Mapping[str, float]] | None = None,
               not_measured: str | None = None) -> PrecisionPlan:
        """The plan that chooses, per layer the shape rules leave (``decisions``), one of the formats measured
        (``measured``: format -> layer -> numbers, ``measure_candidates``'s result) or high precision: the most
        predicted saving (``_speed.predicted_saving`` on ``device``, default this process's GPU, else an H100 SXM as a
        prediction) such that every chosen format passes ``rule``'s per-layer bounds and the chosen formats' summed
        ``error_contribution`` stays within ``rule.error_budget``; solved exactly (``_choice.choose``).
        ``skip_small_layers=False``: a format predicted slower than ``high`` may still be chosen (first as many layers
        in low precision as the budget allows, then the most saving), as the shape rule's flag means. ``savings``:
        seconds saved per format and layer, timed (``_speed.benchmark_saving``) instead of predicted.
        ``not_measured``: why a layer has no numbers, if not that it did not run (as ``decide``'s)."""
        from lightning_precision.fp8._speed import high_time, planning_device, predicted_saving, runs

        rule = rule or PlanRule()
        gpu, prediction = planning_device(device, measured, backend)
        high_dtype = high if high != HIGH else "bf16"
        candidates = list(measured)
        # per layer: the decision, its options [(format, error, saving, verdict, numbers)]
        rows: list[tuple[LayerDecision, list[tuple[str, float, float, str, dict[str, float]]]]] = []
        baseline = 0.0
        for d in decisions:
            if not d.fp8:
                rows.append((d, []))
                continue
            options: list[tuple[str, float, float, str, dict[str, float]]] = []
            for fmt in candidates:
                s = measured[fmt].get(d.fqn)
                divisor = gemm_divisor(fmt)
                if d.in_features % divisor or d.out_features % divisor:
                    options.append((fmt, math.inf, 0.0, f"dims {d.in_features}x{d.out_features} not divisible by"
                                                        f" {divisor}", {}))
                    continue
                if s is None:
                    options.append((fmt, math.inf, 0.0, not_measured or "did not run while measured", {}))
                    continue
                if savings is None and not runs(gpu, fmt, backend):
                    options.append((fmt, math.inf, 0.0, f"the {gpu.name} does not run {fmt}", measured_numbers(s)))
                    continue
                saving = savings[fmt][d.fqn] if savings is not None else predicted_saving(
                    fmt, s.tokens, s.in_features, s.out_features, gpu, high_dtype, backend)
                why = rule.why_not(s)
                if why is None and skip_small_layers and saving <= 0:
                    why = f"predicted slower than {high_dtype} on {gpu.name}"
                options.append((fmt, error_contribution(s), saving, why or "eligible", measured_numbers(s)))
            tokens = max((measured[f][d.fqn].tokens for f in candidates if d.fqn in measured[f]), default=0.0)
            baseline += high_time(tokens, d.in_features, d.out_features, gpu, high_dtype)
            rows.append((d, options))
        # The knapsack: option 0 of each layer is its high precision (no error, no saving).
        bonus = 0.0 if skip_small_layers else 1.0  # > any layer's saving: a layer in low precision first
        table = [[(0.0, 0.0)] + [(o[1] if o[3] == "eligible" else math.inf, o[2] + bonus) for o in options]
                 for _, options in rows]
        picks, given_up = choose_within(table, rule.error_budget)
        if given_up > 0:
            warn(f"PrecisionPlan.choose: the exact choice among {len(candidates)} formats for {len(rows)} layers would"
                 f" take too long (their savings track their errors too closely: a hard knapsack); the plan is the"
                 f" best for an error budget at most {given_up:.3g} smaller than {rule.error_budget:g} (never above"
                 " it).")
        layers = []
        budgeted = math.isfinite(rule.error_budget)
        for (d, options), pick in zip(rows, picks, strict=True):
            if not d.fp8:
                layers.append(LayerPlan(d.fqn, high, d.reason))
                continue
            alternatives = tuple(FormatOption(fmt, error, saving, "chosen" if j + 1 == pick else verdict)
                                 for j, (fmt, error, saving, verdict, _) in enumerate(options))
            if pick:
                fmt, error, saving, _, numbers = options[pick - 1]
                reason = (f"{fmt}: the most predicted saving"
                          f"{' within the error budget' if budgeted else ''} among the formats within the rule")
                layers.append(LayerPlan(d.fqn, fmt, reason, numbers, alternatives, saving))
                continue
            eligible = [o for o in options if o[3] == "eligible"]
            if eligible:
                reason = (f"high precision: {', '.join(o[0] for o in eligible)} within the rule, but the error budget"
                          " went to layers that save more for their error")
            elif not options:
                reason = "no format to measure"
            else:
                reason = "no format within the rule: " + "; ".join(f"{o[0]}: {o[3]}" for o in options)
            numbers = min(options, key=lambda o: o[1])[4] if options else {}
            layers.append(LayerPlan(d.fqn, high, reason, numbers, alternatives, 0.0))
        batches = max((s.batches for by in measured.values() for s in by.values()), default=0)
        family = torchao_scaling_family(probe_config(candidates[0])) if candidates and \
            candidates[0] in ("tensorwise", "rowwise", "rowwise_with_gw_hp") else "tensorwise"
        return cls(tuple(layers), family, rule, batches, gpu.name, not prediction, savings is not None, baseline)

    @classmethod
    def decide(cls, decisions: list[LayerDecision], sensitivity: dict[str, LayerSensitivity],
               rule: PlanRule | None = None, scaling_family: ScalingFamily = "tensorwise",
               not_measured: str | None = None, high: HighLabel = HIGH) -> PrecisionPlan:
        """The plan for layers whose shape rules are ``decisions`` and whose numerics are ``sensitivity``. A layer the
        rules leave but ``sensitivity`` lacks stays in high precision, for ``not_measured`` if given (why nothing was
        measured), else because it did not run. ``high``: the label of the layers kept in high precision (the dtype
        they run in, see ``high_label``)."""
        rule = rule or PlanRule()
        layers = []
        for d in decisions:
            s = sensitivity.get(d.fqn)
            if not d.fp8:
                layers.append(LayerPlan(d.fqn, high, d.reason))
            elif s is None:
                layers.append(LayerPlan(d.fqn, high, not_measured or "did not run while measured: nothing to judge"))
            else:
                why = rule.why_not(s)
                layers.append(LayerPlan(d.fqn, high if why else FP8, why or "measured within the rule",
                                        measured_numbers(s)))
        batches = max((s.batches for s in sensitivity.values()), default=0)
        return cls(tuple(layers), scaling_family, rule, batches)

    @classmethod
    def from_decisions(cls, decisions: list[LayerDecision], scaling_family: ScalingFamily = "tensorwise",
                       high: HighLabel = HIGH) -> PrecisionPlan:
        """The plan of layers chosen by shape rules alone (``layers=None``): nothing measured."""
        return cls(tuple(LayerPlan(d.fqn, FP8 if d.fp8 else high, d.reason) for d in decisions), scaling_family)

    @property
    def fp8_layers(self) -> frozenset[str]:
        """The layers in a low-precision format (fp8, or a plan's chosen MXFP8/NVFP4)."""
        return frozenset(p.fqn for p in self.layers if p.low)

    def get(self, fqn: str) -> LayerPlan | None:
        return next((p for p in self.layers if p.fqn == fqn), None)

    @property
    def measured(self) -> bool:
        """Whether any decision rests on numbers measured under ``scaling_family`` (not only on shape rules or by
        hand)."""
        return self.batches > 0 or any(p.numbers for p in self.layers)

    def recipe_mismatch(self, scaling_family: str) -> str | None:
        """Why this plan's numbers are not those of a plugin whose ``scaling_family`` is given, or None: they are, or
        nothing was measured. Transformer Engine's per-tensor recipes (``delayed``, ``current``) are measured through
        torchao's ``tensorwise`` cast (what ``FP8Precision(layers="auto")`` does for them), so those three agree."""
        as_measured = {"delayed": "tensorwise", "current": "tensorwise"}
        mine = self.scaling_family
        if any((p.low and p.precision != FP8) or p.alternatives for p in self.layers):
            return None  # a plan that chose among formats: each layer names its own, measured as such
        if not self.measured or as_measured.get(mine, mine) == as_measured.get(scaling_family, scaling_family):
            return None
        if scaling_family in ("tensorwise", "rowwise"):
            how = (f"`make_plan(..., recipe={scaling_family!r})`, `lightning-precision plan --recipe-fp8"
                   f" {scaling_family}`, or `layers='auto'`")
        elif scaling_family in BLOCK_SCALED or scaling_family == "block":
            how = (f"`make_plan(..., candidates=({scaling_family!r},))`, or `layers='auto'` with this plugin, which"
                   " measure its blocks")
        else:
            how = "`layers='auto'` with this plugin, on one process"
        return (f"the plan was measured with the {self.scaling_family!r} cast and this plugin casts with"
                f" {scaling_family!r}:"
                " its numbers, and the rule's verdicts on them, are another cast's. It is applied as written; to"
                f" judge the layers by this plugin's cast, measure again with its recipe ({how}).")

    def with_layer(self, fqn: str, precision: str, reason: str,
                   numbers: dict[str, float] | None = None) -> PrecisionPlan:
        """A copy with one layer's decision replaced. A layer that chose among formats keeps the formats weighed, the
        new one marked chosen (the old one: why it was left), and saves what its new format saves (0 in high
        precision, or in a format not weighed): the plan's total stays true after FP8Guard moves a layer."""
        old = self.get(fqn)
        if old is None:
            raise KeyError(f"PrecisionPlan has no layer {fqn!r}.")
        alternatives = tuple(dataclasses.replace(a, verdict="chosen" if a.format == precision else
                                                 f"left: {reason}" if a.verdict == "chosen" else a.verdict)
                             for a in old.alternatives)
        saving = next((a.predicted_saving for a in alternatives if a.verdict == "chosen"), 0.0)
        return dataclasses.replace(self, layers=tuple(
            LayerPlan(fqn, precision, reason, numbers or {}, alternatives, saving) if p.fqn == fqn else p
            for p in self.layers))

    def saving_line(self) -> str:
        """The plan's predicted saving in words: per step, as a fraction of the baseline, on which GPU, and whether it
        is a prediction."""
        how = "timed" if self.benchmarked else "predicted"
        share = f" ({self.predicted_saving / self.baseline:.1%} of the measured layers' GEMM time)" \
            if self.baseline > 0 else ""
        where = "" if self.device_here else " (a prediction: this process does not run on one)"
        return f"{how} saving {self.predicted_saving * 1e3:.3f} ms per step{share} on {self.device or 'a GPU'}{where}"

    def table(self) -> str:
        """A fixed-width table: layer, precision, the worst measured numbers, reason; for a plan that chose among
        formats, also each layer's predicted saving and error, and the formats weighed."""
        if any(p.alternatives for p in self.layers):
            return self._choice_table()
        n = len(self.fp8_layers)
        head = (f"plan ({self.scaling_family}, {self.batches} batches measured): {n} of {len(self.layers)} linear"
                " layers in fp8")
        width = max((len(p.fqn) for p in self.layers), default=5)
        lines = [head, f"  {'layer':<{width}}  prec  min SQNR dB  max underflow  out err  gin err  reason"]
        for p in self.layers:
            # A hand-made or edited plan may hold some numbers, or none: a missing one prints as "-".
            sqnr = [p.numbers[k] for k in (f"{t}_sqnr_db" for t in TENSORS) if k in p.numbers]
            under = [p.numbers[k] for k in (f"{t}_underflow" for t in TENSORS) if k in p.numbers]
            cells = [(min(sqnr) if sqnr else None, 11, ".1f"), (max(under) if under else None, 13, ".2e"),
                     (p.numbers.get("output_error"), 7, ".3f"), (p.numbers.get("grad_input_error"), 7, ".3f")]
            nums = "  ".join(f"{'-' if v is None else format(v, f):>{w}}" for v, w, f in cells)
            lines.append(f"  {p.fqn:<{width}}  {p.precision:<4}  {nums}  {p.reason}")
        return "\n".join(lines)

    def _choice_table(self) -> str:
        budget = self.rule.error_budget
        head = (f"plan ({self.batches} batches measured, error budget {'none' if math.isinf(budget) else f'{budget:g}'}"
                f"): {len(self.fp8_layers)} of {len(self.layers)} linear layers in low precision; {self.saving_line()}")
        width = max((len(p.fqn) for p in self.layers), default=5)
        fmt_width = max((len(p.precision) for p in self.layers), default=6)
        lines = [head, f"  {'layer':<{width}}  {'format':<{fmt_width}}  saving us  error     others (saving us, error)"
                       "  reason"]
        for p in self.layers:
            chosen = next((a for a in p.alternatives if a.verdict == "chosen"), None)
            error = "-" if chosen is None else f"{chosen.error:.2e}"
            others = ", ".join(f"{a.format} ({a.predicted_saving * 1e6:.1f}, {a.error:.1e})"
                               if a.verdict == "eligible" else f"{a.format} (out: {_short(a.verdict)})"
                               for a in p.alternatives if a is not chosen) or "-"
            lines.append(f"  {p.fqn:<{width}}  {p.precision:<{fmt_width}}  {p.predicted_saving * 1e6:>9.1f}  {error:<8}"
                         f"  {others}  {p.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def diff(self, other: PrecisionPlan) -> list[str]:
        """Lines ``fqn: a -> b`` for every layer whose precision differs (or is in one plan only)."""
        mine, theirs = {p.fqn: p.precision for p in self.layers}, {p.fqn: p.precision for p in other.layers}
        return [f"{fqn}: {mine.get(fqn, '-')} -> {theirs.get(fqn, '-')}" for fqn in dict.fromkeys([*mine, *theirs])
                if mine.get(fqn) != theirs.get(fqn)]

    # ---- files ------------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (what ``save`` writes): infinities and NaN as the strings ``"inf"``, ``"-inf"``,
        ``"nan"``, since strict JSON has none."""
        data: dict[str, Any] = {
            "version": PLAN_VERSION, "scaling_family": self.scaling_family, "batches": self.batches,
            "rule": json_safe(dataclasses.asdict(self.rule)),
        }
        if self.device:  # a plan that chose among formats: what its savings are for
            data.update(device=self.device, device_here=self.device_here, benchmarked=self.benchmarked,
                        baseline=self.baseline)
        data["layers"] = [_layer_dict(p) for p in self.layers]
        return data

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> PrecisionPlan:
        """The plan ``to_dict`` gave (read from a file or a checkpoint). ``source`` says where it came from in errors
        (``load`` names the file); each error names the field, the value and the fix."""
        where = source or "PrecisionPlan.from_dict"
        if not isinstance(data, Mapping):
            found = "nothing (it is empty)" if data is None else _KIND.get(type(data), type(data).__name__)
            raise ValueError(f"{where}: a plan is a mapping with `version` and `layers`, not {found}; write it with"
                             " `PrecisionPlan.save`, or see docs/plan.md.")
        version = data.get("version")
        if "version" not in data:
            raise ValueError(f"{where}: `version` is missing; add `version: {PLAN_VERSION}`.")
        if not isinstance(version, int) or isinstance(version, bool) or version != PLAN_VERSION:
            raise ValueError(f"{where}: version {_shown(version)} is not {PLAN_VERSION}, the one this package reads;"
                             f" write `version: {PLAN_VERSION}`, or read the file with the lightning-precision that"
                             " wrote it.")
        # after the version: a later format may add fields, and its plans should be refused for their version
        _check_keys(where, "the plan", data, ("version", "scaling_family", "recipe", "batches", "rule", "device",
                                              "device_here", "benchmarked", "baseline", "layers"))
        # `recipe`: the field's name in the plans written before `scaling_family`; they keep loading
        if "scaling_family" in data and "recipe" in data:
            raise ValueError(f"{where}: both `scaling_family` and `recipe` (its older name) are given; keep"
                             " `scaling_family`.")
        key = "recipe" if "recipe" in data else "scaling_family"
        scaling_family, batches = data.get(key, "tensorwise"), data.get("batches", 0)
        _check_recipe(f"{where}: `{key}`", scaling_family)
        _check_count(f"{where}: `batches`", batches)
        rule = data.get("rule", {})
        if not isinstance(rule, Mapping):
            raise ValueError(f"{where}: `rule` is {_shown(rule)}; a mapping of PlanRule's bounds (e.g."
                             " `max_underflow: 0.001`), or leave it out for the defaults.")
        _check_keys(where, "`rule`", rule, [f.name for f in dataclasses.fields(PlanRule)])
        bounds = {k: _number(v) for k, v in rule.items()}
        for f in dataclasses.fields(PlanRule):
            if f.name in bounds:
                _check_bound(f"{where}: `rule.{f.name}`", bounds[f.name], cast(float, f.default))
        if "layers" not in data:
            raise ValueError(f"{where}: `layers` is missing; list each linear layer with its `fqn` and `precision`.")
        entries = data["layers"]
        if not isinstance(entries, list):
            raise ValueError(f"{where}: `layers` is {_shown(entries)}; a list of layers, each with `fqn` and"
                             " `precision` (`layers: []` for none).")
        layers = []
        for i, d in enumerate(entries):
            at = f"{where}: `layers[{i}]`"
            if not isinstance(d, Mapping):
                raise ValueError(f"{at} is {_shown(d)}; each layer is a mapping with `fqn` and `precision`.")
            _check_keys(where, f"`layers[{i}]`", d, ("fqn", "precision", "reason", "numbers", "predicted_saving",
                                                     "alternatives"))
            missing = [k for k in ("fqn", "precision") if k not in d]
            if missing:
                raise ValueError(f"{at} has no `{missing[0]}`; each layer needs `fqn` and `precision` (fp8, or the"
                                 " high precision it runs in: high, bf16, fp16 or fp32).")
            # `reason:` or `numbers:` with nothing after it is YAML's null
            reason = "" if d.get("reason") is None else d["reason"]
            numbers = {} if d.get("numbers") is None else d["numbers"]
            numbers = {k: _number(v) for k, v in numbers.items()} if isinstance(numbers, Mapping) else numbers
            _check_layer(functools.partial(_field_of_entry, where, i), d["fqn"], d["precision"],
                         reason, numbers)
            alternatives = _alternatives(f"{where}: `layers[{i}].alternatives`", d.get("alternatives"))
            saving = _number(d.get("predicted_saving", 0.0))
            try:
                layers.append(LayerPlan(d["fqn"], d["precision"], reason, numbers, alternatives, saving))
            except ValueError as err:
                raise ValueError(f"{where}: `layers[{i}]`: {err}") from None
        _check_unique(where, (p.fqn for p in layers))
        extra = {k: data[k] for k in ("device", "device_here", "benchmarked", "baseline") if k in data}
        if "baseline" in extra:
            extra["baseline"] = _number(extra["baseline"])
        try:
            return cls(tuple(layers), scaling_family, PlanRule(**bounds), batches, **extra)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def save(self, path: str | Path) -> Path:
        """Write YAML (``.yaml``/``.yml``) or JSON (``.json``), whole or not at all: to a uniquely named temporary
        file beside it, then renamed over it (a failed write leaves any previous plan whole; two processes saving
        the same path each write whole plans; a symbolic link stays a link and its target is updated). What is
        written is read back first: ``load`` reads whatever ``save`` writes."""
        path = Path(path)
        data = self.to_dict()
        text = dump_plan(data, path)
        if PrecisionPlan.from_dict(_parse(text, path), source=f"PrecisionPlan.save({str(path)!r})").to_dict() != data:
            raise ValueError(f"PrecisionPlan.save({str(path)!r}): the text would not read back as this plan; nothing"
                             " was written. Please report it, with the plan.")
        return atomic_write_text(path, text)

    @classmethod
    def load(cls, path: str | Path) -> PrecisionPlan:
        """The plan in a ``.yaml``/``.yml``/``.json`` file; a ``ValueError`` naming the file, the field, the value and
        the fix for anything that is not a plan ``save`` could have written (YAML tags are refused)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"PrecisionPlan.load: no plan file at {str(path)!r}.")
        source = f"plan file {str(path)!r}"
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{source}: not UTF-8 text ({err.reason} at byte {err.start}); is it a plan?") from None
        return cls.from_dict(_parse(text, path, source), source=source)


def _layer_dict(p: LayerPlan) -> dict[str, Any]:
    entry: dict[str, Any] = {"fqn": p.fqn, "precision": p.precision, "reason": p.reason,
                             "numbers": json_safe(p.numbers)}
    if p.alternatives:
        entry["predicted_saving"] = p.predicted_saving
        entry["alternatives"] = [json_safe(dataclasses.asdict(a)) for a in p.alternatives]
    return entry


def _alternatives(where: str, value: Any) -> tuple[FormatOption, ...]:
    """A file's ``alternatives`` list: each a mapping of FormatOption's fields (inf as the string "inf")."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{where}: {_shown(value)} is not a list of formats weighed (each with format, error,"
                         " predicted_saving, verdict); leave it out if there are none.")
    out = []
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{at}: {_shown(entry)} is not a mapping with format, error, predicted_saving, verdict.")
        names = [f.name for f in dataclasses.fields(FormatOption)]
        _check_keys(where, f"entry {i}", entry, names)
        missing = [n for n in names if n not in entry]
        if missing:
            raise ValueError(f"{at} has no `{missing[0]}`; each entry has {', '.join(names)}.")
        try:
            out.append(FormatOption(entry["format"], _number(entry["error"]), _number(entry["predicted_saving"]),
                                    entry["verdict"]))
        except ValueError as err:
            raise ValueError(f"{at}: {err}") from None
    return tuple(out)


def _check_keys(where: str, what: str, data: Mapping[Any, Any], known: Iterable[str]) -> None:
    """A misspelt field would otherwise be ignored, and its default used in silence."""
    known = tuple(known)
    unknown = [k for k in data if k not in known]
    if unknown:
        raise ValueError(f"{where}: {what} has an unknown field {unknown[0]!r}; the fields are {', '.join(known)}.")


def _number(value: Any) -> Any:
    """A number as a file holds it: ``save`` writes inf and NaN as strings, and YAML reads ``1e-3`` (no dot) as a
    string. Anything else is returned as it is, for the check to name."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def plan_suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"PrecisionPlan: {str(path)!r}: name a .yaml, .yml or .json file.")
    return suffix


def dump_plan(data: dict[str, Any], path: Path) -> str:
    if plan_suffix(path) == ".json":
        return json.dumps(data, indent=2, allow_nan=False) + "\n"
    import yaml

    # libyaml's emitter where PyYAML has it (several times faster on a large model's plan), the same output otherwise
    return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False, width=120)


def _parse(text: str, path: Path, source: str | None = None) -> Any:
    """The data in ``text`` (JSON or YAML by ``path``'s suffix). A syntax error, a repeated key (which either parser
    would resolve by keeping the last, silently) or a YAML tag is a ``ValueError`` naming ``source`` and the line."""
    where: str = source or f"plan file {str(path)!r}"
    if plan_suffix(path) == ".json":
        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            _check_no_repeats(where, [k for k, _ in items], None)
            return dict(items)

        try:
            return json.loads(text, object_pairs_hook=pairs)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}; fix it,"
                             " or write the plan again with `PrecisionPlan.save`.") from None
    import yaml

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]  # safe: a tag such as !!python/object is refused
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):  # merge keys (<<) may repeat a key on purpose: not checked
                keys = [(self.construct_object(k, deep=True), k.start_mark.line + 1) for k, _ in node.value
                        if k.tag != "tag:yaml.org,2002:merge"]
                _check_no_repeats(where, [k for k, _ in keys], [line for _, line in keys])
            return super().construct_mapping(node, deep=deep)

    loader = Loader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ValueError(f"{where}: not a plan YAML can read: {problem}{at}; fix it (plain YAML, no tags), or write"
                         " the plan again with `PrecisionPlan.save`.") from None
    finally:
        loader.dispose()


def _check_no_repeats(source: str, keys: list[Any], lines: list[int] | None) -> None:
    seen: set[Any] = set()
    for i, key in enumerate(keys):
        try:
            repeated = key in seen
            seen.add(key)
        except TypeError:  # an unhashable key: the mapping check names it
            continue
        if repeated:
            at = f" (line {lines[i]})" if lines else ""
            raise ValueError(f"{source}: the key {key!r} appears twice in one mapping{at}; keep one.")


def demotions(sensitivity: Mapping[str, LayerSensitivity], rule: PlanRule | None = None) -> dict[str, str]:
    """The measured layers that ``rule`` rejects, each with why: what ``FP8Guard`` moves back to high precision."""
    rule = rule or PlanRule()
    failed = {fqn: rule.why_not(s) for fqn, s in sensitivity.items()}
    return {fqn: why for fqn, why in failed.items() if why}


PlanLike = PrecisionPlan | str | Path


def as_plan(layers: PlanLike) -> PrecisionPlan:
    return layers if isinstance(layers, PrecisionPlan) else PrecisionPlan.load(layers)


def planning_policies(policy: FP8LayerPolicy, choosing: bool) -> tuple[FP8LayerPolicy, FP8LayerPolicy]:
    """The layer policies of a measured plan: the one its decisions are made with (choosing among formats, the speed
    model judges what is too small to gain: the shape rule's size thresholds stand aside), and the one choosing the
    layers to measure (the first and last too, since which layers are edges, the readers of the model's input and the
    writers of its logits, is known only once the forward has run)."""
    final = dataclasses.replace(policy, skip_small_layers=False) if choosing else policy
    measure = dataclasses.replace(final, skip_first_last=False) if final.module_filter is None else final
    return final, measure


def edge_recorder(model: nn.Module, policy: FP8LayerPolicy) -> EdgeRecorder | None:
    """An ``EdgeRecorder`` on the model's linear layers for the measuring pass (no forward of its own), or None when
    no edge is kept (``skip_first_last`` off, or a ``module_filter`` decides)."""
    if not policy.skip_first_last or policy.module_filter is not None:
        return None
    return EdgeRecorder({fqn: m for fqn, m, _ in linear_layers(model)}, model=model)


@contextlib.contextmanager
def _edges_while(model: nn.Module, policy: FP8LayerPolicy) -> Iterator[Callable[[], dict[str, str] | None]]:
    """``edge_recorder`` open for the body; yields what gives the edges once it is over."""
    recorder = edge_recorder(model, policy)
    try:
        yield (lambda: None) if recorder is None else recorder.edges
    finally:
        if recorder is not None:
            recorder.close()


def check_candidates(call: str, candidates: Any, known: Sequence[str] = FORMATS, kind: str = "",
                     example: str = "candidates=('tensorwise', 'rowwise')") -> tuple[str, ...]:
    """``candidates`` as a tuple of names among ``known`` (a ``kind`` of format: "torchao", ...), or a ``ValueError``
    that repeats ``call`` and says the fix. The one check of ``make_plan``, the plan command and ``FP8Precision``."""
    whose = f"{kind}'s formats" if kind else "the formats"
    if isinstance(candidates, str) or not isinstance(candidates, (tuple, list)):
        raise ValueError(f"{call}: a tuple of format names, e.g. `{example}`; {whose} are {', '.join(known)}.")
    if not candidates:
        raise ValueError(f"{call}: name at least one format, e.g. `{example}` (high precision is always a choice),"
                         " or leave `candidates` out.")
    for name in candidates:
        if not isinstance(name, str) or name not in known:
            high = " High precision is always a choice: leave it out." if name in HIGH_LABELS or name == FP8 else ""
            raise ValueError(f"{call}: {name!r} is not a{' ' + kind if kind else ''} format; use"
                             f" {', '.join(known)}.{high}")
    repeated = sorted({name for name in candidates if candidates.count(name) > 1})
    if repeated:
        raise ValueError(f"{call}: {', '.join(map(repr, repeated))} named more than once; name each format once.")
    return tuple(candidates)


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
    ``device`` (a GPU's name; default this process's GPU, else an H100 SXM, said to be a prediction) or, with
    ``benchmark=True`` on a CUDA GPU, timed on the layer's own shapes; the plan takes the most saving within
    ``plan_rule`` (its per-layer bounds and ``error_budget``). Without ``candidates`` (and without an error budget),
    ``recipe`` alone is measured and each layer is fp8 or high precision by the per-layer bounds, as before."""
    if plan_rule is not None and not isinstance(plan_rule, PlanRule):
        raise ValueError(f"`make_plan(plan_rule={plan_rule!r})`: pass a `PlanRule` (`PlanRule()` for the defaults).")
    policy = resolve_layer_policy("make_plan", layer_policy, module_filter=module_filter,
                                  skip_small_layers=skip_small_layers, skip_first_last=skip_first_last)
    budgeted = plan_rule is not None and math.isfinite(plan_rule.error_budget)
    if candidates is None and not budgeted:
        if device is not None or benchmark:
            raise ValueError("`make_plan(device=..., benchmark=...)`: savings are weighed when choosing among formats;"
                             " pass `candidates=(...)` too.")
        config = probe_config(recipe, "make_plan")
        scaling_family = torchao_scaling_family(config)
        _, measure = planning_policies(policy, choosing=False)
        with _edges_while(model, policy) as edges:
            measuring = select_fp8_layers(model, scaling_family, layer_policy=measure)
            sensitivity = fp8_sensitivity(model, batches, config, loss_fn, [d.fqn for d in measuring if d.fp8],
                                          autocast_dtype)
        decisions = select_fp8_layers(model, scaling_family, layer_policy=policy, edges=edges())
        return PrecisionPlan.decide(decisions, sensitivity, plan_rule, scaling_family,
                                    high=high_label(autocast_dtype))
    names = check_candidates(f"`make_plan(candidates={candidates!r})`",
                             candidates if candidates is not None else (recipe,))
    if benchmark and not torch.cuda.is_available():
        raise ValueError("`make_plan(benchmark=True)`: timing the layers' formats needs a CUDA GPU; there is none"
                         " here. Leave `benchmark` off: the speed model predicts the savings (and says so).")
    # The speed model judges what is too small to gain, per format: the shape rule's size thresholds stand aside.
    shape_policy, measure = planning_policies(policy, choosing=True)
    with _edges_while(model, policy) as edges:
        measuring = select_fp8_layers(model, "tensorwise", layer_policy=measure)
        measured = measure_candidates(model, batches, names, loss_fn, [d.fqn for d in measuring if d.fp8],
                                      autocast_dtype)
    decisions = select_fp8_layers(model, "tensorwise", layer_policy=shape_policy, edges=edges())
    high = high_label(autocast_dtype)
    savings = None
    if benchmark:
        from lightning_precision.fp8._speed import benchmark_saving

        savings = {fmt: {fqn: benchmark_saving(cast(nn.Linear, model.get_submodule(fqn)), fmt, max(1, round(s.tokens)),
                                               high if high != HIGH else "bf16")
                         for fqn, s in by_layer.items()} for fmt, by_layer in measured.items()}
    return PrecisionPlan.choose(decisions, measured, plan_rule, device, high, policy.skip_small_layers,
                                savings=savings)
