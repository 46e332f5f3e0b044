"""``PrecisionPlan``: which linear layers run in fp8, decided from measured numerics, with the reasons and numbers.

Shape rules come first (``fp8.select_fp8_layers``: divisibility, layers that never run, ``module_filter``, first and
last layers, layers too small to gain); the layers they leave are judged by ``PlanRule`` on their
``sensitivity.LayerSensitivity``. A plan prints as a table, saves and loads as YAML or JSON (by the file's suffix) and
diffs against another; ``FP8Precision(layers=plan_or_path)`` applies one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_precision import fp8 as _fp8
from lightning_precision.fp8 import TENSORS, LayerDecision, ModuleFilter
from lightning_precision.sensitivity import LayerSensitivity, LossFn, fp8_sensitivity, probe_config

__all__ = [
    "FP8",
    "HIGH",
    "LayerPlan",
    "PLAN_VERSION",
    "PlanLike",
    "PlanRule",
    "PrecisionPlan",
    "demotions",
    "main",
    "make_plan",
]

FP8, HIGH = "fp8", "bf16"
PLAN_VERSION = 1


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
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"`PlanRule({f.name}={value!r})`: a number >= 0.")

    def why_not(self, s: LayerSensitivity) -> Optional[str]:
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


def _measured_numbers(s: LayerSensitivity) -> dict[str, float]:
    """The numbers a plan keeps for a measured layer: per tensor SQNR, underflow, overflow; output and input-gradient
    errors."""
    out = {}
    for tensor, n in s.tensors().items():
        out.update({f"{tensor}_sqnr_db": n.sqnr_db, f"{tensor}_underflow": n.underflow, f"{tensor}_overflow": n.overflow})
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
        if self.precision not in (FP8, HIGH):
            raise ValueError(f"LayerPlan({self.fqn!r}): precision {self.precision!r} is not 'fp8' or 'bf16'.")


def _to_json_number(x: float) -> Union[float, str]:
    return x if math.isfinite(x) else str(x)  # "inf", "-inf", "nan": strict JSON has no infinities


@dataclass(frozen=True)
class PrecisionPlan:
    """Per linear layer, fp8 or high precision and why. ``recipe`` and ``rule`` record how it was made, ``batches``
    how many batches were measured (0 for a hand-made plan)."""

    layers: tuple[LayerPlan, ...]
    recipe: str = "tensorwise"
    rule: PlanRule = PlanRule()
    batches: int = 0

    @classmethod
    def decide(cls, decisions: list[LayerDecision], sensitivity: dict[str, LayerSensitivity],
               rule: Optional[PlanRule] = None, recipe: str = "tensorwise",
               not_measured: Optional[str] = None) -> PrecisionPlan:
        """The plan for layers whose shape rules are ``decisions`` and whose numerics are ``sensitivity``. A layer the
        rules leave but ``sensitivity`` lacks stays in high precision, for ``not_measured`` if given (why nothing was
        measured), else because it did not run."""
        rule = rule or PlanRule()
        layers = []
        for d in decisions:
            s = sensitivity.get(d.fqn)
            if not d.fp8:
                layers.append(LayerPlan(d.fqn, HIGH, d.reason))
            elif s is None:
                layers.append(LayerPlan(d.fqn, HIGH, not_measured or "did not run while measured: nothing to judge"))
            else:
                why = rule.why_not(s)
                layers.append(LayerPlan(d.fqn, HIGH if why else FP8, why or "measured within the rule",
                                        _measured_numbers(s)))
        batches = max((s.batches for s in sensitivity.values()), default=0)
        return cls(tuple(layers), recipe, rule, batches)

    @classmethod
    def from_decisions(cls, decisions: list[LayerDecision], recipe: str = "tensorwise") -> PrecisionPlan:
        """The plan of layers chosen by shape rules alone (``layers=None``): nothing measured."""
        return cls(tuple(LayerPlan(d.fqn, FP8 if d.fp8 else HIGH, d.reason) for d in decisions), recipe)

    @property
    def fp8_layers(self) -> frozenset[str]:
        return frozenset(p.fqn for p in self.layers if p.precision == FP8)

    def get(self, fqn: str) -> Optional[LayerPlan]:
        return next((p for p in self.layers if p.fqn == fqn), None)

    def with_layer(self, fqn: str, precision: str, reason: str, numbers: Optional[dict[str, float]] = None) -> PrecisionPlan:
        """A copy with one layer's decision replaced."""
        if self.get(fqn) is None:
            raise KeyError(f"PrecisionPlan has no layer {fqn!r}.")
        return dataclasses.replace(self, layers=tuple(
            LayerPlan(fqn, precision, reason, numbers or {}) if p.fqn == fqn else p for p in self.layers))

    def table(self) -> str:
        """A fixed-width table: layer, precision, the worst measured numbers, reason."""
        n = len(self.fp8_layers)
        head = f"plan ({self.recipe}, {self.batches} batches measured): {n} of {len(self.layers)} linear layers in fp8"
        width = max((len(p.fqn) for p in self.layers), default=5)
        lines = [head, f"  {'layer':<{width}}  prec  min SQNR dB  max underflow  out err  gin err  reason"]
        for p in self.layers:
            if p.numbers:
                sqnr = min(p.numbers[f"{t}_sqnr_db"] for t in TENSORS)
                under = max(p.numbers[f"{t}_underflow"] for t in TENSORS)
                nums = (f"{sqnr:>11.1f}  {under:>13.2e}  {p.numbers['output_error']:>7.3f}"
                        f"  {p.numbers['grad_input_error']:>7.3f}")
            else:
                nums = f"{'-':>11}  {'-':>13}  {'-':>7}  {'-':>7}"
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
        return {
            "version": PLAN_VERSION, "recipe": self.recipe, "batches": self.batches,
            "rule": dataclasses.asdict(self.rule),
            "layers": [{"fqn": p.fqn, "precision": p.precision, "reason": p.reason,
                        "numbers": {k: _to_json_number(v) for k, v in p.numbers.items()}} for p in self.layers],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrecisionPlan:
        if not isinstance(data, dict):
            raise ValueError(f"PrecisionPlan: a plan is a mapping with `version` and `layers`, not a {type(data).__name__}.")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise ValueError(f"PrecisionPlan: version {version!r} is not {PLAN_VERSION}, the one this package reads.")
        try:
            layers = tuple(LayerPlan(d["fqn"], d["precision"], d.get("reason", ""),
                                     {k: float(v) for k, v in (d.get("numbers") or {}).items()}) for d in data["layers"])
            return cls(layers, data.get("recipe", "tensorwise"), PlanRule(**data.get("rule", {})),
                       int(data.get("batches", 0)))
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"PrecisionPlan: not a plan this package wrote ({type(err).__name__}: {err}); each layer"
                             " needs `fqn` and `precision`.") from None

    def save(self, path: Union[str, Path]) -> Path:
        """Write YAML (``.yaml``/``.yml``) or JSON (``.json``), to a temporary file first: a failed write leaves any
        previous plan whole."""
        path = Path(path)
        text = _dump(self.to_dict(), path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> PrecisionPlan:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"PrecisionPlan.load: no plan file at {str(path)!r}.")
        return cls.from_dict(_parse(path.read_text(), path))


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"PrecisionPlan: {str(path)!r}: name a .yaml, .yml or .json file.")
    return suffix


