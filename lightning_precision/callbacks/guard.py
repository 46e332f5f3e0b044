"""FP8Guard: watches the fp8 layers' numerics during training and moves a layer that degrades one rung down the
ladder (MXFP8 -> per-tensor/row fp8 -> high precision), or straight back to high precision.

At a cadence, one optimizer step is measured by the same ``SensitivityProbe`` that ``FP8Precision(layers="auto")``
calibrates with, one probe per format the fp8 layers compute in (its hooks run first on each layer, and the measured
step runs eagerly under ``torch.compile``), and each layer's input is summarised on the device (kurtosis, largest
magnitude: early divergence signals). Every layer the rule now rejects (``demotions``), or whose signals pass their
bounds, moves in place by ``FP8Precision.step_down`` (or ``demote``): same module, same Parameters, the optimizer
state intact.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_precision._checks import is_positive_int
from lightning_precision._core.accumulator import Accumulator, ReduceOp, all_reduce
from lightning_precision._core.probe_pass import in_probe_pass
from lightning_precision._io import check_writable_dir, check_writable_file, create_new_file
from lightning_precision._upstream.lightning import batches_that_stepped, publish_metrics, should_update_logs
from lightning_precision._warnings import NoEffectWarning, process_rank, warn
from lightning_precision.callbacks._cadence import on_cadence
from lightning_precision.fp8._plan import HIGH, PlanRule, demotions, high_label, measured_numbers, plan_suffix
from lightning_precision.fp8._selection import BLOCK_SCALED
from lightning_precision.fp8._sensitivity import SensitivityProbe
from lightning_precision.fp8._torchao import MXFP8_FLAG, layer_format

__all__ = ["DEFAULT_PLAN_FILE", "FP8Guard", "GuardEvent", "InputSignals", "MEASURED_BLOCK_FORMATS"]

DEFAULT_PLAN_FILE = "fp8_plan.yaml"

# The block-scaled formats the probe measures with their own block casts (`SensitivityProbe(layers, "mxfp8")`). The
# guard refuses layers in any other block format: it would judge them by another cast's numerics.
MEASURED_BLOCK_FORMATS: tuple[str, ...] = ("mxfp8",)


# The smallest share of its terms' size a moment computed from fp64 power sums keeps: ~1e6 fp64 epsilons, room for
# the sums' rounding over millions of elements.
_RESOLVED = 1e-10


def _unmeasurable(fmt: str | None) -> bool:
    return fmt in BLOCK_SCALED and fmt not in MEASURED_BLOCK_FORMATS


def _refuse_blocks(fmt: str) -> ValueError:
    return ValueError(f"FP8Guard: its measurement casts per tensor or per row, not in the blocks of {fmt}; it would"
                      " judge these layers by the wrong numerics. Watch them with"
                      f" `GradientUnderflowMonitor(formats=({fmt!r},))` instead.")


def _check_movable(plugin: Any) -> None:
    """Refuse, before training, fp8 layers that could not be measured or moved in place when the time came."""
    if not plugin.moves_layers:
        raise ValueError("FP8Guard: Transformer Engine layers cannot return to high precision in place, nor"
                         " change format (NVFP4 included); use `FP8Precision(backend='torchao')`, or pass a plan"
                         " (`layers='plan.yaml'`).")
    if _unmeasurable(plugin.scaling_family):
        raise _refuse_blocks(plugin.scaling_family)
    for fmt in {layer_format(m) for m in plugin.fp8_modules().values()}:  # a plan of mixed formats
        if fmt is not None and _unmeasurable(fmt):
            raise _refuse_blocks(fmt)
    if getattr(plugin, "_float8_all_gather", False):
        raise ValueError("FP8Guard: these fp8 layers all-gather their weights in fp8 (`fsdp_float8_all_gather`), whose"
                         " weights are torchao tensor subclasses that cannot return to high precision in place. Leave"
                         " `fsdp_float8_all_gather` off, or measure first and pass a plan.")


@dataclass(frozen=True)
class GuardEvent:
    """A layer moved at optimizer step ``step``, why, and ``to`` what: the format one rung down, or the high label
    (``"bf16"``, ...; ``"high"`` in events recorded before the ladder)."""

    step: int
    fqn: str
    reason: str
    to: str = HIGH


def _probe_config(module: Any) -> Any:
    """What a probe measures ``module``'s format with: its own torchao config, or the block format's name."""
    return "mxfp8" if getattr(module, MXFP8_FLAG, False) else module.config


class InputSignals:
    """Early divergence signals of each layer's input on a measured step, accumulated on the device by a forward
    pre-hook: per layer the training calls, elements and the sums of x, x^2, x^3, x^4 (fp64), and the largest |x|. A
    call holding a non-finite value is left out (a fault of the data, as the probe judges it). ``result(reduce)``
    reads them once: ``{fqn: (kurtosis, amax)}`` for the layers that ran."""

    def __init__(self, layers: Mapping[str, nn.Linear]) -> None:
        self.layers = dict(layers)
        self._row = {fqn: i for i, fqn in enumerate(self.layers)}
        self.state = Accumulator()
        self._handles = [m.register_forward_pre_hook(self._hook(fqn)) for fqn, m in self.layers.items()]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _allocate(self, device: torch.device) -> None:
        rows = len(self.layers)
        self.state.add_state("sums", torch.zeros(rows, 6, dtype=torch.float64, device=device), "sum")
        self.state.add_state("amax", torch.zeros(rows, dtype=torch.float64, device=device), "max")

    def _hook(self, fqn: str) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            if not torch.is_grad_enabled() or not isinstance(x, Tensor) or x.numel() == 0 or in_probe_pass():
                return
            d = x.detach().reshape(-1).double()
            amax = d.abs().amax()  # not finite if any value is not
            x2 = d * d
            sums = torch.stack([torch.ones_like(amax), torch.full_like(amax, d.numel()), d.sum(), x2.sum(),
                                torch.dot(x2, d), torch.dot(x2, x2)])
            ok = torch.isfinite(amax)
            if "sums" not in self.state:
                self._allocate(d.device)
            row = self._row[fqn]  # in place: allocated here, this process's own (never shared memory)
            self.state["sums"][row] += torch.where(ok, sums, 0.0)
            self.state["amax"][row] = torch.maximum(self.state["amax"][row], torch.where(ok, amax, 0.0))

        return hook

    def result(self, reduce: ReduceOp | None = None) -> dict[str, tuple[float, float]]:
        """``{fqn: (kurtosis, amax)}`` over the finite calls on every process (``reduce``: ``all_reduce``). Kurtosis
        is Pearson's (3 for a Gaussian; nan for a constant input, or one whose mean dwarfs its spread beyond what the
        fp64 sums resolve). One read, after the probe's: the device has done
        the step's work by then, so it waits for nothing more."""
        if not self.layers:
            return {}
        if "sums" not in self.state:  # nothing ran here; other processes may have: take part in the reduce
            self._allocate(next(iter(self.layers.values())).weight.device)
        synced = self.state.sync(reduce)
        table = torch.cat([synced["sums"], synced["amax"].view(-1, 1)], dim=1).cpu().tolist()
        out = {}
        for fqn, (calls, n, s1, s2, s3, s4, amax) in zip(self.layers, table, strict=True):
            if not calls:
                continue
            mean = s1 / n
            var = s2 / n - mean * mean
            m4 = s4 / n - 4 * mean * s3 / n + 6 * mean * mean * s2 / n - 3 * mean**4
            # From raw power sums both moments cancel when the mean dwarfs the spread (|mean| beyond ~200 standard
            # deviations): below what fp64 resolves of their terms the result is noise (even negative), so nan.
            terms = s4 / n + abs(4 * mean * s3 / n) + 6 * mean * mean * s2 / n + 3 * mean**4
            resolved = var > _RESOLVED * s2 / n and m4 > _RESOLVED * terms
            out[fqn] = (m4 / (var * var) if resolved else math.nan, amax)
        return out


