"""A plan's value types: the labels a layer's precision may take, the rule that judges a measured layer
(``PlanRule``), one layer's entry (``LayerPlan``) and each format it weighed (``FormatOption``), with the checks they
share with the plan file's reader: a plan built in Python and a plan read from a file pass the same checks, so
``save`` never writes what ``load`` refuses. ``PrecisionPlan`` (``fp8._plan``) holds the entries.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch

from lightning_precision.fp8._selection import SCALING_FAMILIES, TE_NVFP4, TE_RECIPES, TORCHAO_RECIPES

if TYPE_CHECKING:  # the probe's result type only: importing the probe here would deepen every import of a plan
    from lightning_precision.fp8._sensitivity import LayerSensitivity

__all__ = [
    "DTYPE_OF_HIGH",
    "FORMATS",
    "FP8",
    "FormatOption",
    "HIGH",
    "HIGH_LABELS",
    "HighLabel",
    "KIND",
    "LayerPlan",
    "MeasuredSpeed",
    "PlanRule",
    "check_bound",
    "check_count",
    "check_layer",
    "check_recipe",
    "check_unique",
    "error_contribution",
    "high_label",
    "is_number",
    "measured_numbers",
    "short",
    "shown",
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
# The dtype of each known high label (not "high": its dtype is unknown).
DTYPE_OF_HIGH: dict[str, torch.dtype] = {label: dtype for dtype, label in _HIGH_OF_DTYPE.items() if dtype is not None}


def high_label(dtype: torch.dtype | None) -> HighLabel:
    """The label of a layer kept in high precision that runs in ``dtype`` (``"high"`` where it is not known).

    Example:
        >>> high_label(torch.float16), high_label(None)
        ('fp16', 'high')
    """
    return _HIGH_OF_DTYPE.get(dtype, "high")


# ---- what a plan holds, checked where it is made: a plan built in Python and a plan read from a file pass the same
# checks, so `save` never writes what `load` refuses. `where` names the call or the file and field.

# What a value read from a file is, in words: a YAML file's `fqn: 2` reads as text to its author.
KIND = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping",
        type(None): "empty"}


def short(text: str, width: int = 48) -> str:
    """``text`` cut to ``width`` characters, an ellipsis saying so."""
    return text if len(text) <= width else text[: width - 3] + "..."


def shown(value: Any) -> str:
    """``2 (an integer)``: a YAML file's ``fqn: 2`` reads as a string to its author; say what the parser made of it."""
    return f"{short(repr(value), 80)} ({KIND.get(type(value), type(value).__name__)})"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_bound(where: str, value: Any, default: float) -> None:
    if not is_number(value) or math.isnan(value) or value < 0:
        raise ValueError(f"{where}: {shown(value)} is not a number >= 0 (inf: no bound); the default is {default:g}.")


