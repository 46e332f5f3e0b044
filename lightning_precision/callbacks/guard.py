"""FP8Guard: watches the fp8 layers' numerics during training and moves a layer that degrades back to high precision.

At a cadence, one optimizer step is measured by the same ``SensitivityProbe`` that ``FP8Precision(layers="auto")``
calibrates with (its hooks run first on each layer, and the measured step runs eagerly under ``torch.compile``);
every layer the rule now rejects (``demotions``) is returned to the plugin's high-precision
dtype in place by ``FP8Precision.demote`` (same module, same Parameters: the optimizer state is intact).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_precision._accumulator import all_reduce
from lightning_precision._checks import is_positive_int
from lightning_precision._io import check_writable_dir, check_writable_file, create_new_file
from lightning_precision._upstream.lightning import batches_that_stepped, should_update_logs
from lightning_precision._warnings import NoEffectWarning, process_rank, warn
from lightning_precision.callbacks._cadence import on_cadence
from lightning_precision.fp8._plan import PlanRule, demotions, measured_numbers, plan_suffix
from lightning_precision.fp8._selection import BLOCK_SCALED
from lightning_precision.fp8._sensitivity import SensitivityProbe

__all__ = ["DEFAULT_PLAN_FILE", "FP8Guard", "GuardEvent"]

DEFAULT_PLAN_FILE = "fp8_plan.yaml"


def _check_movable(plugin: Any) -> None:
    """Refuse, before training, fp8 layers that could not be moved back in place when the time came."""
    if plugin.backend != "torchao":
        raise ValueError("FP8Guard: Transformer Engine layers cannot return to high precision in place; use"
                         " `FP8Precision(backend='torchao')`, or pass a plan (`layers='plan.yaml'`).")
    if plugin.scaling_family in BLOCK_SCALED:
        raise ValueError("FP8Guard: its measurement casts per tensor or per row, not in the blocks of"
                         f" {plugin.scaling_family};"
                         " it would judge these layers by the wrong numerics. Watch them with"
                         f" `GradientUnderflowMonitor(formats=({plugin.scaling_family!r},))` instead.")
    if getattr(plugin, "_float8_all_gather", False):
        raise ValueError("FP8Guard: these fp8 layers all-gather their weights in fp8 (`fsdp_float8_all_gather`), whose"
                         " weights are torchao tensor subclasses that cannot return to high precision in place. Leave"
                         " `fsdp_float8_all_gather` off, or measure first and pass a plan.")


@dataclass(frozen=True)
class GuardEvent:
    """A layer moved back to high precision at optimizer step ``step``, and why."""

    step: int
    fqn: str
    reason: str



class FP8Guard(Callback):
    """Watches the layers ``FP8Precision`` runs in fp8 and moves one back to high precision when its measured fp8
    numerics fail ``rule``: ``Trainer(plugins=[FP8Precision()], callbacks=[FP8Guard()])``.

    Every ``every_n_steps`` optimizer steps, one step is measured (forward and backward of each fp8 layer: the casts'
    SQNR, underflow and overflow, and the layer's output and input-gradient error against fp32; docs/plan.md). Each
    layer that fails is demoted in place, on every process alike (the measurements are summed across processes), and
    the event is warned, logged (``precision/fp8_demoted/<layer>``: the step) with ``precision/fp8_layers``, and kept in
    ``events``. The plan in force is written to ``plan_file`` after each demotion and at the end of fit (whole or not
    at all), and is in the plugin's checkpoint state: a resumed run keeps the demoted layers in high precision. No plan
    is written while ``layers="auto"`` has not decided: nothing unmeasured is a plan. A measured step in which a
    non-finite value (input, loss, gradient) reached the fp8 layers is a fault of the data, not of fp8: it is not
    judged (a warning says so) and nothing is demoted for it.

    Args:
        every_n_steps: measure one optimizer step in this many (default 100; the cost is in docs/plan.md).
        rule: the ``PlanRule`` an fp8 layer must keep passing (default: the plugin's ``plan_rule``, else
            ``PlanRule()``).
        plan_path: a ``.yaml``/``.yml``/``.json`` file, written as asked (checked at setup, before any step). Default:
            a new file in the Trainer's log directory (``default_root_dir`` without a logger), ``fp8_plan.yaml`` or, if
            that name is taken, ``fp8_plan-1.yaml``, ``fp8_plan-2.yaml``, ...: created at the first write, announced,
            and kept in ``plan_file``. A file this run did not create is never overwritten.

    With Fabric, call ``guard.watch(plugin, step)`` before the step's forward, ``guard.check(plugin, step)`` after its
    backward and before ``optimizer.step()`` (on every process), and ``guard.save(plugin)`` at the end.
    """

    def __init__(self, every_n_steps: int = 100, rule: PlanRule | None = None,
                 plan_path: str | Path | None = None) -> None:
        if not is_positive_int(every_n_steps):
            raise ValueError(f"`FP8Guard(every_n_steps={every_n_steps!r})`: a positive number of optimizer steps.")
        if rule is not None and not isinstance(rule, PlanRule):
            raise ValueError(f"`FP8Guard(rule={rule!r})`: pass a `lightning_precision.PlanRule`.")
        if plan_path is not None:
            plan_suffix(Path(plan_path))  # a bad name fails now, not at the first demotion
        self.every_n_steps = every_n_steps
        self.rule = rule
        self.plan_path = None if plan_path is None else Path(plan_path)
        self.events: list[GuardEvent] = []
        self._probe: SensitivityProbe | None = None
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
        if self._probe is not None:
            return False
        layers = plugin.fp8_modules()
        if not layers:  # none yet (layers="auto" still measuring) or none left
            return False
        self._probe = SensitivityProbe(layers, plugin._probe_config())
        return True

    def check(self, plugin: Any, step: int) -> list[GuardEvent]:
        """After the measured step's backward (every micro-batch of it), before the optimizer step, on every process:
        demote the layers that fail the rule. One device read; nothing on steps that are not measured."""
        probe, self._probe = self._probe, None
        if probe is None:
            return []
        probe.close()
        sensitivity = probe.result(all_reduce)  # the step's micro-batches, committed as one batch
        if probe.dropped and process_rank() == 0:
            judged = "not judged" if not probe.batches else \
                f"judged on the {probe.batches} process(es) whose values were finite"
            warn(f"FP8Guard: step {step} is {judged}: a non-finite input, loss or gradient reached the fp8 layers on"
                 f" {probe.dropped} process(es). That is a fault of the data or the loss, not an fp8 overflow: no layer"
                 " is demoted for it.")
        # Nothing measured on any process, and here not even a call without tokens: the hooks did not run at all.
        if not sensitivity and not probe.dropped and not probe.ran and not self._blind:
            self._blind = True
            if process_rank() == 0:
                warn(f"FP8Guard: step {step} was measured, but none of the {len(probe.layers)} fp8 layers' forward"
                     " hooks ran with gradients on (the step's forward ran under no_grad, or did not reach them), so"
                     " nothing is watched.", NoEffectWarning)
        failed = demotions(sensitivity, self.rule or plugin.plan_rule)
        moved = plugin.demote({fqn: f"FP8Guard, step {step}: {why}" for fqn, why in failed.items()},
                              {fqn: measured_numbers(sensitivity[fqn]) for fqn in failed})
        events = [GuardEvent(step, fqn, failed[fqn]) for fqn in moved]
        self.events.extend(events)
        if events:
            if process_rank() == 0:
                warn(f"FP8Guard: step {step}: {len(events)} layer(s) moved back to {plugin.compute_dtype}: "
                     + "; ".join(f"{e.fqn} ({e.reason})" for e in events))
            self._save_during_fit(plugin)  # at once: a run that dies later keeps what was learned
        return events

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
        if self._probe is None:
            return
        plugin: Any = trainer.precision_plugin  # an FP8Precision: `setup` checked
        events = self.check(plugin, trainer.global_step)
        metrics = {f"precision/fp8_demoted/{e.fqn}": float(e.step) for e in events}
        if not should_update_logs(trainer):  # on the logger's steps the plugin logs it itself: not twice
            metrics["precision/fp8_layers"] = float(len(plugin.fp8_modules()))
        if metrics:
            # The step Lightning logs this batch's metrics at (the plugin's `precision/fp8_layers` included), not
            # `global_step`, which counts every optimizer's steps: a logger seeing steps go back drops them (wandb).
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=batches_that_stepped(trainer))

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
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.close()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": [dataclasses.asdict(e) for e in self.events]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = [GuardEvent(**e) for e in state_dict.get("events", [])]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_probe"] = None  # hooks stay with the process that set them
        return state