class FP8Guard(Callback):
    """Watches the layers ``FP8Precision`` runs in fp8 and moves one down when its measured fp8 numerics fail ``rule``:
    ``Trainer(plugins=[FP8Precision()], callbacks=[FP8Guard()])``.

    Every ``every_n_steps`` optimizer steps, one step is measured (forward and backward of each fp8 layer under the
    format it computes in: the casts' SQNR, underflow and overflow, and the layer's output and input-gradient error
    against fp32; docs/plan.md). Each layer that fails moves one rung down the ladder, in place (``ladder=True``:
    MXFP8 -> the per-tensor/row fp8 format -> high precision, one rung per measured step; ``ladder=False``: straight
    to high precision), on every process alike (the measurements are summed across processes), and the event is
    warned, logged (``precision/fp8_demoted/<layer>``: the step) with ``precision/fp8_layers``, and kept in
    ``events``. The plan in force (each layer's format) is written to ``plan_file`` after each move and at the end of
    fit (whole or not at all), and is in the plugin's checkpoint state: a resumed run keeps the moved layers where
    they went. No plan is written while ``layers="auto"`` has not decided: nothing unmeasured is a plan. A measured
    step in which a non-finite value (input, loss, gradient) reached the fp8 layers is a fault of the data, not of fp8:
    it is not judged (a warning says so) and nothing is moved for it.

    On each measured step the guard also logs, per fp8 layer, two early divergence signals of its input:
    ``precision/fp8_kurtosis/<layer>`` (Pearson's kurtosis of every element of the input: 3 for a Gaussian) and
    ``precision/fp8_amax_growth/<layer>`` (its largest magnitude over the one at the layer's first measured step);
    after ``check``, ``signals`` holds the step's (empty on a step not measured; with Fabric, log them yourself:
    ``fabric.log_dict(guard.signals)``). Computed on the device, read with the probe's numbers: no read on the steps
    between.

    Args:
        every_n_steps: measure one optimizer step in this many (default 100; the cost is in docs/plan.md).
        rule: the ``PlanRule`` an fp8 layer must keep passing (default: the plugin's ``plan_rule``, else
            ``PlanRule()``).
        plan_path: a ``.yaml``/``.yml``/``.json`` file, written as asked (checked at setup, before any step). Default:
            a new file in the Trainer's log directory (``default_root_dir`` without a logger), ``fp8_plan.yaml`` or, if
            that name is taken, ``fp8_plan-1.yaml``, ``fp8_plan-2.yaml``, ...: created at the first write, announced,
            and kept in ``plan_file``. A file this run did not create is never overwritten.
        ladder: move a failing layer one rung down (default), or straight to high precision (False).
        max_kurtosis: a layer whose input kurtosis exceeds it moves one rung down too (None: off, the default;
            docs/plan.md says what the embedded recipes measure).
        max_amax_growth: likewise for the growth of its input's largest magnitude (None: off).

    With Fabric, call ``guard.watch(plugin, step)`` before the step's forward, ``guard.check(plugin, step)`` after its
    backward and before ``optimizer.step()`` (on every process), and ``guard.save(plugin)`` at the end.
    """

    def __init__(self, every_n_steps: int = 100, rule: PlanRule | None = None,
                 plan_path: str | Path | None = None, ladder: bool = True, max_kurtosis: float | None = None,
                 max_amax_growth: float | None = None) -> None:
        if not is_positive_int(every_n_steps):
            raise ValueError(f"`FP8Guard(every_n_steps={every_n_steps!r})`: a positive number of optimizer steps.")
        if rule is not None and not isinstance(rule, PlanRule):
            raise ValueError(f"`FP8Guard(rule={rule!r})`: pass a `lightning_precision.PlanRule`.")
        if plan_path is not None:
            plan_suffix(Path(plan_path))  # a bad name fails now, not at the first demotion
        if not isinstance(ladder, bool):
            raise ValueError(f"`FP8Guard(ladder={ladder!r})`: True (one rung at a time) or False (straight to high"
                             " precision).")
        for name, bound in (("max_kurtosis", max_kurtosis), ("max_amax_growth", max_amax_growth)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                      or not bound > 0 or math.isinf(bound)):
                raise ValueError(f"`FP8Guard({name}={bound!r})`: a finite number > 0, or None (off).")
        self.every_n_steps = every_n_steps
        self.rule = rule
        self.plan_path = None if plan_path is None else Path(plan_path)
        self.ladder = ladder
        self.max_kurtosis = max_kurtosis
        self.max_amax_growth = max_amax_growth
        self.events: list[GuardEvent] = []
        self.signals: dict[str, float] = {}  # the step's, as logged (after `check`; empty when not measured)
        self._first_amax: dict[str, float] = {}  # each layer's input amax at its first measured step
        self._probes: list[SensitivityProbe] | None = None  # one per format, while a step is measured
        self._inputs: InputSignals | None = None
        self._skipped: set[str] = set()  # formats said to be left unwatched
        self._blind = False  # warned that a measured step saw no layer
        self._checked = False  # plan_path proven writable (Trainer: at setup; Fabric: at the first `watch`)
        self._default_dir: Path | None = None  # this fit's log directory, where the default file goes
        self._own_file: Path | None = None  # the default file this guard created, and so may rewrite

    @property
    def plan_file(self) -> Path | None:
        """Where this run's plan is written: ``plan_path``, or the default file once the first write has created it;
        None before."""
        return self.plan_path or self._own_file

    def _check_plan_path(self) -> None:
        """Prove, on rank zero and before any step, that the plan can be written where it will be."""
        if self._checked or process_rank() != 0:
            return
        if self.plan_path is not None:
            check_writable_file(self.plan_path, f"FP8Guard(plan_path={str(self.plan_path)!r})")
        elif self._default_dir is not None:
            check_writable_dir(self._default_dir, f"FP8Guard (the plan file goes in the log directory"
                               f" {str(self._default_dir)!r}; pass `plan_path=` to write elsewhere)")
        self._checked = True

    # ---- the loop, Trainer and Fabric alike -------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based) is measured."""
        return (step + 1) % self.every_n_steps == 0

    def watch(self, plugin: Any, step: int) -> bool:
        """Before step ``step``'s forward: start measuring the fp8 layers if the step is due. True if it started."""
        _check_movable(plugin)
        self._check_plan_path()
        return self.due(step) and self._start(plugin)

    def _start(self, plugin: Any) -> bool:
        if self._probes is not None:
            return False
        layers = plugin.fp8_modules()
        watched: dict[Any, dict[str, nn.Linear]] = {}  # by the format's probe config, in the layers' order
        for fqn, module in layers.items():
            fmt = layer_format(module)
            if _unmeasurable(fmt):  # layers="auto" or a plan converted them after the checks before training
                if fmt not in self._skipped and process_rank() == 0:
                    warn(f"FP8Guard: the fp8 layers in {fmt} are not watched: the probe does not measure its block"
                         " casts yet.", NoEffectWarning)
                self._skipped.add(str(fmt))
                continue
            watched.setdefault(_probe_config(module), {})[fqn] = module
        if not watched:  # none yet (layers="auto" still measuring) or none left
            return False
        self._probes = [SensitivityProbe(group, config) for config, group in watched.items()]
        self._inputs = InputSignals({fqn: m for group in watched.values() for fqn, m in group.items()})
        return True

    def check(self, plugin: Any, step: int) -> list[GuardEvent]:
        """After the measured step's backward (every micro-batch of it), before the optimizer step, on every process:
        move down the layers that fail the rule or a signal's bound. One device read; nothing on steps that are not
        measured."""
        probes, inputs = self._probes, self._inputs
        self._stop()
        self.signals = {}
        if probes is None or inputs is None:
            return []
        sensitivity = {}
        for probe in probes:
            sensitivity.update(probe.result(all_reduce))  # the step's micro-batches, committed as one batch
        signals = inputs.result(all_reduce)  # the device is done: no second wait
        worst = max(probes, key=lambda p: p.dropped)
        if worst.dropped and process_rank() == 0:
            judged = "not judged" if not worst.batches else \
                f"judged on the {worst.batches} process(es) whose values were finite"
            warn(f"FP8Guard: step {step} is {judged}: a non-finite input, loss or gradient reached the fp8 layers on"
                 f" {worst.dropped} process(es). That is a fault of the data or the loss, not an fp8 overflow: no layer"
                 " is moved for it.")
        # Nothing measured on any process, and here not even a call without tokens: the hooks did not run at all.
        ran = any(p.ran for p in probes)
        if not sensitivity and not worst.dropped and not ran and not self._blind:
            self._blind = True
            if process_rank() == 0:
                warn(f"FP8Guard: step {step} was measured, but none of the {len(inputs.layers)} fp8 layers' forward"
                     " hooks ran with gradients on (the step's forward ran under no_grad, or did not reach them), so"
                     " nothing is watched.", NoEffectWarning)
        failed = demotions(sensitivity, self.rule or plugin.plan_rule)
        numbers = {fqn: measured_numbers(s) for fqn, s in sensitivity.items()}
        for fqn, why in self._judge_signals(signals, numbers).items():
            failed[fqn] = f"{failed[fqn]}; {why}" if fqn in failed else why
        formats = {fqn: layer_format(m) for fqn, m in inputs.layers.items()}
        reasons = {fqn: f"FP8Guard, step {step}: {why}" for fqn, why in failed.items()}
        chosen = {fqn: numbers.get(fqn, {}) for fqn in failed}
        if self.ladder:
            moved = plugin.step_down(reasons, chosen)
        else:
            high = high_label(plugin.compute_dtype)
            moved = {fqn: high for fqn in plugin.demote(reasons, chosen)}
        events = [GuardEvent(step, fqn, failed[fqn], to) for fqn, to in moved.items()]
        self.events.extend(events)
        if events:
            if process_rank() == 0:
                warn(f"FP8Guard: step {step}: {len(events)} layer(s) moved "
                     + ("one rung down" if self.ladder else f"back to {plugin.compute_dtype}") + ": "
                     + "; ".join(f"{e.fqn} {formats.get(e.fqn)} -> {e.to} ({e.reason})" for e in events))
            self._save_during_fit(plugin)  # at once: a run that dies later keeps what was learned
        return events

    def _judge_signals(self, signals: Mapping[str, tuple[float, float]],
                       numbers: dict[str, dict[str, float]]) -> dict[str, str]:
        """Keep the step's signals (``signals`` as logged, and beside each layer's ``numbers``); the layers past a
        bound, with why."""
        failed = {}
        for fqn, (kurtosis, amax) in signals.items():
            if fqn not in self._first_amax and amax > 0:
                self._first_amax[fqn] = amax
            first = self._first_amax.get(fqn)
            growth = amax / first if first else math.nan
            entry = numbers.setdefault(fqn, {})
            if not math.isnan(kurtosis):
                self.signals[f"precision/fp8_kurtosis/{fqn}"] = entry["input_kurtosis"] = kurtosis
            if not math.isnan(growth):
                self.signals[f"precision/fp8_amax_growth/{fqn}"] = entry["input_amax_growth"] = growth
            why = []
            if self.max_kurtosis is not None and kurtosis > self.max_kurtosis:
                why.append(f"input kurtosis {kurtosis:.1f} > {self.max_kurtosis:g}")
            if self.max_amax_growth is not None and growth > self.max_amax_growth:
                why.append(f"input amax growth {growth:.1f}x > {self.max_amax_growth:g}")
            if why:
                failed[fqn] = "; ".join(why)
        return failed

    def save(self, plugin: Any, path: str | Path | None = None) -> Path | None:
        """Write the plan in force to ``path`` (default ``plan_file``; with the Trainer and no ``plan_path``, the
        default file is created at this first write), on rank zero; returns where, or None: on other ranks, before
        conversion, while ``layers="auto"`` has not decided, or with Fabric and neither ``path`` nor ``plan_path``."""
        plan = plugin.plan_in_force()
        if plan is None or process_rank() != 0:
            return None
        target = Path(path) if path is not None else self.plan_file
        created = False
        if target is None:
            if self._default_dir is None:
                return None
            self._default_dir.mkdir(parents=True, exist_ok=True)
            target = self._own_file = create_new_file(self._default_dir, DEFAULT_PLAN_FILE)
            created = True
            rank_zero_info(f"FP8Guard: the fp8 plan in force is written to {target}")
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
        try:
            return plan.save(target)
        except BaseException:
            if created:  # the empty file just reserved: nothing of the run is lost with it
                target.unlink(missing_ok=True)
                self._own_file = None
            raise

    def _save_during_fit(self, plugin: Any) -> None:
        """``save`` from inside training: a write that fails after the setup check (a full disk, a folder gone) warns
        instead of ending the run: the plan stays in the plugin (and, once decided or changed, in its checkpoints)."""
        try:
            self.save(plugin)
        except OSError as err:
            where = self.plan_file or self._default_dir
            warn(f"FP8Guard: could not write the fp8 plan to {str(where)!r} ({err}); training goes on and the plan is"
                 " not lost: save it where a file can be written with"
                 " `trainer.precision_plugin.plan_in_force().save('fp8_plan.yaml')` (`plugin.plan_in_force()` with"
                 " Fabric).")

    # ---- Trainer glue -----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        from lightning_precision.fabric.fp8 import FP8Precision  # the Trainer class inherits it

        if stage != "fit":
            return
        plugin = trainer.precision_plugin
        if not isinstance(plugin, FP8Precision):
            raise ValueError(f"FP8Guard watches the fp8 layers of `lightning_precision.FP8Precision`; this Trainer's"
                             f" precision plugin is {type(plugin).__name__}. Add `plugins=[FP8Precision(...)]`.")
        _check_movable(plugin)
        if isinstance(trainer.strategy, ModelParallelStrategy):
            raise ValueError("FP8Guard cannot move layers sharded by FSDP2 (`ModelParallelStrategy`): FSDP2 holds"
                             " them. Measure on one process (`lightning-precision plan`) and pass the plan.")
        directory = Path(trainer.log_dir or trainer.default_root_dir)  # every rank: `log_dir` broadcasts
        if self._own_file is not None and self._own_file.parent != directory:
            self._own_file = None  # a fit logging elsewhere gets its own file
        self._default_dir, self._checked = directory, False
        self._check_plan_path()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check_movable(trainer.precision_plugin)  # the model is converted by now: before any step, not at a demotion

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if on_cadence(trainer, self.every_n_steps):
            self._start(trainer.precision_plugin)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._probes is None:
            return
        plugin: Any = trainer.precision_plugin  # an FP8Precision: `setup` checked
        events = self.check(plugin, trainer.global_step)
        metrics = {**self.signals, **{f"precision/fp8_demoted/{e.fqn}": float(e.step) for e in events}}
        if not should_update_logs(trainer):  # on the logger's steps the plugin logs it itself: not twice
            metrics["precision/fp8_layers"] = float(len(plugin.fp8_modules()))
        if metrics:
            # The step Lightning logs this batch's metrics at (the plugin's `precision/fp8_layers` included), not
            # `global_step`, which counts every optimizer's steps: a logger seeing steps go back drops them (wandb).
            publish_metrics(trainer, metrics, batches_that_stepped(trainer))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        self._save_during_fit(trainer.precision_plugin)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()
        if hasattr(trainer.precision_plugin, "plan_in_force"):  # not when setup refused the plugin
            self._save_during_fit(trainer.precision_plugin)  # the demotions so far are not lost with the run

    def _stop(self) -> None:
        probes, inputs, self._probes, self._inputs = self._probes, self._inputs, None, None
        for probe in probes or ():
            probe.close()
        if inputs is not None:
            inputs.close()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": [dataclasses.asdict(e) for e in self.events], "first_amax": dict(self._first_amax)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = [GuardEvent(**e) for e in state_dict.get("events", [])]
        self._first_amax = dict(state_dict.get("first_amax", {}))  # a resumed run's growth is since its first step

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_probes"] = state["_inputs"] = None  # hooks stay with the process that set them
        return state
