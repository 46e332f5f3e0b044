"""fp8 training, backend-neutral: which linear layers run in fp8 (``select_fp8_layers``, ``FP8LayerPolicy``, the
model's edges ``edges_of``), what each would lose in one format or several (``fp8_sensitivity``,
``measure_candidates``), the plan that decides from it (``make_plan``, ``PrecisionPlan``: fp8 or high precision, or
one format per layer for the most predicted speed within an error budget), and whether this machine runs fp8
(``check_fp8_hardware``). ``FP8Precision`` (Trainer and Fabric) applies them; use them directly where
a plugin cannot go (before training, or inside ``configure_model`` before FSDP2's ``fully_shard``).

One concern per private module: ``_selection`` (layer rules), ``_edges`` (which layers read the input and write the
logits), ``_torchao`` and ``_te`` (the backends), ``_hardware``, ``_emulate`` (each format's casts) and ``_sensitivity``
(the probe), ``_speed`` (the step-time model), ``_choice`` (the exact choice), the plan's ``_plan_types`` (its entries
and rule), ``_decision`` (choose or decide, from the numbers), ``_plan_file`` (its files), ``_plan_setup`` (what its
makers share) and ``_plan`` (``PrecisionPlan``), ``_make_plan`` (which runs the model), ``_watch`` (which converted
layers ran).
"""

from typing import Any

from lightning_precision.fp8._edges import edges_of
from lightning_precision.fp8._hardware import check_fp8_hardware
from lightning_precision.fp8._make_plan import make_plan
from lightning_precision.fp8._plan import PrecisionPlan
from lightning_precision.fp8._plan_types import FormatOption, LayerPlan, PlanRule
from lightning_precision.fp8._selection import FP8LayerPolicy, LayerDecision, select_fp8_layers
from lightning_precision.fp8._sensitivity import LayerSensitivity, TensorNumerics, fp8_sensitivity, measure_candidates
from lightning_precision.fp8._torchao import (
    NO_TOKENS_CLASS,
    MXFP8Recipe,
    convert_with_torchao,
    float8_linear_class,
    torchao_config,
)

__all__ = [
    "FP8LayerPolicy",
    "FormatOption",
    "LayerDecision",
    "LayerPlan",
    "LayerSensitivity",
    "MXFP8Recipe",
    "PlanRule",
    "PrecisionPlan",
    "TensorNumerics",
    "check_fp8_hardware",
    "convert_with_torchao",
    "edges_of",
    "fp8_sensitivity",
    "make_plan",
    "measure_candidates",
    "select_fp8_layers",
    "torchao_config",
]


def __getattr__(name: str) -> Any:
    # Unpickling a model converted by torchao looks its layer class up here by name (the class says this module); the
    # class is made on first use, since torchao is optional.
    if name == NO_TOKENS_CLASS:
        return float8_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
