"""What ``FP8Precision`` asks of the library that runs its fp8 layers: one protocol (``FP8Backend``) that torchao's
backend and Transformer Engine's implement (``_core.fp8.backends``), and the smaller one of moving layers in place
(``LayerMover``, torchao's only)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch.nn import Module

if TYPE_CHECKING:
    from lightning_precision.fp8._selection import LayerDecision, ScalingFamily

__all__ = ["FP8Backend", "LayerMover"]


class LayerMover(Protocol):
    """What moving converted layers in place (``demote``, ``step_down``) asks: torchao's layers only."""

    def layer_format(self, module: Module) -> str | None:
        """The format ``module`` computes in now (None: high precision)."""

    def set_layer_format(self, module: Module, fmt: str | None, fqn: str) -> Module:
        """``module`` made to compute in ``fmt`` (None: high precision), in place."""

    def per_tensor_rung(self) -> str:
        """The per-tensor or per-row format of the ladder's last fp8 rung."""


class FP8Backend(Protocol):
    """What ``FP8Precision`` asks of the library that runs its fp8 layers."""

    name: ClassVar[str]  # the `backend` argument that chose it
    candidates_known: ClassVar[tuple[str, ...]]  # the formats `layers="auto"` may choose among
    mxfp8_takes_fp16: ClassVar[bool]  # whether its MXFP8 casts take fp16 inputs (torchao's do not)
    moves_layers: ClassVar[bool]  # whether converted layers can change format in place (``movable``)
    recipe: Any  # resolved: a torchao config (or `MXFP8Recipe`), or a Transformer Engine recipe object
    emulate: bool
    scaling_family: ScalingFamily  # what the layer rules and the hardware checks depend on
    recipe_format: str  # the recipe's format name: a plan's layer in this format runs the recipe as configured

    def gathers_in_fp8(self) -> bool:
        """Whether FSDP2 can all-gather the recipe's weights in fp8 (torchao, tensorwise)."""

    def candidates_example(self) -> str:
        """The ``candidates`` of an error message's example."""

    def lightning_precision(self, compute_dtype: torch.dtype) -> str:
        """Lightning's precision string, which strategies and ThroughputMonitor read."""

    def default_candidates(self, recipe_given: bool) -> tuple[str, ...]:
        """``layers="auto"``'s formats when ``candidates`` is not given."""

    def check_candidates(self, call: str, candidates: tuple[str, ...]) -> None:
        """Refuse candidates the backend cannot run side by side."""

    def check_plan_formats(self, formats: Mapping[str, str | None], where: str,
                           fsdp_float8_all_gather: bool | None) -> None:
        """Refuse a plan whose layers name formats (``fqn: format``, None: the recipe) the backend cannot run."""

    def float8_all_gather(self, asked: bool | None, sharded: Callable[[], bool], families: set[str],
                          owner: str) -> bool:
        """Whether the layers about to be converted all-gather their weights in fp8 under FSDP2."""

    def probe_config(self) -> Any:
        """What ``layers="auto"`` measures the recipe's numerics with."""

    def convert(self, module: Module, decisions: list[LayerDecision], float8_all_gather: bool
                ) -> tuple[Module, dict[str, Module]]:
        """The layers ``decisions`` put in fp8 converted: the module, and its fp8 layers by path."""

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """What every forward runs inside, beside autocast."""

    def high_precision_context(self, module: Module | None) -> contextlib.AbstractContextManager[Any]:
        """While open, ``module``'s converted layers compute in high precision (evaluation without fp8); the forwards
        then run without ``forward_context``."""

    def check_hardware(self, device_type: str, families: Iterable[str], owner: str) -> None:
        """Refuse a device that cannot run these scaling families."""

    def movable(self, where: str) -> LayerMover:
        """The mover of converted layers, or a ``RuntimeError`` naming ``where``."""
