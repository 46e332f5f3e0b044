"""``FP8Precision(layers="auto")``: the first ``calibration_batches`` training batches run in the high-precision dtype
while a ``SensitivityProbe`` (one format) or a ``MultiProbe`` (choosing among several) measures the layers the shape
rules left; at the first optimizer step after them (so never inside a gradient accumulation), the plan is made from
what was measured, and the plugin converts as it says.

``fp8._plan`` is imported where it is used: imported with this module, it would take the Trainer plugin's chain of
imports past the 8 levels allowed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Linear, Module

from lightning_precision._core import fsdp
from lightning_precision._core.accumulator import all_reduce
from lightning_precision._warnings import NoEffectWarning, warn
from lightning_precision.fp8._edges import EdgeRecorder
from lightning_precision.fp8._selection import FP8LayerPolicy, LayerDecision, ScalingFamily, select_fp8_layers
from lightning_precision.fp8._sensitivity import MultiProbe, SensitivityProbe

if TYPE_CHECKING:
    from lightning_precision.fp8._plan import HighLabel, PlanRule, PrecisionPlan

__all__ = ["Calibration", "PlanSetup", "decide", "start_calibration"]

Report = Callable[[list[LayerDecision]], None]  # what the layers run now, told to the plugin's layer book
Decide = Callable[[list[LayerDecision], dict[str, Any], "str | None"], "PrecisionPlan"]


@dataclass(frozen=True)
class PlanSetup:
    """What ``layers="auto"`` measures and decides with: the plugin's arguments as they are when it starts or ends."""

    owner: str
    policy: FP8LayerPolicy
    choosing: bool  # among formats (several candidates, or an error budget), not fp8-or-not
    candidates: tuple[str, ...]
    rule: PlanRule | None
    scaling_family: ScalingFamily
    backend: str
    high: HighLabel
    probe_config: Callable[[], Any]  # what one format is measured with (asked only when not choosing)

    @property
    def family(self) -> str:
        """The scaling family whose GEMM rules choose the layers to plan: the recipe's, or (choosing among formats,
        each held to its own rules by the choice) fp8's 16."""
        return "tensorwise" if self.choosing else self.scaling_family


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def start_calibration(module: Module, setup: PlanSetup, batches: int, to_be_sharded: bool,
                      previous: Calibration | None) -> Calibration:
    """Start measuring ``module`` (``previous``: a model whose measuring never finished; its hooks go)."""
    from lightning_precision.fp8._plan import edge_recorder, planning_policies
    from lightning_precision.fp8._plan_setup import check_root_layer

    check_root_layer(f"{setup.owner}(layers='auto')", module)  # before measuring: its plan could not name the layer
    if to_be_sharded or fsdp.is_sharded(module):
        raise RuntimeError(
            f"{setup.owner}(layers='auto') cannot choose layers under FSDP2: they must be converted before"
            " `fully_shard`. Measure on one process first (`lightning-precision plan`, or"
            " `fp8_sensitivity` + `PrecisionPlan.decide`) and pass the saved plan: `layers='plan.yaml'`."
        )
    if previous is not None:
        previous.close()
    final, measure = planning_policies(setup.policy, setup.choosing)
    decisions = select_fp8_layers(module, setup.family, layer_policy=measure)
    probe: Callable[[dict[str, Linear]], Any] = (
        (lambda layers: MultiProbe(layers, setup.candidates)) if setup.choosing
        else (lambda layers: SensitivityProbe(layers, setup.probe_config())))
    return Calibration(module, decisions, probe, batches, edge_recorder(module, final))


def decide(decisions: list[LayerDecision], sensitivity: dict[str, Any], not_measured: str | None,
           setup: PlanSetup) -> PrecisionPlan:
    """The plan from the shape rules' ``decisions`` and what was measured: with one candidate, each layer in fp8 where
    ``plan_rule`` accepts its numbers, else in high precision; with several (or an error budget), the exact choice of
    ``PrecisionPlan.choose`` (savings predicted for this process's GPU)."""
    from lightning_precision.fp8._plan import PrecisionPlan

    if setup.choosing:
        return PrecisionPlan.choose(decisions, sensitivity, setup.rule, None, setup.high,
                                    setup.policy.skip_small_layers, setup.backend, not_measured=not_measured)
    return PrecisionPlan.decide(decisions, sensitivity, setup.rule, setup.scaling_family,
                                not_measured=not_measured, high=setup.high)


