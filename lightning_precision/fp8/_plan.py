"""``PrecisionPlan``: which linear layers run in fp8, decided from measured numerics, with the reasons and numbers.

Shape rules come first (``fp8.select_fp8_layers``: divisibility, layers that never run, ``module_filter``, first and
last layers, layers too small to gain); the layers they leave are judged by ``PlanRule`` on their
``sensitivity.LayerSensitivity``. A plan prints as a table, saves and loads as YAML or JSON (by the file's suffix) and
diffs against another; ``FP8Precision(layers=plan_or_path)`` applies one.

The plan is a thin value class over its parts, one concern a module: the entries and the rule (``_plan_types``), the
decision (``_decision``), the file format (``_plan_file``), what a measured plan's makers share (``_plan_setup``);
``make_plan`` (``_make_plan``) runs the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_precision._io import atomic_write_text
from lightning_precision.fp8._decision import choose_layers, decide_layers, demotions
from lightning_precision.fp8._plan_file import dump_plan, parse_plan, plan_data, plan_fields, plan_suffix
from lightning_precision.fp8._plan_setup import check_candidates, edge_recorder, planning_policies
from lightning_precision.fp8._plan_types import (
    FP8,
    HIGH,
    HIGH_LABELS,
    HighLabel,
    LayerPlan,
    MeasuredSpeed,
    PlanRule,
    check_count,
    check_recipe,
    check_unique,
    high_label,
    is_number,
    measured_numbers,
    short,
    shown,
)
from lightning_precision.fp8._selection import BLOCK_SCALED, TENSORS, LayerDecision, ScalingFamily
from lightning_precision.fp8._sensitivity import LayerSensitivity

__all__ = [
    "PlanLike",
    "PrecisionPlan",
    "as_plan",
    # Where the fp8 plugin and the guard callback import them from; their homes are the modules imported above.
    "FP8",
    "HIGH",
    "HIGH_LABELS",
    "HighLabel",
    "PlanRule",
    "check_candidates",
    "demotions",
    "edge_recorder",
    "high_label",
    "measured_numbers",
    "plan_suffix",
    "planning_policies",
]


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
            raise ValueError(f"PrecisionPlan(layers={shown(self.layers)}): a tuple of `LayerPlan`s.")
        object.__setattr__(self, "layers", tuple(self.layers))  # a list would make equal plans compare unequal
        for i, p in enumerate(self.layers):
            if not isinstance(p, LayerPlan):
                raise ValueError(f"PrecisionPlan: layers[{i}] is {shown(p)}; each layer is a"
                                 " `LayerPlan(fqn, precision, reason)`.")
        check_recipe("PrecisionPlan(scaling_family=...)", self.scaling_family)
        check_count("PrecisionPlan(batches=...)", self.batches)
        if not isinstance(self.rule, PlanRule):
            raise ValueError(f"PrecisionPlan(rule={self.rule!r}): pass a `PlanRule` (`PlanRule()` for the defaults).")
        check_unique("PrecisionPlan", (p.fqn for p in self.layers))
        if not isinstance(self.device, str):
            raise ValueError(f"PrecisionPlan(device={shown(self.device)}): the GPU's name, as text.")
        for name in ("device_here", "benchmarked"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PrecisionPlan({name}={shown(getattr(self, name))}): True or False.")
        if not is_number(self.baseline) or not self.baseline >= 0:
            raise ValueError(f"PrecisionPlan(baseline={shown(self.baseline)}): seconds per step, >= 0.")

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
               savings: Mapping[str, Mapping[str, float]] | MeasuredSpeed | None = None,
               not_measured: str | None = None) -> PrecisionPlan:
        """The plan that chooses, per layer the shape rules leave (``decisions``), one of the formats measured
        (``measured``: format -> layer -> numbers, ``measure_candidates``'s result) or high precision: the most
        predicted saving (``_speed.predicted_saving`` on ``device``, default this process's GPU, else an H100 SXM as a
        prediction, or the first GPU of the table that runs every candidate, a B200, when MXFP8 or NVFP4 is one) such
        that every chosen format passes ``rule``'s per-layer bounds and the chosen formats' summed
        ``error_contribution`` stays within ``rule.error_budget``; solved exactly (``_choice.choose``).
        ``skip_small_layers=False``: a format predicted slower than ``high`` may still be chosen (first as many layers
        in low precision as the budget allows, then the most saving), as the shape rule's flag means. ``savings``:
        seconds saved per format and layer, timed (``_timing.benchmark_saving``) instead of predicted; a
        ``MeasuredSpeed`` (``_timing.time_shapes``, what ``FP8Precision`` times on a CUDA GPU) names its GPU.
        ``not_measured``: why a layer has no numbers, if not that it did not run (as ``decide``'s). The decision is
        ``_decision.choose_layers``'s."""
        rule = rule or PlanRule()
        choice = choose_layers(decisions, measured, rule, device, high, skip_small_layers, backend, savings,
                               not_measured)
        return cls(rule=rule, **choice._asdict())

    @classmethod
    def decide(cls, decisions: list[LayerDecision], sensitivity: dict[str, LayerSensitivity],
               rule: PlanRule | None = None, scaling_family: ScalingFamily = "tensorwise",
               not_measured: str | None = None, high: HighLabel = HIGH,
               speed: MeasuredSpeed | None = None) -> PrecisionPlan:
        """The plan for layers whose shape rules are ``decisions`` and whose numerics are ``sensitivity``. A layer the
        rules leave but ``sensitivity`` lacks stays in high precision, for ``not_measured`` if given (why nothing was
        measured), else because it did not run. ``high``: the label of the layers kept in high precision (the dtype
        they run in, see ``high_label``). ``speed``: the layers timed in the one format on this GPU (a layer measured
        slower stays in high precision), which the plan then names as measured."""
        rule = rule or PlanRule()
        batches = max((s.batches for s in sensitivity.values()), default=0)
        layers = decide_layers(decisions, sensitivity, rule, not_measured, high, speed)
        if speed is None:
            return cls(layers, scaling_family, rule, batches)
        return cls(layers, scaling_family, rule, batches, speed.device, True, True)

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

    def by_first_path(self, decisions: list[LayerDecision]) -> PrecisionPlan:
        """This plan with each entry under its layer's first path (``LayerDecision.fqn``): a module registered under
        several names (``self.c = self.a``) is one layer, and the plan may name it by any of them. Two entries for
        one layer must agree on what it runs in (an fp8 format, or high precision); else a ``ValueError``."""
        first = {alias: d.fqn for d in decisions for alias in d.aliases}
        if not any(p.fqn in first for p in self.layers):
            return self
        kept: dict[str, LayerPlan] = {}
        for p in sorted(self.layers, key=lambda p: p.fqn in first):  # an entry under the first path wins
            path = first.get(p.fqn, p.fqn)
            other = kept.setdefault(path, dataclasses.replace(p, fqn=path))
            if other.low != p.low or (p.low and other.precision != p.precision):
                names = [q.fqn for q in self.layers if first.get(q.fqn, q.fqn) == path]
                raise ValueError(f"PrecisionPlan: {' and '.join(map(repr, names))} are one layer (one module"
                                 f" registered under {len(names)} names), and the plan gives it {other.precision!r}"
                                 f" and {p.precision!r}; give every name of it one precision, or list it once.")
        return dataclasses.replace(self, layers=tuple(kept.values()))

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

    @property
    def speed_source(self) -> str:
        """Where the plan's speed came from: ``"measured on <GPU>"`` (timed there), ``"predicted for <GPU>"`` (the
        speed model; a plan file written before plans said it reads so), or ``""`` for a plan that weighed no speed
        (the shape rules' thresholds alone)."""
        if not self.device:
            return ""
        return f"measured on {self.device}" if self.benchmarked else f"predicted for {self.device}"

    def saving_line(self) -> str:
        """The plan's saving in words: per step, as a fraction of the baseline, on which GPU, and whether it was
        measured there or predicted."""
        how = "measured" if self.benchmarked else "predicted"
        share = f" ({self.predicted_saving / self.baseline:.1%} of the measured layers' GEMM time)" \
            if self.baseline > 0 else ""
        where = "" if self.device_here else " (a prediction: this process does not run on one)"
        return f"{how} saving {self.predicted_saving * 1e3:.3f} ms per step{share}; speed {self.speed_source}{where}"

    def table(self) -> str:
        """A fixed-width table: layer, precision, the worst measured numbers, reason; for a plan that chose among
        formats, also each layer's predicted saving and error, and the formats weighed."""
        if any(p.alternatives for p in self.layers):
            return self._choice_table()
        n = len(self.fp8_layers)
        source = f"; speed {self.speed_source}" if self.speed_source else ""
        head = (f"plan ({self.scaling_family}, {self.batches} batches measured): {n} of {len(self.layers)} linear"
                f" layers in fp8{source}")
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
                               if a.verdict == "eligible" else f"{a.format} (out: {short(a.verdict)})"
                               for a in p.alternatives if a is not chosen) or "-"
            lines.append(f"  {p.fqn:<{width}}  {p.precision:<{fmt_width}}  {p.predicted_saving * 1e6:>9.1f}  {error:<8}"
                         f"  {others}  {p.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def diff(self, other: PrecisionPlan) -> list[str]:
        """Lines ``fqn: a -> b`` for every layer whose precision differs (or is in one plan only).

        Example:
            >>> plan = PrecisionPlan((LayerPlan("q", "fp8", "measured within the rule"), LayerPlan("head", "bf16", "")))
            >>> edited = plan.with_layer("q", "bf16", "by hand")
            >>> plan.diff(edited), sorted(edited.fp8_layers)
            (['q: fp8 -> bf16'], [])
        """
        mine, theirs = {p.fqn: p.precision for p in self.layers}, {p.fqn: p.precision for p in other.layers}
        return [f"{fqn}: {mine.get(fqn, '-')} -> {theirs.get(fqn, '-')}" for fqn in dict.fromkeys([*mine, *theirs])
                if mine.get(fqn) != theirs.get(fqn)]

    # ---- files ------------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (what ``save`` writes): infinities and NaN as the strings ``"inf"``, ``"-inf"``,
        ``"nan"``, since strict JSON has none."""
        return plan_data(self.layers, self.scaling_family, self.rule, self.batches, self.device, self.device_here,
                         self.benchmarked, self.baseline)

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> PrecisionPlan:
        """The plan ``to_dict`` gave (read from a file or a checkpoint). ``source`` says where it came from in errors
        (``load`` names the file); each error names the field, the value and the fix."""
        where = source or "PrecisionPlan.from_dict"
        fields = plan_fields(data, where)
        try:
            return cls(**fields)
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
        source = f"PrecisionPlan.save({str(path)!r})"
        if PrecisionPlan.from_dict(parse_plan(text, path), source=source).to_dict() != data:
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
        return cls.from_dict(parse_plan(text, path, source), source=source)



PlanLike = PrecisionPlan | str | Path


def as_plan(layers: PlanLike) -> PrecisionPlan:
    return layers if isinstance(layers, PrecisionPlan) else PrecisionPlan.load(layers)