def _dump(data: dict[str, Any], path: Path) -> str:
    if _suffix(path) == ".json":
        return json.dumps(data, indent=2) + "\n"
    import yaml

    return yaml.safe_dump(data, sort_keys=False, width=120)


def _parse(text: str, path: Path) -> dict[str, Any]:
    if _suffix(path) == ".json":
        return json.loads(text)
    import yaml

    return yaml.safe_load(text)


def demotions(sensitivity: Mapping[str, LayerSensitivity], rule: Optional[PlanRule] = None) -> dict[str, str]:
    """The measured layers that ``rule`` rejects, each with why: what ``FP8Guard`` moves back to high precision."""
    rule = rule or PlanRule()
    failed = {fqn: rule.why_not(s) for fqn, s in sensitivity.items()}
    return {fqn: why for fqn, why in failed.items() if why}


PlanLike = Union[PrecisionPlan, str, Path]


def _as_plan(layers: PlanLike) -> PrecisionPlan:
    return layers if isinstance(layers, PrecisionPlan) else PrecisionPlan.load(layers)


def make_plan(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Optional[LossFn] = None,
    recipe: Any = "tensorwise",
    rule: Optional[PlanRule] = None,
    module_filter: Optional[ModuleFilter] = None,
    skip_small_layers: bool = True,
    skip_first_last: bool = True,
    autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
) -> PrecisionPlan:
    """Shape rules, then ``sensitivity.fp8_sensitivity`` on ``batches`` for the layers they leave, then ``rule``: the
    plan ``FP8Precision(layers="auto")`` would make, before training (the Fabric route: pass it as ``layers=``).
    Arguments as ``fp8_sensitivity`` and ``FP8Precision``; the weights are not updated."""
    config = probe_config(recipe, "make_plan")
    scaling_family = _fp8.torchao_scaling_family(config)
    _fp8.check_module_filter("make_plan", module_filter)
    decisions = _fp8.select_fp8_layers(model, scaling_family, module_filter, skip_small_layers, skip_first_last)
    sensitivity = fp8_sensitivity(model, batches, config, loss_fn, [d.fqn for d in decisions if d.fp8], autocast_dtype)
    return PrecisionPlan.decide(decisions, sensitivity, rule, scaling_family)


# ---- `lightning-precision plan` ---------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    """``lightning-precision plan --recipe vit|distilbert``: measure the recipe's embedded default, print the plan and
    write it (YAML or JSON by ``--out``'s suffix)."""
    import argparse

    from lightning_precision.recipes import RECIPES

    parser = argparse.ArgumentParser(
        prog="lightning-precision plan",
        description="Measure fp8 numerics per linear layer on a recipe's embedded default and write the plan.")
    parser.add_argument("--recipe", choices=["vit", "distilbert"], required=True, help="the recipe to measure")
    parser.add_argument("--batches", type=int, default=8, help="training batches to measure (default: 8)")
    parser.add_argument("--recipe-fp8", dest="recipe_fp8", default="tensorwise", choices=["tensorwise", "rowwise"],
                        help="torchao scaling recipe (default: tensorwise)")
    parser.add_argument("--emulate", action="store_true",
                        help="plan for emulated fp8 (as `fit --precision fp8-emulated`): layers too small to gain on an"
                             " fp8 GPU are judged too, instead of kept in bf16")
    parser.add_argument("--out", default=None, help="plan file, .yaml/.yml/.json (default: plan-<recipe>.yaml)")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches {args.batches}: measure at least 1 batch")
    out = Path(args.out or f"plan-{args.recipe}.yaml")
    try:
        _suffix(out)  # a bad name fails before measuring
    except ValueError as err:
        parser.error(str(err))
    model, batches = RECIPES[args.recipe].training_batches(args.batches)
    print(f"measuring {len(batches)} batches of the embedded {args.recipe} default ...", flush=True)
    plan = make_plan(model, batches, loss_fn=lambda m, b: m.training_loss(b), recipe=args.recipe_fp8,
                     skip_small_layers=not args.emulate)
    print(plan.table())
    print(f"wrote {plan.save(out)}")
    return 0