class Calibration:
    """The measuring of one model. A batch is a Trainer ``training_step`` (whatever the number of optimizers it steps,
    or of batches accumulated per step) and a Fabric backward pass: the unit the probe measures, counted on the host
    (no device read)."""

    def __init__(self, module: Module, decisions: list[LayerDecision], probe: Callable[[dict[str, Linear]], Any],
                 batches: int, recorder: EdgeRecorder | None = None) -> None:
        self.module, self.decisions, self.batches = module, decisions, batches
        self.seen = 0  # batches that ran while measured
        self.counted = 0  # of them, those up to the last optimizer step the loss scaler took
        self.retaken = 0  # batches measured again because the loss scaler skipped their step
        self.ended = False  # a fit stopped before the plan was made (teardown); a later fit measures on
        layers = {d.fqn: cast(Linear, module.get_submodule(d.fqn)) for d in decisions if d.fp8}
        self.probe = probe(layers)  # a SensitivityProbe (one format), or a MultiProbe (choosing among several)
        self.recorder = recorder  # which layers read the model's input and write its logits (its first forward)

    def close(self) -> None:
        self.probe.close()
        if self.recorder is not None:
            self.recorder.close()  # its record stays

    def next_batch(self) -> None:
        """A batch boundary: what the probe staged since the last one is committed (dropped if not finite), and one
        more batch is counted."""
        self.probe.commit()
        self.seen += 1

    def loss(self, loss: Tensor) -> None:
        """The loss of the batch being measured (before its backward): a non-finite one leaves the batch out."""
        self.probe.mark_loss(loss)

    def stepped(self, skipped: bool) -> None:
        """An optimizer step of the loss scaler (fp16 compute). One it skipped overflowed the scale in its batches,
        which is the scaler backing off (its first steps do, routinely), not a fault of the data: they are measured
        again. Every process skips alike, so every one still counts the same batches."""
        if skipped:
            self.retaken += self.seen - self.counted
            self.seen = self.counted
        else:
            self.counted = self.seen

    @property
    def done(self) -> bool:
        return self.seen >= self.batches

    def unmeasured(self, why: str) -> list[LayerDecision]:
        """The shape rules' decisions, with every layer they left reported as not fp8 (nothing unmeasured is)."""
        return [dataclasses.replace(d, fp8=False, reason=f"layers='auto': {why}") if d.fp8 else d
                for d in self.decisions]

    def measuring(self) -> list[LayerDecision]:
        return self.unmeasured(f"not measured yet (the first {self.batches} training batches are measured in high"
                               " precision, then the plan decides)")

    def measured_batch(self, compute_dtype: torch.dtype, report: Report) -> None:
        """A training batch starts being measured (a Fabric backward, a Trainer training step)."""
        if self.ended:  # a new fit of the same model measures on
            self.ended = False
            report(self.measuring())
        self.probe.reopen()  # taken off at teardown (or open still: nothing to do)
        if self.seen == 0:
            # Said when measuring really starts, not at conversion: a resumed fit restores its plan in between (and
            # then measures nothing).
            rank_zero_info(f"fp8: {sum(d.fp8 for d in self.decisions)} eligible linear layers; the first"
                           f" {self.batches} training batches run in {compute_dtype} while their fp8"
                           " numerics are measured (layers='auto'), and the plan is made at the optimizer step that"
                           " ends them.")
        self.next_batch()

    def end_fit(self, owner: str, compute_dtype: torch.dtype, report: Report) -> None:
        """The fit ends (teardown). No hooks on the model between fits (nor the eager stance they hold): it pickles
        (``torch.save(model)``), and a forward of the user's is not measured. The next training batch puts them
        back. A run that trained but stopped before deciding converted nothing: said, and reported."""
        self.close()
        if not self.seen:
            return
        ended = (f"training ended after {self.seen} of the {self.batches} batches to measure" if not self.done
                 else f"training ended after the {self.seen} batches measured, before the optimizer step that makes"
                 " the plan")
        self.ended = True
        report(self.unmeasured(f"{ended}; not measured, not fp8"))
        warn(f"{owner}(layers='auto'): {ended}, so no layer was converted to fp8 and no plan was made: it all trained"
             f" in {compute_dtype}. Train longer, or lower `calibration_batches`.", NoEffectWarning)

    def plan(self, setup: PlanSetup, decide: Decide) -> PrecisionPlan:
        """The measuring is over (every rank at the same step: the sums are all-reduced): the plan ``decide`` makes
        from what was measured, for the layers the final policy leaves."""
        from lightning_precision.fp8._plan import planning_policies

        probe = self.probe
        probe.close()
        sensitivity = probe.result(all_reduce)
        # Batches of skipped steps were measured again: non-finite, they are the loss scale's overflows (at most one
        # per process each), not the data's.
        faults = max(0, probe.dropped - self.retaken * _world_size())
        if faults:
            warn(f"{setup.owner}(layers='auto'): {faults} of the {probe.dropped + probe.batches} batches measured"
                 " (over all processes) had a non-finite loss, or a non-finite input, gradient or fp32 result in a"
                 " measured layer: a fault of the data or the loss, not of fp8. They were left out; the plan is made"
                 f" from the other {probe.batches}.")
        not_measured = (f"not measured: all {probe.dropped} batches measured had non-finite values"
                        if probe.dropped and not probe.batches else None)
        final, _ = planning_policies(setup.policy, setup.choosing)
        edges = self.recorder.edges() if self.recorder is not None else None
        decisions = select_fp8_layers(self.module, setup.family, layer_policy=final, edges=edges)
        return decide(decisions, sensitivity, not_measured)
