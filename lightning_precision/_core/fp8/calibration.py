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
from typing_extensions import override

from lightning_precision._core import fsdp
from lightning_precision._core.accumulator import all_reduce
from lightning_precision._warnings import NoEffectWarning, warn
from lightning_precision.fp8._edges import EdgeRecorder
from lightning_precision.fp8._hardware import required_capability
from lightning_precision.fp8._selection import (
    FP8LayerPolicy,
    LayerDecision,
    ScalingFamily,
    format_family,
    select_fp8_layers,
)
from lightning_precision.fp8._sensitivity import MultiProbe, SensitivityProbe
from lightning_precision.fp8._step_shapes import RowProbe

if TYPE_CHECKING:
    from lightning_precision.fp8._plan import HighLabel, PlanRule, PrecisionPlan
    from lightning_precision.fp8._plan_types import MeasuredSpeed
    from lightning_precision.fp8._timing import LayerShape, Timer

__all__ = ["Calibration", "PlanSetup", "ShapeTiming", "decide", "runs_here", "start_calibration", "start_timing",
           "timed_plan"]

Report = Callable[[list[LayerDecision]], None]  # what the layers run now, told to the plugin's layer book
Decide = Callable[[list[LayerDecision], dict[str, Any], "str | None", "MeasuredSpeed | None"], "PrecisionPlan"]


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
    # On a CUDA GPU with real fp8 (torchao): its timer, the formats it runs among those allowed (timed there instead
    # of predicted), and whether the model runs compiled (each layer is timed the way it runs).
    timer: Timer | None = None
    timed_formats: tuple[str, ...] = ()
    compiled: bool = False

    def speed(self, shapes: dict[str, LayerShape]) -> MeasuredSpeed | None:
        """``shapes`` timed on this GPU (every rank the mean of all ranks' timings: one decision everywhere); None
        without a timer, with no shape or format to time, or where the timing failed on any rank (said, naming the
        error: the shape rules decide then, as without a GPU, and training goes on)."""
        from lightning_precision.fp8._timing import time_shapes

        if self.timer is None or not shapes or not self.timed_formats:
            return None
        try:
            local: MeasuredSpeed | None = time_shapes(shapes, self.timed_formats, self.high, self.compiled, self.timer)
            failed = ""
        except Exception as err:  # an OOM beside the model's own memory, an inductor error compiling the one layer
            local, failed = None, f"{type(err).__name__}: {str(err).strip()[:300]}"
        return _mean_over_ranks(local, list(shapes), self.timed_formats, failed, self.owner)

    @property
    def family(self) -> str:
        """The scaling family whose GEMM rules choose the layers to plan: the recipe's, or (choosing among formats,
        each held to its own rules by the choice) fp8's 16."""
        return "tensorwise" if self.choosing else self.scaling_family


def _mean_over_ranks(local: MeasuredSpeed | None, fqns: list[str], formats: tuple[str, ...], failed: str,
                     owner: str) -> MeasuredSpeed | None:
    """Every rank's timings averaged (one all-reduce, the same on every rank: one that failed sends zeros and a flag,
    so none waits on it), or None where any rank's timing failed, said once."""
    from lightning_precision.fp8._plan_types import MeasuredSpeed

    kinds: list[str | None] = [None, *formats]
    values = [0.0] * (len(fqns) * len(kinds)) if local is None else [
        local.high_seconds[f] if k is None else local.low_seconds[k][f] for f in fqns for k in kinds]
    world = _world_size()
    summed = all_reduce(torch.tensor([*values, float(local is None)], dtype=torch.float64)).cpu()
    if summed[-1] > 0:
        where = f" ({failed})" if failed else ""
        ranks = f" on {int(summed[-1])} of {world} processes" if world > 1 else ""
        warn(f"{owner}: timing the layers' shapes on this GPU failed{ranks}{where}. Nothing was timed: the shape"
             " rules decide which layers run in fp8, as without a GPU, and training goes on.")
        return None
    assert local is not None  # no rank failed, this one included
    mean = (summed[:-1] / world).tolist()
    at = {(f, k): mean[i * len(kinds) + j] for i, f in enumerate(fqns) for j, k in enumerate(kinds)}
    return MeasuredSpeed(local.device, local.high, local.compiled, {f: at[(f, None)] for f in fqns},
                         {k: {f: at[(f, k)] for f in fqns} for k in formats})


