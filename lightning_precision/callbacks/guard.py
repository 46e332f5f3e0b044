"""FP8Guard: watches the fp8 layers' numerics during training and moves a layer that degrades back to high precision.

At a cadence, one optimizer step is measured by the same ``SensitivityProbe`` that ``FP8Precision(layers="auto")``
calibrates with; every layer the rule now rejects (``plan.demotions``) is returned to the plugin's high-precision
dtype in place by ``FP8Precision.demote`` (same module, same Parameters: the optimizer state is intact).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_precision import fp8 as _fp8
from lightning_precision._checks import is_positive_int
from lightning_precision.callbacks._cadence import on_cadence
from lightning_precision.plan import PlanRule, PrecisionPlan, _measured_numbers, _suffix, demotions
from lightning_precision.sensitivity import SensitivityProbe, _sum_across_processes
from lightning_precision.warnings import NoEffectWarning, warn

__all__ = ["DEFAULT_PLAN_FILE", "FP8Guard", "GuardEvent"]

DEFAULT_PLAN_FILE = "fp8_plan.yaml"


def _check_movable(plugin: Any) -> None:
    """Refuse, before training, fp8 layers that could not be moved back in place when the time came."""
    if plugin.backend != "torchao":
        raise ValueError("FP8Guard: Transformer Engine layers cannot return to high precision in place; use"
                         " `FP8Precision(backend='torchao')`, or pass a plan (`layers='plan.yaml'`).")
    if plugin.scaling_family in _fp8.BLOCK_SCALED:
        raise ValueError(f"FP8Guard: its measurement casts per tensor or per row, not in the blocks of {plugin.scaling_family};"
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
    ``events``. The plan in force is written to ``plan_path`` after each demotion and at the end of fit, and is in the
    plugin's checkpoint state: a resumed run keeps the demoted layers in high precision.

    Args:
        every_n_steps: measure one optimizer step in this many (default 100; the cost is in docs/plan.md).
        rule: the ``PlanRule`` an fp8 layer must keep passing (default: the plugin's ``plan_rule``, else ``PlanRule()``).
        plan_path: a ``.yaml``/``.yml``/``.json`` file (default: ``fp8_plan.yaml`` in the Trainer's log directory).

    With Fabric, call ``guard.watch(plugin, step)`` before the step's forward, ``guard.check(plugin, step)`` after its
    backward and before ``optimizer.step()`` (on every process), and ``guard.save(plugin)`` at the end.
    """

    def __init__(self, every_n_steps: int = 100, rule: Optional[PlanRule] = None,
                 plan_path: Optional[Union[str, Path]] = None) -> None:
        if not is_positive_int(every_n_steps):
            raise ValueError(f"`FP8Guard(every_n_steps={every_n_steps!r})`: a positive number of optimizer steps.")
        if rule is not None and not isinstance(rule, PlanRule):
            raise ValueError(f"`FP8Guard(rule={rule!r})`: pass a `lightning_precision.PlanRule`.")
        if plan_path is not None:
            _suffix(Path(plan_path))  # a bad name fails now, not at the first demotion
        self.every_n_steps = every_n_steps
        self.rule = rule
        self.plan_path = None if plan_path is None else Path(plan_path)
        self.events: list[GuardEvent] = []
        self._probe: Optional[SensitivityProbe] = None
        self._blind = False  # warned that a measured step saw no layer
        self._fit_path: Optional[Path] = None  # plan_path, or the default in this fit's log directory

    # ---- the loop, Trainer and Fabric alike -------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based) is measured."""
        return (step + 1) % self.every_n_steps == 0

    def watch(self, plugin: Any, step: int) -> bool:
        """Before step ``step``'s forward: start measuring the fp8 layers if the step is due. True if it started."""
        _check_movable(plugin)
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
        probe.batches = 1
        sensitivity = probe.result(_sum_across_processes)
        if not sensitivity and not self._blind:
            self._blind = True
            if rank_zero_only.rank == 0:
                warn(f"FP8Guard: step {step} was measured, but none of the {len(probe.layers)} fp8 layers' forward hooks"
                     " ran with gradients on, so nothing is watched. Under torch.compile, hooks added after compiling"
                     " are ignored (torch._dynamo.config.skip_nnmodule_hook_guards, True by default): set it to False"
                     " before compiling, or guard the model uncompiled.", NoEffectWarning)
        failed = demotions(sensitivity, self.rule or plugin.plan_rule)
        moved = plugin.demote({fqn: f"FP8Guard, step {step}: {why}" for fqn, why in failed.items()},
                              {fqn: _measured_numbers(sensitivity[fqn]) for fqn in failed})
        events = [GuardEvent(step, fqn, failed[fqn]) for fqn in moved]
        self.events.extend(events)
        if events:
            if rank_zero_only.rank == 0:
                warn(f"FP8Guard: step {step}: {len(events)} layer(s) moved back to {plugin.compute_dtype}: "
                     + "; ".join(f"{e.fqn} ({e.reason})" for e in events))
            self.save(plugin)  # at once: a run that dies later keeps what was learned
        return events

    def save(self, plugin: Any, path: Optional[Union[str, Path]] = None) -> Optional[Path]:
        """Write the plan in force to ``path`` (default ``plan_path``), on rank zero; returns where, or None."""
        path = Path(path) if path is not None else (self.plan_path or self._fit_path)
        if path is None or rank_zero_only.rank != 0 or not plugin.layer_decisions:
            return None
        plan = plugin.plan or PrecisionPlan.from_decisions(plugin.layer_decisions, plugin.scaling_family)
        path.parent.mkdir(parents=True, exist_ok=True)
        return plan.save(path)

    # ---- Trainer glue -----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        from lightning_precision.plugins.fp8 import FP8Precision

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
        self._fit_path = Path(trainer.log_dir or trainer.default_root_dir) / DEFAULT_PLAN_FILE

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check_movable(trainer.precision_plugin)  # the model is converted by now: before any step, not at a demotion

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if on_cadence(trainer, self.every_n_steps):
            self._start(trainer.precision_plugin)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._probe is None:
            return
        plugin = trainer.precision_plugin
        events = self.check(plugin, trainer.global_step)
        metrics = {"precision/fp8_layers": float(len(plugin.fp8_modules()))}
        metrics.update({f"precision/fp8_demoted/{e.fqn}": float(e.step) for e in events})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        self.save(trainer.precision_plugin)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()
        self.save(trainer.precision_plugin)  # the demotions so far are not lost with the run

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
