"""What ``make_plan``, the plan command and ``FP8Precision(layers="auto")`` share before they measure: the candidate
formats checked (``check_candidates``), the model checked for a layer a plan can name (``check_root_layer``), the
layer policies of the measuring pass and of the decision
(``planning_policies``), and the recorder of the model's edges during that pass (``edge_recorder``,
``recording_edges``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from lightning_precision.fp8._edges import EdgeRecorder
from lightning_precision.fp8._plan_types import FORMATS, FP8, HIGH_LABELS
from lightning_precision.fp8._selection import FP8LayerPolicy, linear_layers

__all__ = ["check_candidates", "check_root_layer", "edge_recorder", "planning_policies", "recording_edges"]


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


def check_root_layer(call: str, model: nn.Module) -> None:
    """A model that is itself an ``nn.Linear`` is refused with a ``ValueError`` that repeats ``call`` and says the fix.
    A plan names each layer by its path, and this layer's is ``''``, which a plan refuses (``LayerPlan``: an empty path
    in a file is a mistake far more often than the model itself); nor could ``layers="auto"`` convert it after
    measuring, in place, as it converts a layer inside a model: the root is the object the caller holds."""
    if isinstance(model, nn.Linear):
        raise ValueError(f"{call}: the model is itself an nn.Linear, whose path in the model is '' (empty), and a plan"
                         " names each layer by its path. Wrap it: `nn.Sequential(model)` (its layer's path is then"
                         " '0'), and train the wrapped model; or convert it by a recipe without a plan"
                         " (`FP8Precision(recipe=...)`, no `layers=`).")


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
def recording_edges(model: nn.Module, policy: FP8LayerPolicy) -> Iterator[Callable[[], dict[str, str] | None]]:
    """``edge_recorder`` open for the body; yields what gives the edges once it is over."""
    recorder = edge_recorder(model, policy)
    try:
        yield (lambda: None) if recorder is None else recorder.edges
    finally:
        if recorder is not None:
            recorder.close()
