"""``PrecisionPlan``: which linear layers run in fp8, decided from measured numerics, with the reasons and numbers.

Shape rules come first (``fp8.select_fp8_layers``: divisibility, layers that never run, ``module_filter``, first and
last layers, layers too small to gain); the layers they leave are judged by ``PlanRule`` on their
``sensitivity.LayerSensitivity``. A plan prints as a table, saves and loads as YAML or JSON (by the file's suffix) and
diffs against another; ``FP8Precision(layers=plan_or_path)`` applies one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, get_args

import torch
from torch import nn

from lightning_precision._io import atomic_write_text, json_safe
from lightning_precision.fp8._selection import (
    BLOCK_SCALED,
    SCALING_FAMILIES,
    TE_CANDIDATES,
    TENSORS,
    TORCHAO_CANDIDATES,
    FP8LayerPolicy,
    LayerDecision,
    ModuleFilter,
    ScalingFamily,
    resolve_layer_policy,
    select_fp8_layers,
)
from lightning_precision.fp8._sensitivity import LayerSensitivity, LossFn, fp8_sensitivity, probe_config
from lightning_precision.fp8._torchao import torchao_scaling_family

__all__ = [
    "FP8",
    "HIGH",
    "HIGH_LABELS",
    "HighLabel",
    "LayerPlan",
    "PLAN_VERSION",
    "PlanLike",
    "PlanRule",
    "PrecisionPlan",
    "as_plan",
    "demotions",
    "dump_plan",
    "high_label",
    "make_plan",
    "measured_numbers",
    "plan_suffix",
]

# A layer's precision in a plan: "fp8", or the high precision it runs in: the real dtype where the plan's maker knows it
# (the plugin's compute dtype, make_plan's autocast dtype), "high" where it does not (a plan decided by hand).
HighLabel = Literal["high", "bf16", "fp16", "fp32"]
HIGH_LABELS: tuple[HighLabel, ...] = get_args(HighLabel)
FP8 = "fp8"
HIGH: HighLabel = "high"
# A layer in low precision: "fp8" (the plugin's recipe) or the format it runs in.
_FORMATS = tuple(dict.fromkeys((FP8, *TORCHAO_CANDIDATES, *TE_CANDIDATES)))
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


def _shown(value: Any) -> str:
    """``2 (an integer)``: a YAML file's ``fqn: 2`` reads as a string to its author; say what the parser made of it."""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"{shown} ({_KIND.get(type(value), type(value).__name__)})"


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
    if not isinstance(precision, str) or precision not in (*_FORMATS, *HIGH_LABELS):
        raise ValueError(f"{field('precision')}: {precision!r} is not 'fp8' or a high precision"
                         f" ({', '.join(map(repr, HIGH_LABELS))}: the dtype the layer runs in), nor a format"
                         f" ({', '.join(map(repr, _FORMATS[1:]))}); write one of them.")
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
    """

    min_sqnr_db: float = 15.0
    max_underflow: float = 1e-3
    max_overflow: float = 0.0
    max_output_error: float = 0.1
    max_grad_input_error: float = 0.15

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


@dataclass(frozen=True)
class LayerPlan:
    """One layer: ``precision`` (``"fp8"`` or ``"bf16"``: the plugin's high-precision dtype), why, and the measured
    numbers behind it (empty for a shape rule)."""

    fqn: str
    precision: str
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_layer(lambda name: f"LayerPlan({self.fqn!r}).{name}", self.fqn, self.precision, self.reason,
                     self.numbers)


@dataclass(frozen=True)
class PrecisionPlan:
    """Per linear layer, fp8 or high precision and why. ``scaling_family`` (the cast measured) and ``rule`` record how
    it was made, ``batches`` how many batches were measured (0 for a hand-made plan)."""

    layers: tuple[LayerPlan, ...]
    scaling_family: ScalingFamily = "tensorwise"
    rule: PlanRule = PlanRule()
    batches: int = 0

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
        """The layers in low precision: "fp8" or a format."""
        return frozenset(p.fqn for p in self.layers if p.precision not in HIGH_LABELS)

    def get(self, fqn: str) -> LayerPlan | None:
        return next((p for p in self.layers if p.fqn == fqn), None)

    def format_of(self, fqn: str) -> str | None:
        """The format ``fqn`` runs in: None in high precision (or not listed), "fp8" for the plugin's recipe."""
        entry = self.get(fqn)
        return None if entry is None or entry.precision in HIGH_LABELS else entry.precision

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
        if not self.measured or as_measured.get(mine, mine) == as_measured.get(scaling_family, scaling_family):
            return None
        if scaling_family in ("tensorwise", "rowwise"):
            how = (f"`make_plan(..., recipe={scaling_family!r})`, `lightning-precision plan --recipe-fp8"
                   f" {scaling_family}`, or `layers='auto'`")
        elif scaling_family in BLOCK_SCALED or scaling_family == "block":
            how = "not possible for block-scaled casts (docs/plan.md): choose the layers by hand or by shape rules"
        else:
            how = "`layers='auto'` with this plugin, on one process"
        return (f"the plan was measured with the {self.scaling_family!r} cast and this plugin casts with"
                f" {scaling_family!r}:"
                " its numbers, and the rule's verdicts on them, are another cast's. It is applied as written; to"
                f" judge the layers by this plugin's cast, measure again with its recipe ({how}).")

    def with_layer(self, fqn: str, precision: str, reason: str,
                   numbers: dict[str, float] | None = None) -> PrecisionPlan:
        """A copy with one layer's decision replaced."""
        if self.get(fqn) is None:
            raise KeyError(f"PrecisionPlan has no layer {fqn!r}.")
        return dataclasses.replace(self, layers=tuple(
            LayerPlan(fqn, precision, reason, numbers or {}) if p.fqn == fqn else p for p in self.layers))

    def table(self) -> str:
        """A fixed-width table: layer, precision, the worst measured numbers, reason."""
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
        return {
            "version": PLAN_VERSION, "scaling_family": self.scaling_family, "batches": self.batches,
            "rule": json_safe(dataclasses.asdict(self.rule)),
            "layers": [{"fqn": p.fqn, "precision": p.precision, "reason": p.reason,
                        "numbers": json_safe(p.numbers)} for p in self.layers],
        }

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
        _check_keys(where, "the plan", data, ("version", "scaling_family", "recipe", "batches", "rule", "layers"))
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
            _check_keys(where, f"`layers[{i}]`", d, ("fqn", "precision", "reason", "numbers"))
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
            layers.append(LayerPlan(d["fqn"], d["precision"], reason, numbers))
        _check_unique(where, (p.fqn for p in layers))
        return cls(tuple(layers), scaling_family, PlanRule(**bounds), batches)

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
) -> PrecisionPlan:
    """Shape rules, then ``fp8_sensitivity`` on ``batches`` for the layers they leave, then ``plan_rule``: the plan
    ``FP8Precision(layers="auto")`` would make, before training (the Fabric route: pass it as ``layers=``). Arguments
    as ``fp8_sensitivity`` and ``FP8Precision``: the layer choice is ``layer_policy`` or the flat ``module_filter``,
    ``skip_small_layers`` and ``skip_first_last`` (not both). The weights are not updated."""
    config = probe_config(recipe, "make_plan")
    scaling_family = torchao_scaling_family(config)
    policy = resolve_layer_policy("make_plan", layer_policy, module_filter=module_filter,
                                  skip_small_layers=skip_small_layers, skip_first_last=skip_first_last)
    if plan_rule is not None and not isinstance(plan_rule, PlanRule):
        raise ValueError(f"`make_plan(plan_rule={plan_rule!r})`: pass a `PlanRule` (`PlanRule()` for the defaults).")
    decisions = select_fp8_layers(model, scaling_family, layer_policy=policy)
    sensitivity = fp8_sensitivity(model, batches, config, loss_fn, [d.fqn for d in decisions if d.fp8], autocast_dtype)
    return PrecisionPlan.decide(decisions, sensitivity, plan_rule, scaling_family, high=high_label(autocast_dtype))