def check_count(where: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: {shown(value)} is not a whole number >= 0 of batches measured (0: a plan made"
                         " by hand or by the shape rules).")


def check_recipe(where: str, value: Any) -> None:
    """The ``recipe`` a plan may record: a plugin's ``scaling_family`` (torchao's families, Transformer Engine's recipe
    names, and "custom" for a TE recipe object of another class)."""
    if value not in SCALING_FAMILIES or not isinstance(value, str):
        raise ValueError(f"{where}: {shown(value)} is not a scaling recipe; one of {', '.join(SCALING_FAMILIES)}"
                         " (the `scaling_family` of the plugin that measured it).")


def check_layer(field: Callable[[str], str], fqn: Any, precision: Any, reason: Any, numbers: Any) -> None:
    """One layer's fields; ``field("fqn")`` names one of them where the error is said (a call, or a file's entry)."""
    bare = "in YAML, quote it: a bare number, yes/no, true/false or null is not text"
    if not isinstance(fqn, str) or not fqn:
        raise ValueError(f"{field('fqn')}: {shown(fqn)} is not a layer's path; write the path of an nn.Linear in the"
                         f" model (as `model.named_modules()` names it){'' if isinstance(fqn, str) else f' ({bare})'}.")
    if not isinstance(precision, str) or precision not in (FP8, *FORMATS, *HIGH_LABELS):
        raise ValueError(f"{field('precision')}: {precision!r} is not 'fp8' (the plugin's recipe), a format"
                         f" ({', '.join(map(repr, FORMATS))}) or a high precision"
                         f" ({', '.join(map(repr, HIGH_LABELS))}: the dtype the layer runs in); write one of them.")
    if not isinstance(reason, str):
        raise ValueError(f"{field('reason')}: {shown(reason)} is not text; write it as a string ({bare}).")
    if not isinstance(numbers, Mapping):
        raise ValueError(f"{field('numbers')}: {shown(numbers)} is not a mapping of names to numbers; write it as"
                         " `name: value` lines, or leave it out.")
    for key, value in numbers.items():
        if not isinstance(key, str):
            raise ValueError(f"{field('numbers')}: the name {shown(key)} is not a string ({bare}).")
        if not is_number(value):
            raise ValueError(f"{field('numbers.' + key)}: {shown(value)} is not a number; write a number (inf, -inf"
                             " and nan as the strings 'inf', '-inf', 'nan').")


def check_unique(where: str, fqns: Iterable[str]) -> None:
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
            check_bound(f"`PlanRule({f.name}={value!r})`", value, cast(float, f.default))

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
            raise ValueError(f"FormatOption(format={shown(self.format)}): one of {', '.join(FORMATS)} or a high"
                             " precision.")
        for name in ("error", "predicted_saving"):
            value = getattr(self, name)
            if not is_number(value) or math.isnan(value):  # inf error: not measured; nan means nothing
                text = repr(value) if is_number(value) else shown(value)
                raise ValueError(f"FormatOption({name}={text}): a number"
                                 f"{' (inf: never fits)' if name == 'error' else ' (seconds per training step)'}.")
        if not isinstance(self.verdict, str):
            raise ValueError(f"FormatOption(verdict={shown(self.verdict)}): text.")


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
        check_layer(lambda name: f"LayerPlan({self.fqn!r}).{name}", self.fqn, self.precision, self.reason,
                    self.numbers)
        object.__setattr__(self, "alternatives", tuple(self.alternatives))
        if not all(isinstance(a, FormatOption) for a in self.alternatives):
            raise ValueError(f"LayerPlan({self.fqn!r}).alternatives: a tuple of `FormatOption`s.")
        if not is_number(self.predicted_saving) or math.isnan(self.predicted_saving):
            raise ValueError(f"LayerPlan({self.fqn!r}).predicted_saving: {shown(self.predicted_saving)} is not a"
                             " number (seconds per training step).")

    @property
    def low(self) -> bool:
        """Whether the layer computes in a low-precision format (fp8, MXFP8, NVFP4), not in its high precision."""
        return self.precision not in HIGH_LABELS



@dataclass(frozen=True)
class MeasuredSpeed:
    """Seconds per training step (forward and backward) of each layer, timed on ``device`` (``_timing.time_shapes``):
    in the ``high`` dtype (``high_seconds``: path -> seconds) and in each format (``low_seconds``: format -> path ->
    seconds), ``compiled`` or eager. What a plan's speed input is on a CUDA GPU instead of the speed model's
    prediction."""

    device: str
    high: str
    compiled: bool
    high_seconds: Mapping[str, float]
    low_seconds: Mapping[str, Mapping[str, float]]

    def saving(self, fmt: str, fqn: str) -> float:
        return self.high_seconds[fqn] - self.low_seconds[fmt][fqn]

    def savings(self) -> dict[str, dict[str, float]]:
        """format -> path -> seconds saved (negative: slower), ``PrecisionPlan.choose``'s ``savings``."""
        return {fmt: {fqn: self.saving(fmt, fqn) for fqn in by} for fmt, by in self.low_seconds.items()}

    def said(self, fmt: str, fqn: str) -> str:
        """``"measured slower on <device>: x.xx ms vs y.yy ms in bf16"`` (or faster): the layer's reason."""
        how = "faster" if self.saving(fmt, fqn) > 0 else "slower"
        way = "compiled" if self.compiled else "eager"
        return (f"measured {how} on {self.device}: {self.low_seconds[fmt][fqn] * 1e3:.2f} ms in {fmt} vs"
                f" {self.high_seconds[fqn] * 1e3:.2f} ms in {self.high} ({way})")