def runs_here(fmt: str) -> bool:
    """Whether this process's CUDA GPU runs torchao's ``fmt`` for real, by its own compute capability
    (``fp8._hardware``'s thresholds: MXFP8 needs 10.0), not by the speed table's entry, which stands an H100 in for a
    GPU it lacks: only such formats are timed, and only timed formats can be chosen."""
    return gpu_capability() >= required_capability(format_family(fmt))


def gpu_capability() -> tuple[int, int]:
    """This CUDA GPU's compute capability. A timer where CUDA is unavailable is a test's stand-in of an fp8 GPU (CI
    has none): taken as a Hopper's 9.0 (a test replaces this to stand in a Blackwell)."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)


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
        if previous.module is not module and not isinstance(previous, ShapeTiming):
            first = type(previous.module).__name__
            warn(f"{setup.owner}(layers='auto') measures one model at a time: another model was set up before the"
                 f" {first} set up first had its plan made, so that {first} is not measured: it trains in high"
                 " precision, no layer in fp8. Set up one model per plugin with layers='auto', or plan each"
                 " beforehand (`lightning-precision plan`) and pass its plan.", NoEffectWarning)
    final, measure = planning_policies(setup.policy, setup.choosing)
    decisions = select_fp8_layers(module, setup.family, layer_policy=measure)
    probe: Callable[[dict[str, Linear]], Any] = (
        (lambda layers: MultiProbe(layers, setup.candidates)) if setup.choosing
        else (lambda layers: SensitivityProbe(layers, setup.probe_config())))
    return Calibration(module, decisions, probe, batches, edge_recorder(module, final))


def decide(decisions: list[LayerDecision], sensitivity: dict[str, Any], not_measured: str | None,
           setup: PlanSetup, speed: MeasuredSpeed | None = None) -> PrecisionPlan:
    """The plan from the shape rules' ``decisions`` and what was measured: with one candidate, each layer in fp8 where
    ``plan_rule`` accepts its numbers (and, timed, where it was measured faster), else in high precision; with several
    (or an error budget), the exact choice of ``PrecisionPlan.choose`` (savings timed on this GPU where ``speed``
    is given, else predicted for it)."""
    from lightning_precision.fp8._plan import PrecisionPlan

    if setup.choosing:
        return PrecisionPlan.choose(decisions, sensitivity, setup.rule, None, setup.high,
                                    setup.policy.skip_small_layers, setup.backend, savings=speed,
                                    not_measured=not_measured)
    return PrecisionPlan.decide(decisions, sensitivity, setup.rule, setup.scaling_family,
                                not_measured=not_measured, high=setup.high, speed=speed)


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
        return decide(decisions, sensitivity, not_measured, setup.speed(self._shapes(sensitivity, setup.choosing)))

    def _shapes(self, sensitivity: dict[str, Any], choosing: bool) -> dict[str, LayerShape]:
        """Each measured layer's shape, on the tokens the probe saw it take (the same on every rank: all-reduced)."""
        from lightning_precision.fp8._timing import layer_shape

        by_layer = {fqn: s for by in sensitivity.values() for fqn, s in by.items()} if choosing else sensitivity
        return {fqn: layer_shape(self.module, fqn, s.tokens) for fqn, s in by_layer.items() if s.tokens > 0}


