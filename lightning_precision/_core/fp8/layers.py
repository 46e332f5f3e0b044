"""What each linear layer of an ``FP8Precision`` model runs, and why: ``LayerBook`` is the one owner of the plugin's
``layer_decisions`` (per layer: fp8 or not, in which format, why) and ``plan`` (the plan in force, which checkpoints
and FP8Guard read). It follows the converted layers (an expert no token reached yet, an MXFP8 layer whose calls all
fell back: not fp8 until they run in it), moves them in place (``demote``, ``step_down``) and merges a resumed
checkpoint's plan with the one given.

``fp8._plan`` is imported where it is used: imported with this module, it would take the Trainer plugin's chain of
imports past the 8 levels allowed."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module

from lightning_precision._core import fsdp
from lightning_precision._core.fp8.args import check_plan_formats, decision_format
from lightning_precision._warnings import warn
from lightning_precision.fp8._selection import (
    LADDER,
    LayerDecision,
    ScalingFamily,
    format_family,
    format_summary,
    replace_modules,
    select_fp8_layers,
    warn_if_no_fp8,
)
from lightning_precision.fp8._torchao import MXFP8_TOKENS, mxfp8_after_first_step
from lightning_precision.fp8._watch import NEVER_RAN, ForwardWatch, warn_never_ran

if TYPE_CHECKING:
    from lightning_precision._core.fp8.args import FP8Args
    from lightning_precision._core.fp8.backend import FP8Backend, LayerMover
    from lightning_precision.fp8._plan import HighLabel, PrecisionPlan

__all__ = ["CONVERTED", "LayerBook", "families_of", "rung_below"]

CONVERTED = "_lightning_precision_fp8_converted"  # set on a converted model: validate/test after fit convert nothing

# Where a layer moves: its format (None: high precision), given its path and module, and the mover of the backend.
Target = Callable[[str, Module, "LayerMover"], "str | None"]


def families_of(decisions: list[LayerDecision], scaling_family: str) -> set[str]:
    """The scaling families the fp8 layers of ``decisions`` compute in (their own formats, or the recipe's)."""
    return {format_family(d.format) if d.format is not None else scaling_family for d in decisions if d.fp8}


def rung_below(mover: LayerMover, module: Module) -> str | None:
    """The format one rung below the one ``module`` computes in (``LADDER``; None: high precision)."""
    here = mover.layer_format(module)
    rung = here if here in LADDER else LADDER[-1]  # the per-tensor and per-row formats share the last rung
    below = LADDER[LADDER.index(rung) + 1] if rung != LADDER[-1] else None
    return below if below != LADDER[-1] else mover.per_tensor_rung()


def check_not_sharded(module: Module, decisions: list[LayerDecision]) -> None:
    """A layer already sharded by ``fully_shard`` cannot be converted: the fp8 layer would lose FSDP's hooks and fail
    at the first forward with a DTensor error. Say what order works instead."""
    from torch.distributed.tensor import DTensor

    sharded = [d.fqn for d in decisions if d.fp8 and isinstance(module.get_submodule(d.fqn).weight, DTensor)]
    if sharded:
        raise RuntimeError(
            f"FP8Precision: {len(sharded)} layer(s) chosen for fp8 are already sharded by FSDP2"
            f" ({', '.join(sharded[:3])}"
            f"{', ...' if len(sharded) > 3 else ''}); fp8 conversion must come before `fully_shard`. With the Trainer,"
            " call `self.trainer.precision_plugin.convert_module(self)` at the top of `configure_model`, before"
            " `fully_shard`. With Fabric, shard in `ModelParallelStrategy(parallelize_fn=...)`, which runs after the"
            " conversion."
        )


class LayerBook:
    """The decisions and the plan of one plugin's converted model (``owner``: the plugin's class name; ``kind``: what
    its low precision is called, ``"fp8"`` or ``"NVFP4"``; ``high``: a plan's label of ``compute_dtype``; ``args``:
    the plugin's checked arguments, a plan given as ``layers`` among them)."""

    def __init__(self, owner: str, kind: str, compute_dtype: torch.dtype, high: HighLabel, args: FP8Args) -> None:
        self.owner, self.kind, self.compute_dtype, self.high = owner, kind, compute_dtype, high
        self.fsdp_float8_all_gather = args.fsdp_float8_all_gather  # asked (True, False), or left to the strategy
        self.float8_all_gather = False  # whether the converted layers all-gather in fp8
        self._scales: fsdp.Float8ScalePrecompute | None = None  # theirs, once FSDP2 has sharded them
        self.given = args.plan is not None  # `plan` starts as the one given (and `demote` changes it)
        self.plan = args.plan
        self.decisions: list[LayerDecision] = []
        self.fp8_count: int | None = None  # known once the first backward has shown which layers run
        self._watch: ForwardWatch | None = None
        self._idle: dict[str, LayerDecision] = {}  # the decisions of chosen layers not run yet
        self._short_mxfp8: dict[str, LayerDecision] = {}  # MXFP8 layers reported not fp8 until a call runs in it
        self._root: weakref.ref | None = None  # the module converted: `decisions` name paths in it

    def root(self) -> Module | None:
        return self._root() if self._root is not None else None

    def report(self, decisions: list[LayerDecision]) -> None:
        """What the layers run now, without converting (``layers="auto"``: measured, or not measured after all)."""
        self.decisions = decisions

    def measure(self, module: Module, decisions: list[LayerDecision]) -> None:
        """``layers="auto"`` measures ``module`` (marked converted: its layers convert when the plan is made): none runs
        in fp8 meanwhile, and ``metrics()`` says so."""
        self.decisions, self.fp8_count = decisions, 0
        setattr(module, CONVERTED, True)

    def adopt(self, plan: PrecisionPlan) -> None:
        """``plan`` is in force from now on (made by ``layers="auto"``, or restored)."""
        self.plan = plan

    def meet(self, module: Module, measured: bool) -> None:
        """A model about to be converted. A plan made on another model (measured on its weights and batches, or
        changed by ``demote``) says nothing about this one, whose layers may even share its paths: start from what
        was asked, as a new plugin would (``measured``: ``layers="auto"``, which measures again)."""
        if self._root is None or self.root() is module:
            return
        if self.plan is not None:
            how = "it is measured again" if measured else "the shape rules choose"
            rank_zero_info(f"{self.owner}: a new model; the plan made for the previous one is not applied to it"
                           f" ({how}). To apply a plan to another model, pass it: `layers=plugin.plan`.")
        self.plan = None

    def decisions_of_plan(self, module: Module, backend: FP8Backend) -> list[LayerDecision]:
        """fp8 where the plan in force says so, each layer in the format it names, where the rules that always hold
        for that format (divisibility, a forward that runs) allow."""
        plan = self.plan
        assert plan is not None  # made, given or restored just before
        check_plan_formats(plan, self.owner, backend, self.fsdp_float8_all_gather)  # a restored plan is checked here
        every = lambda m, fqn: True  # noqa: E731  (the hard rules alone)
        hard = select_fp8_layers(module, backend.scaling_family, module_filter=every)
        plan = plan.by_first_path(hard)  # a layer may be named by any of its paths
        unknown = sorted(plan.fp8_layers - {d.fqn for d in hard})
        if unknown:
            raise ValueError(f"{self.owner}: the plan puts layers in fp8 that this model does not have as"
                             f" nn.Linear: {', '.join(unknown)}. Is it the plan of another model?")
        entries = {p.fqn: p for p in plan.layers}
        rules = {backend.scaling_family: {d.fqn: d for d in hard}}  # the hard rules per scaling family, made once each
        out = []
        for d in hard:
            entry = entries.get(d.fqn)
            low = entry is not None and entry.low
            fmt = decision_format(entry.precision, backend.recipe_format) if entry is not None and low else None
            family = format_family(fmt) if fmt is not None else backend.scaling_family
            if family not in rules:
                rules[family] = {r.fqn: r for r in select_fp8_layers(module, family, module_filter=every)}
            rule = rules[family][d.fqn]
            if not rule.fp8:
                out.append(rule)
            elif entry is None:
                out.append(dataclasses.replace(rule, fp8=False, reason="not in the plan"))
            else:
                out.append(dataclasses.replace(rule, fp8=low, reason=f"plan: {entry.reason}", format=fmt))
        return out

    def apply_plan(self, module: Module, backend: FP8Backend, to_be_sharded: Callable[[], bool],
                   restored: bool = False) -> Module:
        """Convert as the plan in force says, and print it once: the plan's table, with its numbers (``restored``:
        from a checkpoint, not measured again)."""
        assert self.plan is not None  # made, given or restored just before
        table = self.plan.table()
        if restored:
            # a plan of measured batches is layers="auto"'s; without, the shape rules' (timed on a GPU, or demoted)
            source = "layers='auto'" if self.plan.batches else self.plan.speed_source or "the shape rules"
            table = f"fp8 ({source}): the plan restored from the checkpoint, not measured again:\n{table}"
        return self.convert(module, self.decisions_of_plan(module, backend), backend, to_be_sharded, table)

    def convert(self, module: Module, decisions: list[LayerDecision], backend: FP8Backend,
                to_be_sharded: Callable[[], bool], table: str | None = None) -> Module:
        """Convert the layers ``decisions`` choose (in place below the root), saying so (``table``, by default the
        decisions' summary); which of them run is seen from the first backward on. ``to_be_sharded``: whether FSDP2
        is about to shard the model (then its weights may all-gather in fp8)."""
        self.decisions = decisions
        check_not_sharded(module, decisions)
        rank_zero_info(table if table is not None else format_summary(decisions))
        warn_if_no_fp8(decisions, self.owner, self.kind)
        self.float8_all_gather = backend.float8_all_gather(
            self.fsdp_float8_all_gather, to_be_sharded, families_of(decisions, backend.scaling_family), self.owner)
        module, layers = backend.convert(module, decisions, self.float8_all_gather)
        if self._watch is not None:  # a watch of an earlier conversion
            self._watch.close()
        self._watch, self._idle, self._short_mxfp8 = ForwardWatch(layers), {}, {}
        self.fp8_count = None
        self._root = weakref.ref(module)
        setattr(module, CONVERTED, True)
        return module

    def on_sharded(self, module: Module) -> None:
        """FSDP2 has sharded the converted model: layers that all-gather in fp8 get their scales precomputed after each
        optimizer step (one all-reduce for all), and gloo, which has no float8 dtype, gathers their bytes."""
        if not self.float8_all_gather:
            return
        self._scales = fsdp.Float8ScalePrecompute(module)
        if fsdp.process_group_backend() == "gloo":
            fsdp.install_byte_all_gather(module)

    def before_forward(self) -> None:
        if self._scales is not None:
            self._scales.before_forward()

    def after_optimizer_step(self) -> None:
        if self._scales is not None:
            self._scales.after_optimizer_step()

    def after_backward(self) -> None:
        """After the first backward a layer that did not run its forward is not fp8, whatever was decided (a weight
        used functionally elsewhere): say so, and make the decisions tell the truth. One that runs later (an expert no
        token reached at first) computes in fp8 from then on: the decisions say so again."""
        watch = self._watch
        if watch is not None and not watch.settled:
            idle = watch.settle()
            if idle:
                self._idle = {d.fqn: d for d in self.decisions if d.fqn in idle}
                self.decisions = [dataclasses.replace(d, fp8=False, reason=NEVER_RAN) if d.fqn in idle else d
                                  for d in self.decisions]
                warn_never_ran(idle)
            self._judge_mxfp8(watch, [fqn for fqn in watch.layers if fqn not in idle])
        elif watch is not None:
            ran = watch.ran()
            if ran:
                self._count_again({fqn: self._idle.pop(fqn) for fqn in ran if fqn in self._idle})
                # An MXFP8 expert's first step is judged as the others' was: every call short of a block is not fp8.
                self._judge_mxfp8(watch, ran)
        if watch is not None:
            if not watch.watching:
                self._watch = None
            self.fp8_count = sum(d.fp8 for d in self.decisions)
        if self._short_mxfp8:
            self._recheck_short_mxfp8()

    def _count_again(self, restored: Mapping[str, LayerDecision]) -> None:
        """Layers reported not fp8 for a while (an idle expert, an MXFP8 layer whose calls all fell back) that have run
        in fp8: their decisions back. A plan ``demote`` took while they read "not fp8" (it keeps the plan from then on:
        FP8Guard's file, checkpoints) says fp8 for them again: left stale, a run resumed from it demoted them."""
        from lightning_precision.fp8._plan import FP8

        was = {d.fqn: d.reason for d in self.decisions if d.fqn in restored}
        self.decisions = [restored.get(d.fqn, d) for d in self.decisions]
        for fqn, decision in restored.items():
            entry = self.plan.get(fqn) if self.plan is not None else None
            if self.plan is not None and entry is not None and not entry.low and entry.reason == was.get(fqn):
                self.plan = self.plan.with_layer(fqn, decision.format or FP8, decision.reason)

    def _judge_mxfp8(self, watch: ForwardWatch, ran: list[str]) -> None:
        """MXFP8 layers among ``ran`` (each in the backward after its first call) that ran but never in MXFP8 (too few
        tokens for a block, every call): not fp8 either, until a call runs in MXFP8 (``_recheck_short_mxfp8``)."""
        short = mxfp8_after_first_step(watch.layers, self.compute_dtype, self.owner, ran=ran)
        if short:
            self._short_mxfp8.update({d.fqn: d for d in self.decisions if d.fqn in short})
            self.decisions = [dataclasses.replace(d, fp8=False, reason=short[d.fqn]) if d.fqn in short else d
                              for d in self.decisions]

    def _recheck_short_mxfp8(self) -> None:
        """An MXFP8 layer reported not fp8 (every call fell back) that has since run a call in MXFP8 (sequences of
        another length) is fp8 again: a host-side flag per such layer, read after each backward."""
        module = self.root()
        if module is None:
            return
        ran = [fqn for fqn in self._short_mxfp8 if getattr(module.get_submodule(fqn), "_mxfp8_ran", False)]
        if not ran:
            return
        self._count_again({fqn: self._short_mxfp8.pop(fqn) for fqn in ran})
        self.fp8_count = sum(d.fp8 for d in self.decisions)
        rank_zero_info(f"fp8: {', '.join(ran)}: a training call of a multiple of {MXFP8_TOKENS} tokens ran in"
                       " MXFP8; counted as fp8 again.")

    def metrics(self, recipe_format: str) -> dict[str, Tensor]:
        """How many layers compute in fp8 (and in each format, when they are mixed), once known."""
        if self.fp8_count is None:
            return {}
        metrics = {"precision/fp8_layers": torch.tensor(float(self.fp8_count))}
        if any(d.format is not None for d in self.decisions if d.fp8):  # mixed formats: each one's count
            formats = [d.format or recipe_format for d in self.decisions if d.fp8]
            for fmt in dict.fromkeys(formats):
                metrics[f"precision/fp8_layers/{fmt}"] = torch.tensor(float(formats.count(fmt)))
        return metrics

    def fp8_modules(self) -> dict[str, Module]:
        """The converted layers that compute in fp8 now, by path."""
        module = self.root()
        return {} if module is None else {d.fqn: module.get_submodule(d.fqn) for d in self.decisions if d.fp8}

    def plan_in_force(self, scaling_family: ScalingFamily) -> PrecisionPlan | None:
        """The plan, or that of the decisions (the shape rules' choice); None before any."""
        from lightning_precision.fp8._plan import PrecisionPlan

        if self.plan is not None or not self.decisions:
            return self.plan
        return PrecisionPlan.from_decisions(self.decisions, scaling_family, self.high)

    def demote(self, layers: Mapping[str, str], numbers: Mapping[str, dict[str, float]] | None,
               backend: FP8Backend) -> list[str]:
        """The named fp8 layers back to high precision, in place (``FP8Precision.demote``)."""
        return list(self._move("demote", layers, numbers, backend, lambda fqn, module, mover: None))

    def step_down(self, layers: Mapping[str, str], numbers: Mapping[str, dict[str, float]] | None,
                  backend: FP8Backend) -> dict[str, str]:
        """The named low-precision layers one rung down the ladder, in place (``FP8Precision.step_down``)."""
        return self._move("step_down", layers, numbers, backend, lambda fqn, module, mover: rung_below(mover, module))

    def _move(self, verb: str, layers: Mapping[str, str], numbers: Mapping[str, dict[str, float]] | None,
              backend: FP8Backend, target: Target, resumed: bool = False) -> dict[str, str]:
        """Move the named converted layers to the format ``target`` gives each (None: ``compute_dtype``), in place,
        and record it (``demote``, ``step_down``, and a resumed run's plan). A layer already in its target stays, and
        is not recorded unless ``resumed``: the checkpoint's plan put it there (a layer stepped down to the recipe's
        own format, which the new conversion gave it too), and the plan and decisions say so, as the run's did."""
        current, root = self.fp8_modules(), self.root()
        if root is not None:
            # Converted layers reported not fp8 for now still compute in fp8 when they run (an expert no token has
            # reached yet; an MXFP8 layer whose calls all fell back so far): they move too, or they would come back.
            current.update({fqn: root.get_submodule(fqn) for fqn in (*self._idle, *self._short_mxfp8)})
        # A layer registered under several names (tied) is one layer, decided under its first name: any name moves it.
        first = {alias: d.fqn for d in self.decisions for alias in d.aliases}
        layers = {first.get(fqn, fqn): why for fqn, why in layers.items()}
        numbers = {first.get(fqn, fqn): n for fqn, n in numbers.items()} if numbers else None
        chosen = [fqn for fqn in layers if fqn in current]
        if not chosen:
            return {}
        mover = backend.movable(f"{self.owner}.{verb}")
        assert root is not None  # layers compute in fp8: the model is converted
        moved: dict[str, str | None] = {}
        for fqn in chosen:
            module = current[fqn]
            fmt = target(fqn, module, mover)
            if fmt == mover.layer_format(module):
                if resumed:
                    moved[fqn] = fmt
                continue
            new = mover.set_layer_format(module, fmt, fqn)
            if new is not module:
                replace_modules(root, {id(module): new})
            moved[fqn] = fmt
            self._short_mxfp8.pop(fqn, None)  # no longer an MXFP8 layer: its fallbacks are over
        if moved:
            self._record_moves(moved, layers, numbers or {}, backend)
        return {fqn: fmt or self.high for fqn, fmt in moved.items()}

    def _record_moves(self, moved: dict[str, str | None], why: Mapping[str, str],
                      numbers: Mapping[str, dict[str, float]], backend: FP8Backend) -> None:
        """The plan says each moved layer's new format; its decision says it as a plan's does (``decision_format``:
        None for the plugin's own recipe), so a resumed run, which decides from the plan, reports it alike."""
        plan = self.plan_in_force(backend.scaling_family)
        assert plan is not None  # layers run in fp8: the model is converted and decided
        for fqn, fmt in moved.items():
            plan = plan.with_layer(fqn, fmt or self.high, why[fqn], numbers.get(fqn))
        self.plan = plan

        def moved_decision(d: LayerDecision) -> LayerDecision:
            fmt = moved[d.fqn]
            if fmt is None:
                return dataclasses.replace(d, fp8=False, format=None, reason=f"demoted: {why[d.fqn]}")
            return dataclasses.replace(d, fp8=True, format=decision_format(fmt, backend.recipe_format),
                                       reason=f"stepped down to {fmt}: {why[d.fqn]}")

        for fqn in moved:  # an expert not run yet: reported not fp8 until it runs, then as it is now
            idle = self._idle.pop(fqn, None)
            if idle is not None and moved[fqn] is not None:
                self._idle[fqn] = moved_decision(idle)
        self.decisions = [moved_decision(d) if d.fqn in moved and d.fqn not in self._idle else d
                          for d in self.decisions]
        if self.fp8_count is not None:
            self.fp8_count = sum(d.fp8 for d in self.decisions)

    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict()} if self.plan is not None else {}

    def resume(self, state: Any, backend: FP8Backend, shown: str, measuring: bool) -> None:
        """A checkpoint's plan (``state``: what the run trained with, FP8Guard's demotions included) beside the plan
        given as ``layers`` (``shown``), if any: while ``layers="auto"`` measures, the saved plan is the plan (the
        plugin converts as it says); before conversion, the plan to convert with; after it, what the run moved (to
        high precision, or down the ladder) moves again."""
        from lightning_precision.fp8._plan import FP8, PrecisionPlan

        saved = PrecisionPlan.from_dict(state, source=f"the checkpoint's plan ({self.owner} state)")
        given = self.plan if self.given else None
        mismatch = saved.recipe_mismatch(backend.scaling_family)
        # a given plan's mismatch was said at construction
        if mismatch and (given is None or given.scaling_family != saved.scaling_family):
            warn(f"{self.owner}: resuming: {mismatch}")
        if given is not None:
            self._warn_plans_differ(saved, given, backend.recipe_format, shown)
            moved = {p.fqn: p for p in saved.layers if p.precision != FP8 and p.fqn in given.fp8_layers}
        else:
            # in high precision, or in a format of its own (FP8Guard's steps down the ladder)
            moved = {p.fqn: p for p in saved.layers if p.precision != FP8}
        if measuring:
            self.plan = saved
        elif not self.decisions:  # not converted yet: convert as the saved run was (and as asked, if asked)
            if given is not None:
                for fqn, p in moved.items():
                    given = given.with_layer(fqn, p.precision if p.low else self.high, p.reason, p.numbers)
            self.plan = given if given is not None else saved
        else:  # converted already: what the run moved stays where it went
            self._move("load_state_dict", {f: p.reason for f, p in moved.items()},
                       {f: p.numbers for f, p in moved.items()}, backend,
                       lambda fqn, module, mover: saved.format_of(fqn), resumed=True)

    def _warn_plans_differ(self, saved: PrecisionPlan, given: PrecisionPlan, recipe_format: str, shown: str) -> None:
        """The checkpoint's plan is what the run trained with, FP8Guard's demotions included; the given one is what
        the user asks for now (perhaps edited after a divergence). Neither is dropped: a layer stays in fp8 only where
        both say fp8, and nothing is promoted to fp8 behind the optimizer's back."""
        from lightning_precision.fp8._plan import FP8

        def runs_in(plan: PrecisionPlan, fqn: str) -> str | None:
            fmt = plan.format_of(fqn)
            return recipe_format if fmt == FP8 else fmt

        differ = sorted(f for f in given.fp8_layers | saved.fp8_layers if runs_in(given, f) != runs_in(saved, f))
        if not differ:
            return

        def says(plan: PrecisionPlan, fqn: str) -> str:
            entry = plan.get(fqn)
            if fqn in plan.fp8_layers:
                return entry.precision if entry else FP8
            return f"{entry.precision} ({entry.reason})" if entry else "not listed"

        warn(f"{self.owner}: the checkpoint's plan (what the run trained with, FP8Guard's demotions included)"
             f" differs from `layers={shown}` for {len(differ)} layer(s): "
             + "; ".join(f"{f}: {says(given, f)} given, {says(saved, f)} in the checkpoint" for f in differ)
             + f". On resume a layer stays in fp8 only where both plans say so (else it runs in"
             f" {self.compute_dtype}), and in the checkpoint's format where it names one of its own (FP8Guard"
             " steps a failing layer down). To train a layer in a format the checkpoint moved it from, start a"
             " new fit from the checkpoint's weights (not `ckpt_path=`).")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_watch"] = None  # its layers and pre-hook handles stay with the process that set them
        state["_root"] = None  # a weak reference; set again when the new process converts
        state["_scales"] = None  # found again when the model is sharded in the new process
        return state
