"""GradientUnderflowMonitor: how many gradients flush to zero (or overflow) in each low-precision format.

The callback is the Trainer glue and the order of the work; the work is in the private modules beside it: the argument
checks (``_underflow.checks``), the precision plugin's loss scale (``_underflow.plugin``), the fp8 formats' dynamic
scale (``_underflow.scaling``), the accumulated state (``_underflow.state``), the measures counted into it
(``_underflow.measure``), the probe backward (``_underflow.probe``), the activation hooks (``_underflow.activations``),
the weights' rounding (``_underflow.rounding``) and what is logged (``_underflow.report``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_precision._core.accumulator import Reduce, all_reduce
from lightning_precision._core.fsdp import is_sharded, local_shard
from lightning_precision._core.probe_pass import probe_pass
from lightning_precision._core.true.step import TrueStep
from lightning_precision._plots import check_plot_path
from lightning_precision._upstream.lightning import batches_that_stepped, publish_metrics
from lightning_precision._warnings import warn
from lightning_precision.callbacks._cadence import on_cadence, set_cadence
from lightning_precision.callbacks._publish import read_metrics
from lightning_precision.callbacks._underflow.activations import ActivationHooks
from lightning_precision.callbacks._underflow.checks import check_options, format_names
from lightning_precision.callbacks._underflow.measure import Measures
from lightning_precision.callbacks._underflow.plugin import (
    fp16_backward,
    hooks_see_scaled_loss,
    loss_scale_of,
    scale_in_gradients,
)
from lightning_precision.callbacks._underflow.probe import Probe, judged, probe_run, probe_scale, smaller_factor
from lightning_precision.callbacks._underflow.report import gradient_metrics, underflow_warning, warning_key
from lightning_precision.callbacks._underflow.rounding import UpdateRounding, rounding_metrics
from lightning_precision.callbacks._underflow.scaling import (
    DYNAMIC,
    FP8_SCALINGS,
    check_fp8_scaling,
    fixed_scaling,
    plugin_scaling,
)
from lightning_precision.callbacks._underflow.state import (
    ACTIVATION,
    PARAM,
    add_histogram,
    add_rounding,
    histogram_of,
    load_histograms,
    new_state,
    pending_device,
    sync_state,
    synced_counts,
    synced_rounding,
)
from lightning_precision.formats import NumberFormat
from lightning_precision.functional import LossScaleAdvice, recommend_loss_scale

__all__ = ["DYNAMIC", "FP8_SCALINGS", "GradientUnderflowMonitor", "Reduce"]


def _true_step_of(plugin: Any) -> TrueStep | None:
    """The fp32 step of a true-precision plugin (``BF16TruePrecision``, ``FP16TruePrecision``), where rounding happens;
    None for any other plugin."""
    stepper = getattr(plugin, "true_step", None)  # only the true-precision plugins round their weights
    return stepper if isinstance(stepper, TrueStep) else None


def _across_processes(trainer: pl.Trainer) -> Reduce | None:
    """The Trainer's ranks' sum (``all_reduce``); None on one process."""
    return all_reduce if trainer.world_size > 1 else None


class GradientUnderflowMonitor(Callback):
    """Measures, for each format in ``formats``, the fraction of gradients whose cast flushes to zero or overflows.

    Parameter gradients are measured unscaled, just before the optimizer step (``precision/underflow/<fmt>``); when a
    loss scaler is active, fp16 is also measured on ``g * S``, the values the fp16 backward really carries
    (``precision/underflow/fp16/scaled``). With ``activations=True``, gradients of module outputs (where fp16 autocast
    keeps its fp16 tensors) are measured as they flow in backward, scaled when a scaler is active (key suffix
    ``/scaled``). Exact zeros are reported apart (``precision/exact_zero``): they are not underflow.

    **fp8 is scaled first.** fp8 training casts nothing unscaled: torchao (and Transformer Engine) scale each tensor
    so that its largest value lands on the format's max (per tensor, per row, or per block of 32 for MXFP8). Under an
    fp8 plugin (``fp8_scaling="auto"``, the Trainer's ``FP8Precision``) the fp8 formats (e4m3fn, e5m2) are therefore
    measured at that dynamic scale, each gradient tensor with its own, and keyed ``precision/underflow/<fmt>/dynamic``
    (likewise ``overflow``, ``act_underflow``, the per-module keys); their unscaled figures, which no fp8 cast of the
    run resembles, are not logged. Elsewhere (``fp8_scaling=None``, or any other plugin) they are unscaled: what a cast
    with no scale at all would flush. fp16 and bf16 figures are unscaled (or loss-scaled) as they always were.

    **What fp16 already flushed.** Under fp16 autocast the activation gradients are fp16, so a gradient that underflowed
    is already an exact zero when any hook sees it. On measuring steps of an fp16 run, the monitor therefore repeats the
    first micro-batch's backward at ``probe_factor`` times the loss scale (``torch.autograd.grad`` on the same graph: no
    user code runs again) before the real one: gradients that are zero in the real backward but not in the probe were
    lost to underflow. They count in ``precision/underflow/fp16/scaled`` and alone in ``precision/underflow/fp16/lost``,
    not in ``precision/exact_zero``, and the probe's gradients feed the histogram, so the advice raises the scale (the
    activation hooks' view of the probe too, at the probe's scale, in place of the real backward's). It is
    a lower bound: what the probe also flushes, and micro-batches after the first, are not seen.

    **True precision.** Under ``BF16TruePrecision``/``FP16TruePrecision`` the gradients are 16-bit, and fp16 ones still
    carry the loss scale before the step: they are measured divided by it, in fp32, so every key means what it means
    under the mixed plugins. On measuring steps the plugin's fp32 step also counts what rounding does to the weights:
    ``precision/update_lost/<fmt>`` (of the nonzero fp32 updates, those rounding to nearest would lose: what a plain
    16-bit step, Lightning's ``bf16-true``, drops) and ``precision/update_moved/<fmt>`` (those that changed the 16-bit
    weight under the plugin's own ``update=``). The Trainer logs once the optimizer step is done; with Fabric, step
    inside ``measuring_update(plugin)``.

    Measurements happen on logging steps (or every ``measure_every_n_steps``), accumulate on the device, and are
    all-reduced across processes and read only when logged. An exponent histogram of log2|g| (unscaled) accumulates
    over the run: ``save_plot`` draws it with each format's range, and ``recommend_loss_scale`` reads it. Sparse
    gradients are measured on their stored values, complex ones on their real and imaginary parts; a gradient that
    cannot be measured is skipped with a one-time warning: the monitor never stops a fit.

    Args:
        formats: formats to check (a name, dtype or ``NumberFormat``, or several); a bf16 run can ask "would fp16 or
            fp8 flush these?".
        activations: also measure activation gradients (forward hooks on leaf modules).
        top_k: log the ``top_k`` modules with the most underflow in ``formats[0]``
            (``precision/underflow/<fmt>/<module path>``).
        measure_every_n_steps: ``None`` measures on logging steps only.
        log_every_n_steps: ``None`` follows ``Trainer(log_every_n_steps=...)``.
        warn_threshold: warn once when the fp16 underflow fraction at the current scale exceeds this.
        target_underflow: the fp16 underflow fraction the loss-scale recommendation aims for.
        plot_path: if set, the histogram plot is written there at the end of training (whole or not at all; the
            path, its format and matplotlib are checked at setup, before any step).
        probe_factor: the probe backward's scale relative to the loss scale (a power of two > 1; its log2 halved,
            2**16 -> 2**8, after a probe overflowed); ``None`` turns the probe off and saves one backward pass per
            measuring step of fp16 runs.
        fp8_scaling: how the fp8 formats are scaled before their cast: ``"auto"`` (default) the Trainer's fp8
            plugin's scaling, unscaled under any other plugin and with Fabric; ``None`` unscaled; or a plugin's
            ``scaling_family`` (``"tensorwise"``, ``"rowwise"``, ``"mxfp8"``, ...): with Fabric, pass
            ``plugin.scaling_family``.
    """

    measure_every_n_steps: int | None  # set by `set_cadence`
    log_every_n_steps: int | None

    def __init__(
        self,
        formats: str | torch.dtype | NumberFormat | Sequence[str | torch.dtype | NumberFormat] = (
            "fp16", "bf16", "e4m3fn", "e5m2"),
        activations: bool = False,
        top_k: int = 5,
        measure_every_n_steps: int | None = None,
        log_every_n_steps: int | None = None,
        warn_threshold: float = 0.01,
        target_underflow: float = 1e-3,
        plot_path: str | None = None,
        probe_factor: float | None = 2.0**16,
        fp8_scaling: str | None = "auto",
    ) -> None:
        owner = "GradientUnderflowMonitor"
        self.formats = format_names(formats)
        set_cadence(self, owner, measure_every_n_steps=measure_every_n_steps, log_every_n_steps=log_every_n_steps)
        check_options(top_k, warn_threshold, target_underflow, probe_factor)
        check_fp8_scaling(fp8_scaling)
        self.fp8_scaling = fp8_scaling
        # (scaling, pow2) the fp8 formats are measured at; None: unscaled. "auto" is resolved at the Trainer's setup.
        self._dynamic = fixed_scaling(fp8_scaling)
        self.activations = activations
        self.top_k = top_k
        self.warn_threshold = warn_threshold
        self.target_underflow = target_underflow
        self.plot_path = plot_path
        self.probe_factor = probe_factor
        # Histograms: totals summed across processes at each `compute(reduce)`, and this process's part since then;
        # the window's counts join as "count/<key>" states when first measured.
        self.state = new_state()
        self._activations = ActivationHooks(self, self._measure_activation)
        self._warned = False
        self._probe: Probe | None = None
        self._probe_due = False
        self.last_metrics: dict[str, float] = {}  # the last logged values, read once
        self._measure_due = False  # this step measures (set at the step's first batch)
        self._rounding = UpdateRounding()  # what the true-precision step's rounding does, while armed
        self._log_due = False  # the Trainer step logs, once its optimizer step is done
        self._failed: set[str] = set()

    @property
    def histogram(self) -> Tensor:
        """Counts of log2|g| of parameter gradients (unscaled), one bin per power of two from ``HIST_MIN``."""
        return histogram_of(self.state, PARAM)

    @property
    def activation_histogram(self) -> Tensor:
        """The same for activation gradients (``activations=True``)."""
        return histogram_of(self.state, ACTIVATION)

    @property
    def _hooks(self) -> list[Any]:
        """The forward hooks on the model's leaf modules (none once detached)."""
        return self._activations.handles

    # ---- the part Fabric and plain PyTorch use directly -------------------------------------------------------------

    def probe_backward(
        self,
        loss: Tensor,
        named_params: Iterable[tuple[str, Tensor]],
        loss_scale: Tensor | float,
        backward: Callable[[Tensor], None] | None = None,
    ) -> None:
        """Before the real backward of an fp16 step, with ``loss`` unscaled and still holding its graph: run the probe
        backward (see the class docstring); the next ``measure_gradients`` compares it with the real gradients.

        ``backward``: the loop's own backward entry, where only it may run a backward pass (``fabric.backward``: Fabric
        refuses any other through its model's outputs when the plugin scales the loss). The probe then runs inside
        it, with the same figures, and leaves no gradient in ``.grad``.
        """
        if self.probe_factor is None:
            return
        params = {n: p for n, p in named_params if p.requires_grad}
        effective, headroom = probe_scale(loss, loss_scale, self.probe_factor)
        run = probe_run(loss, effective, list(params.values()), backward)
        self._fold_unjudged_activations()
        # The activation hooks fire in the probe's backward too: what they see there is scaled by `effective`, and it
        # is the probe's (kept apart), not a second count of the step.
        with self._activations.probing(effective) as seen, probe_pass(self):  # not a step of anyone else's measures
            grads = run()
        probe = judged(list(params), grads, effective, seen[0], headroom)
        if probe is None:
            # FSDP2 computes gradients of its unsharded copies, not of the (sharded) parameters the module lists, and
            # reduces them into `.grad` in its own hooks: a probe w.r.t. the parameters sees nothing there.
            self.probe_factor = None
            warn("GradientUnderflowMonitor: the probe backward reached none of the model's parameters (parameters"
                 " sharded by FSDP2 get their gradients through FSDP2's own hooks); it is off for this run, so"
                 " `precision/underflow/fp16/lost` is not reported and gradients fp16 already flushed count as exact"
                 " zeros.")
            return
        self._probe = probe

    def _fold_unjudged_activations(self) -> None:
        """A probe never judged (no ``measure_gradients`` after it): the real backward's activation gradients stand."""
        real = self._probe.take_real_activations() if self._probe is not None else None
        if real is not None:
            add_histogram(self.state, ACTIVATION, real)

    def measure_gradients(self, named_grads: Mapping[str, Tensor | None], loss_scale: Tensor | float | None = None,
                          histogram: bool = True, carries_scale: bool = False) -> None:
        """Accumulate statistics of (unscaled) parameter gradients; ``loss_scale`` adds the fp16 ``g * S`` question,
        and a probe run before this step's backward (``probe_backward``) adds what fp16 already flushed.

        ``carries_scale=True``: the gradients still carry ``loss_scale`` (``FP16TruePrecision``'s fp16 gradients
        before the optimizer step); each is divided by it in fp32, one tensor at a time, before it is measured.

        Across processes, ``compute(reduce)`` sums what each measured, so each gradient element must be measured by one
        process: pass each rank's local shard of sharded gradients (FSDP2), and ``histogram=False`` on all processes
        but one when gradients are replicated (DDP) so the histogram counts them once (fractions are unaffected)."""
        if carries_scale and loss_scale is None:
            raise ValueError("`GradientUnderflowMonitor.measure_gradients(carries_scale=True)`: pass the scale the"
                             " gradients carry as `loss_scale=` (e.g. `plugin.loss_scale`).")
        probe, self._probe = self._probe, None
        self._measures().count_gradients(self.state, named_grads, loss_scale, carries_scale, probe, histogram,
                                         self._skip)

    def _measures(self) -> Measures:
        return Measures(self.formats, self._dynamic, self.top_k)

    def _measure_activation(self, grad: Tensor, scale: Tensor | None) -> None:
        self._measures().count_activation(self.state, grad, scale, self._probe, self._skip)

    def _skip(self, name: str, err: Exception) -> None:
        if name not in self._failed:
            self._failed.add(name)
            warn(f"GradientUnderflowMonitor cannot measure `{name}` ({type(err).__name__}: {err}); it is left out of"
                 " the statistics.")

    def attach(self, module: nn.Module) -> None:
        """Hook every leaf module's output so its gradient is measured while ``capturing(True)``."""
        self._activations.attach(module)

    def detach(self) -> None:
        self._activations.detach()

    def capturing(self, on: bool, loss_scale: Tensor | float | None = None) -> None:
        """Measure activation gradients of the coming backward passes (``loss_scale``: the scale they carry)."""
        self._activations.capturing(on, loss_scale)

    @contextmanager
    def measuring_update(self, plugin: Any) -> Iterator[None]:
        """Count what rounding does to the 16-bit weights in the optimizer steps run inside (``plugin``: a
        ``BF16TruePrecision``/``FP16TruePrecision``; any other plugin rounds no weight, and nothing is counted):
        ``compute`` then reports ``precision/update_lost/<fmt>`` and ``precision/update_moved/<fmt>``. No host read."""
        self._arm(plugin)
        try:
            yield
        finally:
            self._disarm()

    def _arm(self, plugin: Any) -> None:
        stepper = _true_step_of(plugin)
        if stepper is not None:
            self._disarm()
            self._rounding.arm(stepper)

    def _disarm(self) -> None:
        for fmt, row in self._rounding.disarm(pending_device(self.state)).items():
            add_rounding(self.state, fmt, row)

    def compute(self, reduce: Reduce | None = None) -> dict[str, Tensor]:
        """The metrics accumulated since the last call, as 0-d tensors; resets the counts (not the histograms).

        ``reduce`` sums a tensor across processes (``fabric.all_reduce(t, reduce_op="sum")``); the Trainer glue passes
        the strategy's.
        """
        synced = sync_state(self.state, reduce, counts=True)
        first = self._measures().label(self.formats[0])
        metrics, overflowed = gradient_metrics(synced_counts(synced), self.top_k, first)
        if overflowed and self.probe_factor is not None and self.probe_factor > 2:
            self.probe_factor = smaller_factor(self.probe_factor)
        metrics.update(rounding_metrics(synced_rounding(synced)))
        return metrics

    def recommend_loss_scale(self) -> LossScaleAdvice:
        """``functional.recommend_loss_scale`` for fp16 (``.scale``, ``.underflow``, ``.overflow``) from the activation
        histogram if measured, else the parameter one."""
        hist = self.activation_histogram if int(self.activation_histogram.sum()) else self.histogram
        return recommend_loss_scale(hist, self.target_underflow)

    def save_plot(self, path: str) -> str:
        from lightning_precision._plots import plot_exponent_histogram

        hists = {"parameter gradients": self.histogram}
        if int(self.activation_histogram.sum()):
            hists["activation gradients"] = self.activation_histogram
        return plot_exponent_histogram(hists, path, formats=self.formats)

    # ---- Trainer glue -----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.fp8_scaling == "auto":
            self._dynamic = plugin_scaling(trainer.precision_plugin)
        if stage == "fit" and self.plot_path is not None and trainer.is_global_zero:
            check_plot_path(self.plot_path, f"GradientUnderflowMonitor(plot_path={str(self.plot_path)!r})")
        if self.activations and stage == "fit":
            self.attach(pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.detach()
        self._disarm()  # a fit stopped inside its step leaves the plugin as it was
        self._probe, self._log_due = None, False

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._disarm()  # a fit that raised inside its step (teardown is not called then) leaves the plugin as it was
        self._log_due = False

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # Decided once a step (it answers the same until the optimizer step): ordinary steps cost one check.
        self._measure_due = measure = on_cadence(trainer, self.measure_every_n_steps or self.log_every_n_steps)
        self._probe_due = measure and self.probe_factor is not None and fp16_backward(trainer.precision_plugin)
        if self.activations:
            self.capturing(measure, loss_scale_of(trainer.precision_plugin) if measure else None)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if not self._probe_due:
            return
        self._probe_due = False  # the first micro-batch of the step
        plugin = trainer.precision_plugin
        scale = loss_scale_of(plugin)
        if scale is None:  # not an fp16 backward after all (`_probe_due` says it is)
            return
        real_loss = loss / scale if hooks_see_scaled_loss(plugin) else loss
        try:
            self.probe_backward(real_loss, pl_module.named_parameters(), scale)
        except RuntimeError as err:  # e.g. reentrant activation checkpointing, which autograd.grad cannot run
            self.probe_factor = None
            warn(f"GradientUnderflowMonitor: the probe backward failed ({err}); it is off for this run, and gradients"
                 " fp16 already flushed are counted as exact zeros.")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.capturing(False)
        if self._measure_due:
            # FSDP2 gradients are DTensor shards: each rank counts its own, and the sum across ranks counts each once.
            # Replicated ones (DDP) enter the histogram from rank zero only, for the same reason.
            grads = {n: local_shard(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}
            carried = scale_in_gradients(trainer.precision_plugin)
            scale = carried if carried is not None else loss_scale_of(trainer.precision_plugin)
            self.measure_gradients(grads, scale, histogram=trainer.is_global_zero or is_sharded(pl_module),
                                   carries_scale=carried is not None)
            self._arm(trainer.precision_plugin)  # the step that follows counts what its rounding does
        # Logged once the optimizer step is done (on_train_batch_end), with what its rounding did.
        self._log_due = self._log_due or (
            self._measure_due if self.measure_every_n_steps is None else on_cadence(trainer, self.log_every_n_steps))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._disarm()
        if not self._log_due:
            return
        self._log_due = False
        metrics = self.compute(_across_processes(trainer))
        if not metrics:
            return
        # One device read for every key, straight to the loggers (at the step Lightning logs this batch's metrics) and
        # to `trainer.callback_metrics`: `self.log` cost about 0.6 ms a key, most of a logging step's cost.
        self.last_metrics = read_metrics(metrics)
        publish_metrics(trainer, self.last_metrics, batches_that_stepped(trainer), callback_metrics=True)
        self._maybe_warn(trainer, self.last_metrics)

    def _maybe_warn(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        key = None if self._warned else warning_key(metrics, self.warn_threshold)
        if key is None:
            return
        self._warned = True
        warn(underflow_warning(metrics, key, self.recommend_loss_scale(), trainer.precision_plugin))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank is here: sum what was measured since the last logging step, so the plot and the state are global.
        sync_state(self.state, _across_processes(trainer), counts=False)
        if self.plot_path is not None and trainer.is_global_zero:
            self.save_plot(self.plot_path)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "histogram": self.histogram.cpu(),
            "activation_histogram": self.activation_histogram.cpu(),  # with this process's part not yet summed
            "warned": self._warned,
            "probe_factor": self.probe_factor,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_histograms(self.state, state_dict)
        self._warned = state_dict["warned"]
        self.probe_factor = state_dict.get("probe_factor", self.probe_factor)