class ShapeTiming(Calibration):
    """The default layer selection (``layers=None``) on a CUDA GPU with real fp8: the first training batch runs in the
    high dtype while each eligible layer's rows are counted; at the optimizer step that ends it each distinct shape is
    timed on the GPU (``PlanSetup.speed``) and only the layers measured faster are converted. ``earlier``: the timings
    of models set up on the same plugin before this one whose batch has not ended (a GAN's generator and
    discriminator): they are measured in the same batch and each is timed and converted at the same step."""

    def __init__(self, module: Module, decisions: list[LayerDecision], earlier: ShapeTiming | None = None) -> None:
        super().__init__(module, decisions, RowProbe, 1)
        self.earlier = earlier

    def models(self) -> list[ShapeTiming]:
        """Each model's timing, the first set up first."""
        return [*(self.earlier.models() if self.earlier is not None else []), self]

    @override
    def close(self) -> None:
        for timing in self.models():
            Calibration.close(timing)

    @override
    def unmeasured(self, why: str) -> list[LayerDecision]:
        return [dataclasses.replace(d, fp8=False, reason=f"speed: {why}") if d.fp8 else d for d in self.decisions]

    @override
    def measuring(self) -> list[LayerDecision]:
        return self.unmeasured("not timed yet (the first training batch runs in high precision; then each layer's"
                               " shape is timed on this GPU, and the layers measured faster are converted)")

    @override
    def measured_batch(self, compute_dtype: torch.dtype, report: Report) -> None:
        if self.ended:
            self.ended = False
            report(self.measuring())
        for timing in self.models():
            timing.probe.reopen()
        if self.seen == 0:
            rank_zero_info(f"fp8: {sum(d.fp8 for t in self.models() for d in t.decisions)} eligible linear layers; the"
                           f" first training batch runs in {compute_dtype} while their shapes are recorded, then each"
                           " is timed on this GPU in fp8 and in the high dtype, and only those measured faster are"
                           " converted.")
        self.next_batch()

    def timed(self, setup: PlanSetup, fmt: str) -> tuple[list[LayerDecision], MeasuredSpeed | None]:
        """The shape rules' decisions with each eligible layer in ``fmt`` where it was measured faster, else in high
        precision with the two timings. A layer idle in the measured batch (no rows: an expert no token reached, a
        network that runs only after the first optimizer step) is timed at the most rows a layer of its shape took;
        with none, it stays in high precision: never converted untimed. Where the timing failed (said), the shape
        rules' decisions stand, as without a GPU. With them, the timings (None where nothing was timed)."""
        from lightning_precision.fp8._timing import layer_shape

        probe = cast(RowProbe, self.probe)
        probe.close()
        rows = probe.result(lambda t: all_reduce(t, "max"))  # the same on every rank
        shapes = {fqn: layer_shape(self.module, fqn, tokens) for fqn, tokens in rows.items()}
        most: dict[tuple[int, int, bool], int] = {}
        for shape in shapes.values():
            key = (shape.in_features, shape.out_features, shape.bias)
            most[key] = max(most.get(key, 0), shape.tokens)
        idle = [d.fqn for d in self.decisions if d.fp8 and d.fqn not in shapes]
        for fqn in idle:
            shape = layer_shape(self.module, fqn, 1)
            if (shape.in_features, shape.out_features, shape.bias) in most:
                shapes[fqn] = shape._replace(tokens=most[(shape.in_features, shape.out_features, shape.bias)])
        speed = setup.speed(shapes) if shapes else None
        if speed is None and shapes:
            return self.decisions, None  # the timing failed (said): the shape rules decide
        if speed is not None:
            rank_zero_info(f"fp8: {len(dict.fromkeys(shapes.values()))} distinct layer shapes timed (speed measured"
                           f" on {speed.device}, {'compiled' if speed.compiled else 'eager'}).")
        out = []
        for d in self.decisions:
            if not d.fp8:
                out.append(d)
            elif speed is None or d.fqn not in speed.high_seconds:
                out.append(dataclasses.replace(d, fp8=False, reason=IDLE))
            else:
                said = speed.said(fmt, d.fqn)
                if d.fqn in idle:
                    said += "; idle in the measured batch, timed at the rows of a layer of its shape"
                out.append(dataclasses.replace(d, fp8=speed.saving(fmt, d.fqn) > 0, reason=said))
        return out, speed


def timed_plan(decisions: list[LayerDecision], speed: MeasuredSpeed, setup: PlanSetup) -> PrecisionPlan:
    """The plan of layers converted as timed: what the plugin's ``state_dict`` keeps, so a resumed run converts as this
    one did instead of timing again (a new timing could flip a layer's precision mid-run)."""
    from lightning_precision.fp8._plan import PrecisionPlan

    plan = PrecisionPlan.from_decisions(decisions, setup.scaling_family, setup.high)
    return dataclasses.replace(plan, device=speed.device, device_here=True, benchmarked=True)


# Why an eligible layer that took no rows in the measured batch, and has no layer of its shape that did, stays high:
# converting it untimed could make it slower than bf16, the very thing timing is there to prevent.
IDLE = "not timed: idle in the measured batch (and no layer of its shape ran), so kept in high precision"


def start_timing(module: Module, decisions: list[LayerDecision], previous: Calibration | None) -> ShapeTiming:
    """Start recording the rows of ``module``'s eligible layers for one batch. ``previous``: a measuring that never
    finished: another model's timing still waiting for its batch is kept (several models set up on one plugin are
    each timed); the same model's, or ``layers="auto"``'s, goes with its hooks."""
    earlier = None
    if isinstance(previous, ShapeTiming) and previous.module is not module:
        earlier = previous
    elif previous is not None:
        previous.close()
    return ShapeTiming(module, decisions, earlier)
