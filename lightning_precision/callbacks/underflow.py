"""GradientUnderflowMonitor: how many gradients flush to zero (or overflow) in each low-precision format."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_precision._core.accumulator import Accumulator, Reduce, all_reduce, as_reduce_op
from lightning_precision._core.fsdp import is_sharded, local_shard
from lightning_precision._core.probe_pass import in_probe_pass, probe_pass
from lightning_precision._core.scaler import InStepScaler, ScalerConfig, scale_of
from lightning_precision._core.true_step import ROUNDING_COUNTS, RoundingMeter, TrueStep
from lightning_precision._plots import check_plot_path
from lightning_precision._upstream.lightning import batches_that_stepped, publish_metrics, unwrapped_name
from lightning_precision._warnings import warn
from lightning_precision.callbacks._cadence import on_cadence, set_cadence
from lightning_precision.formats import NumberFormat, get_format
from lightning_precision.functional import (
    HIST_MAX,
    HIST_MIN,
    CastStats,
    LossScaleAdvice,
    dynamic_scale_stats,
    exponent_histogram,
    gradient_stats,
    measurable_values,
    multi_format_stats,
    recommend_loss_scale,
)

__all__ = ["DYNAMIC", "FP8_SCALINGS", "GradientUnderflowMonitor", "Reduce"]


def _fp16_backward(plugin: Any) -> bool:
    """Whether the plugin's backward runs in fp16 with a loss scaler: ours (compute_dtype) or Lightning's 16-mixed."""
    return _loss_scale_of(plugin) is not None and (
        getattr(plugin, "compute_dtype", None) == torch.float16 or getattr(plugin, "precision", None) == "16-mixed"
    )


def _hooks_see_scaled_loss(plugin: Any) -> bool:
    """Lightning's MixedPrecision hands ``on_before_backward`` the scaled loss; ours hand it the real one."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return isinstance(plugin, MixedPrecision)


def _loss_scale_of(plugin: Any) -> Tensor | None:
    """The loss scale of a precision plugin with an enabled ``GradScaler`` (ours or Lightning's), as a device tensor
    (no synchronisation), or None when gradients are not scaled."""
    scaler = getattr(plugin, "scaler", None)
    if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
        return None
    return scale_of(scaler)


def _scale_in_gradients(plugin: Any) -> Tensor | None:
    """The loss scale the gradients still carry at ``on_before_optimizer_step`` (no synchronisation): a plugin that
    unscales inside its own step (``FP16TruePrecision``: in fp16 the small gradients would flush), else None."""
    scaler = getattr(plugin, "scaler", None)
    if not isinstance(scaler, InStepScaler) or not scaler.is_enabled():
        return None
    return scaler.carried_scale()


# `fp8_scaling=`: a plugin's `scaling_family` (FP8Precision.scaling_family), and how its casts are scaled: per row for
# torchao's rowwise recipes (rounded to powers of two, as they are), per block of 32 for MXFP8, per tensor otherwise
# (torchao tensorwise; Transformer Engine's delayed and current scaling, measured at the current amax; NVFP4's plugin,
# whose casts are not fp8: a what-if at a per-tensor scale).
FP8_SCALINGS = ("tensorwise", "rowwise", "mxfp8", "delayed", "current", "block", "custom", "nvfp4")
_DYNAMIC = {"rowwise": ("rowwise", True), "mxfp8": ("mxfp8", False)}
DYNAMIC = "dynamic"  # the key segment of a figure taken at the dynamic scale: precision/underflow/e4m3fn/dynamic


def _plugin_scaling(plugin: Any) -> tuple[str, bool] | None:
    """How the fp8 plugin scales what it casts to fp8, as ``(scaling, pow2)`` for ``dynamic_scale_stats``; None for a
    plugin that casts nothing to fp8."""
    family = getattr(plugin, "scaling_family", None)  # lightning_precision's FP8Precision
    if family is None:  # Lightning's own TransformerEnginePrecision: delayed scaling, per tensor
        return ("tensorwise", False) if str(getattr(plugin, "precision", "")).startswith("transformer-engine") else None
    if getattr(plugin, "backend", None) == "torchao" and family in ("tensorwise", "rowwise"):
        from lightning_precision.fp8._sensitivity import cast_specs

        spec = cast_specs(plugin.recipe)["grad_output"]  # the recipe's own gradient cast, whatever its name
        return ("rowwise" if spec.axiswise else "tensorwise", spec.pow2)
    return _DYNAMIC.get(family, ("tensorwise", False))


def _true_step_of(plugin: Any) -> TrueStep | None:
    """The fp32 step of a true-precision plugin (``BF16TruePrecision``, ``FP16TruePrecision``), where rounding happens;
    None for any other plugin."""
    stepper = getattr(plugin, "true_step", None)  # only the true-precision plugins round their weights
    return stepper if isinstance(stepper, TrueStep) else None


def _unscaled(g: Tensor, scale: Tensor | float) -> Tensor:
    """``g / scale`` in (at least) fp32: in fp16 the small values would flush (a 0-d scale does not promote ``g``)."""
    wide = g.to(torch.promote_types(g.dtype, torch.float32))
    return wide / (scale.to(wide.device) if isinstance(scale, Tensor) else scale)


def _module_path(param_name: str) -> str:
    param_name = unwrapped_name(param_name)
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


_COUNT = "count/"  # the accumulator's per-window CastStats, one int64 [5] state per key ("count/param/fp16")
_ROUNDING = "rounding/"  # per-window `RoundingMeter` counts, one int64 row of ROUNDING_COUNTS per weight format
# Row 0 parameter gradients, row 1 activation gradients: the global totals ("last": already summed across processes)
# and this process's part since the last sync ("sum").
_TOTALS = ("histogram/param", "histogram/activation")
_PENDING = ("pending/param", "pending/activation")


def _stacked(stats: CastStats) -> Tensor:
    fields = [getattr(stats, f.name) for f in dataclasses.fields(stats)]
    return torch.stack([f.to(fields[0].device) for f in fields])


class _Probe:
    """The probe backward of one micro-batch: where its gradients are non-zero, their histogram, and whether it stayed
    finite (if not, it says nothing: it is discarded on the device, without a host read). With activation hooks, the
    activation gradients it passed (``activation_histogram``) and those of the real backward (``real_activations``),
    one of which joins the monitor's histogram once the probe is judged."""

    def __init__(self, nonzero: dict[str, Tensor], histogram: Tensor, finite: Tensor,
                 activation_histogram: Tensor | None = None, headroom: Tensor | None = None) -> None:
        # `finite`: whether it is judged (it stayed finite, and saw beyond the real backward); `overflowed`: whether it
        # went non-finite (what makes the next probe smaller).
        self.nonzero, self.histogram, self.overflowed = nonzero, histogram, ~finite
        self.finite = finite if headroom is None else finite & headroom.to(finite.device)
        self.activation_histogram = activation_histogram
        self.real_activations: Tensor | None = None


class _RunInBackward(torch.autograd.Function):
    """A root whose backward calls ``fn`` and passes no gradient on."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[], Any], leaf: Tensor) -> Tensor:
        ctx.fn = fn
        return leaf.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        ctx.fn()
        return None, None


def _run_in_backward(fn: Callable[[], Any], device: torch.device, backward: Callable[[Tensor], None]) -> Any:
    """``fn()``, run from inside ``backward(root)``: Fabric lets a backward pass through its model's outputs only there.
    The root hangs on a fresh leaf, so ``backward`` walks (and frees) nothing of the model's graph, and the gradient it
    sends in (the loss scale) is not used."""
    result: list[Any] = []
    backward(_RunInBackward.apply(lambda: result.append(fn()), torch.zeros((), device=device, requires_grad=True)))
    return result[0]


def _across_processes(trainer: pl.Trainer) -> Reduce | None:
    """The Trainer's ranks' sum (``all_reduce``); None on one process."""
    return all_reduce if trainer.world_size > 1 else None


def _check_fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) <= 1:
        raise ValueError(f"`GradientUnderflowMonitor({name}={value!r})`: a fraction, in [0, 1], e.g. 0.01.")


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
        if isinstance(formats, (str, torch.dtype, NumberFormat)):
            formats = (formats,)  # one format, not the letters of its name
        if not isinstance(formats, Iterable) or not list(formats):
            raise ValueError(f"`{owner}(formats={formats!r})`: name at least one format, e.g. ('fp16',) or 'fp16'.")
        self.formats = tuple(get_format(f).name for f in formats)
        set_cadence(self, owner, measure_every_n_steps=measure_every_n_steps, log_every_n_steps=log_every_n_steps)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"`{owner}(top_k={top_k!r})`: a whole number of modules, 0 (no per-layer keys) or more.")
        _check_fraction("warn_threshold", warn_threshold)
        _check_fraction("target_underflow", target_underflow)
        if probe_factor is not None and (
            isinstance(probe_factor, bool) or not isinstance(probe_factor, numbers.Real) or not probe_factor > 1
            or not math.isfinite(probe_factor) or math.log2(probe_factor) % 1
        ):
            raise ValueError(f"`{owner}(probe_factor={probe_factor!r})`: a power of two > 1 (e.g. 2.0**16), or None for"
                             " no probe.")
        if fp8_scaling not in (None, "auto", *FP8_SCALINGS):
            raise ValueError(f"`{owner}(fp8_scaling={fp8_scaling!r})`: 'auto' (the Trainer's fp8 plugin's scaling),"
                             f" None (unscaled), or a plugin's `scaling_family`: one of {FP8_SCALINGS}.")
        self.fp8_scaling = fp8_scaling
        # (scaling, pow2) the fp8 formats are measured at; None: unscaled. "auto" is resolved at the Trainer's setup.
        self._dynamic: tuple[str, bool] | None = None if fp8_scaling in (None, "auto") else \
            _DYNAMIC.get(fp8_scaling, ("tensorwise", False))
        self.activations = activations
        self.top_k = top_k
        self.warn_threshold = warn_threshold
        self.target_underflow = target_underflow
        self.plot_path = plot_path
        self.probe_factor = probe_factor
        # Histograms: totals summed across processes at each `compute(reduce)`, and this process's part since then;
        # the window's counts join as "count/<key>" states when first measured.
        self.state = Accumulator()
        for totals, pending in zip(_TOTALS, _PENDING, strict=True):
            self.state.add_state(totals, torch.zeros(HIST_MAX - HIST_MIN, dtype=torch.int64), "last")
            self.state.add_state(pending, torch.zeros(HIST_MAX - HIST_MIN, dtype=torch.int64), "sum")
        self._capturing = False
        self._hooks: list[Any] = []
        self._warned = False
        self._act_scale: Tensor | None = None
        self._probe: _Probe | None = None
        # While the probe's backward runs: its effective scale, and the activation gradients its hooks saw.
        self._probe_scale: Tensor | None = None
        self._probe_activations: Tensor | None = None
        self._probe_due = False
        self.last_metrics: dict[str, float] = {}  # the last logged values, read once
        self._measure_due = False  # this step measures (set at the step's first batch)
        self._meter = RoundingMeter()
        self._armed: TrueStep | None = None  # the true-precision step counting into `_meter` now
        self._log_due = False  # the Trainer step logs, once its optimizer step is done
        self._failed: set[str] = set()

    @property
    def histogram(self) -> Tensor:
        """Counts of log2|g| of parameter gradients (unscaled), one bin per power of two from ``HIST_MIN``."""
        return self._histogram(0)

    @property
    def activation_histogram(self) -> Tensor:
        """The same for activation gradients (``activations=True``)."""
        return self._histogram(1)

    def _histogram(self, row: int) -> Tensor:
        totals = self.state[_TOTALS[row]]
        return totals + self.state[_PENDING[row]].to(totals.device)

    def _add_histogram(self, row: int, hist: Tensor) -> None:
        self.state.update(_PENDING[row], hist)

    def _count(self, key: str, stats: CastStats) -> None:
        name = _COUNT + key
        if name not in self.state:
            self.state.add_state(name, torch.zeros(5, dtype=torch.int64), "sum")
        self.state.update(name, _stacked(stats))

    def _sync(self, reduce: Reduce | None, counts: bool) -> dict[str, Tensor]:
        """One sync: the window's counts (``counts``: gradient and rounding ones) and this process's histograms since
        the last sync, summed across processes by ``reduce`` in one call; the histograms join the totals, so every
        process holds the same global histogram. Returns the counts by state name, and forgets them."""
        counted = [name for prefix in (_COUNT, _ROUNDING) for name in self.state.names(prefix)] if counts else []
        synced = self.state.sync(as_reduce_op(reduce), [*counted, *_PENDING])
        for totals, pending in zip(_TOTALS, _PENDING, strict=True):
            self.state.set(totals, self.state[totals].to(synced[pending].device) + synced[pending])
        self.state.reset(*_PENDING)
        self.state.remove_state(*counted)
        return {name: synced[name] for name in counted}

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
        scale = torch.as_tensor(loss_scale, dtype=torch.float32, device=loss.device)
        effective = scale * self.probe_factor
        headroom = None
        if loss.dtype == torch.float16:
            # An fp16 loss (FP16TruePrecision) takes its gradient, the scale, in fp16: above 2**15 it is inf at the
            # root. Capped there; a probe no larger than the real scale sees nothing beyond it and is not judged.
            effective = effective.clamp(max=2.0**15)
            headroom = effective > scale
        probe = functools.partial(torch.autograd.grad, loss * effective, list(params.values()), retain_graph=True,
                                  allow_unused=True)
        self._fold_unjudged_activations()
        # The activation hooks fire in the probe's backward too: what they see there is scaled by `effective`, and it
        # is the probe's (kept apart), not a second count of the step.
        self._probe_scale, self._probe_activations = effective, None
        try:
            with probe_pass(self):  # not a step of anyone else's measurements (`_probe_pass`)
                grads = probe() if backward is None else _run_in_backward(probe, loss.device, backward)
        finally:
            probe_activations, self._probe_scale, self._probe_activations = self._probe_activations, None, None
        present = {n: g for n, g in zip(params, grads, strict=True) if g is not None}
        if params and not present:
            # FSDP2 computes gradients of its unsharded copies, not of the (sharded) parameters the module lists, and
            # reduces them into `.grad` in its own hooks: a probe w.r.t. the parameters sees nothing there.
            self.probe_factor = None
            warn("GradientUnderflowMonitor: the probe backward reached none of the model's parameters (parameters"
                 " sharded by FSDP2 get their gradients through FSDP2's own hooks); it is off for this run, so"
                 " `precision/underflow/fp16/lost` is not reported and gradients fp16 already flushed count as exact"
                 " zeros.")
            return
        finite = torch.stack([torch.isfinite(measurable_values(g)).all() for g in present.values()]).all() if present \
            else torch.ones((), dtype=torch.bool)
        nonzero = {n: measurable_values(g) != 0 for n, g in present.items()}
        self._probe = _Probe(nonzero, exponent_histogram(present, 1.0 / effective), finite, probe_activations,
                             headroom)

    def _fold_unjudged_activations(self) -> None:
        """A probe never judged (no ``measure_gradients`` after it): the real backward's activation gradients stand."""
        if self._probe is not None and self._probe.real_activations is not None:
            self._add_histogram(1, self._probe.real_activations)
            self._probe.real_activations = None

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
        hist = lost = compared = None
        for name, g in named_grads.items():
            if g is None:
                continue
            try:
                if carries_scale:
                    g = _unscaled(g, loss_scale)  # type: ignore[arg-type]  # not None: checked above
                per_format, scaled, h = gradient_stats(g, self.formats, loss_scale)
                per_format = self._at_fp8_scale(g, per_format)
            except (RuntimeError, TypeError, ValueError) as err:
                self._skip(name, err)
                continue
            values = measurable_values(g)
            probed = probe.nonzero.get(name) if probe is not None else None
            # Compared element for element only where the probe saw the same values (a sparse gradient may store
            # others): elsewhere this tensor adds nothing to the lost count, and its own statistics stand.
            if probed is not None and probed.shape == values.shape:
                flushed = torch.count_nonzero((values == 0) & probed)
                lost = flushed if lost is None else lost + flushed
                n = torch.zeros((), dtype=torch.int64, device=flushed.device) + probed.numel()
                compared = n if compared is None else compared + n
            for fmt, stats in per_format.items():
                self._count(f"param/{fmt}", stats)
            if self.top_k:
                self._count(f"layer/{_module_path(name)}", per_format[self._label(self.formats[0])])
            if scaled is not None:
                self._count("param_scaled/fp16", scaled)
            hist = h if hist is None else hist + h
        if lost is not None and compared is not None and probe is not None:
            # A probe that overflowed says nothing: it adds neither losses nor elements (decided on the device), and
            # its overflow is remembered so that the next probe is smaller.
            zero = torch.zeros_like(lost)
            lost, compared = torch.where(probe.finite, lost, zero), torch.where(probe.finite, compared, zero)
            self._count("lost/fp16", CastStats(numel=compared, exact_zero=zero, underflow=lost, overflow=zero,
                                                    nonfinite=probe.overflowed.to(torch.int64)))
            hist = torch.where(probe.finite, probe.histogram.to(hist.device), hist) if hist is not None else hist
        if hist is not None and histogram:
            self._add_histogram(0, hist)
        if probe is not None and probe.activation_histogram is not None:
            # The same choice for activation gradients: the probe's where it stayed finite (it holds what fp16's real
            # backward flushed), else the real backward's.
            real = probe.real_activations if probe.real_activations is not None else \
                torch.zeros_like(probe.activation_histogram)
            self._add_histogram(1, torch.where(probe.finite.to(real.device), probe.activation_histogram.to(real.device),
                                               real))

    def _fp8_formats(self) -> list[str]:
        """The fp8 formats measured at the dynamic scale (``fp8_scaling``); none when unscaled. A block format
        (``"mxfp8"``) scales each block itself already."""
        if self._dynamic is None:
            return []
        return [name for name in self.formats
                if isinstance(get_format(name), NumberFormat) and get_format(name).bits == 8]

    def _label(self, fmt: str) -> str:
        """How a format's figures are keyed: ``e4m3fn/dynamic`` when measured at the dynamic scale."""
        return f"{fmt}/{DYNAMIC}" if fmt in self._fp8_formats() else fmt

    def _at_fp8_scale(self, g: Tensor, per_format: dict[str, CastStats]) -> dict[str, CastStats]:
        """``per_format`` with each fp8 format's counts taken at the dynamic scale instead, keyed ``<fmt>/dynamic``."""
        fp8 = self._fp8_formats()
        if not fp8:
            return per_format
        assert self._dynamic is not None
        dynamic = dynamic_scale_stats(g, fp8, *self._dynamic)
        return {self._label(name): dynamic.get(name, stats) for name, stats in per_format.items()}

    def _skip(self, name: str, err: Exception) -> None:
        if name not in self._failed:
            self._failed.add(name)
            warn(f"GradientUnderflowMonitor cannot measure `{name}` ({type(err).__name__}: {err}); it is left out of"
                 " the statistics.")

    def attach(self, module: nn.Module) -> None:
        """Hook every leaf module's output so its gradient is measured while ``capturing(True)``."""
        for sub in module.modules():
            if next(sub.children(), None) is None:
                self._hooks.append(sub.register_forward_hook(self._forward_hook))

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def capturing(self, on: bool, loss_scale: Tensor | float | None = None) -> None:
        """Measure activation gradients of the coming backward passes (``loss_scale``: the scale they carry)."""
        self._capturing = on
        self._act_scale = torch.as_tensor(loss_scale) if loss_scale is not None else None

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
            stepper.meter, self._armed = self._meter, stepper

    def _disarm(self) -> None:
        stepper, self._armed = self._armed, None
        if stepper is None:
            return
        stepper.meter = None
        counts = self._meter.take()
        # The state of the plugin's dtype is declared even when nothing was stepped, so that every process syncs the
        # same states (each then counts what its own step did).
        device = self.state[_PENDING[0]].device  # where the counts are (a collective may need them on the GPU)
        counts.setdefault(stepper.dtype, torch.zeros(len(ROUNDING_COUNTS), dtype=torch.int64, device=device))
        for dtype, row in counts.items():
            name = _ROUNDING + get_format(dtype).name
            if name not in self.state:
                self.state.add_state(name, torch.zeros(len(ROUNDING_COUNTS), dtype=torch.int64), "sum")
            self.state.update(name, row)

    def compute(self, reduce: Reduce | None = None) -> dict[str, Tensor]:
        """The metrics accumulated since the last call, as 0-d tensors; resets the counts (not the histograms).

        ``reduce`` sums a tensor across processes (``fabric.all_reduce(t, reduce_op="sum")``); the Trainer glue passes
        the strategy's.
        """
        synced = self._sync(reduce, counts=True)
        stats = {name[len(_COUNT):]: CastStats(*row.unbind()) for name, row in synced.items()
                 if name.startswith(_COUNT)}
        metrics = self._gradient_metrics(stats)
        metrics.update(self._rounding_metrics(synced))
        return metrics

    @staticmethod
    def _rounding_metrics(synced: dict[str, Tensor]) -> dict[str, Tensor]:
        """What rounding lost and moved, as fractions of the elements whose fp32 update was nonzero; a format none of
        whose elements was stepped in the window (every step skipped, or not stepped by the true step) is left out:
        unknown, not 0."""
        metrics: dict[str, Tensor] = {}
        for name, row in synced.items():
            if not name.startswith(_ROUNDING):
                continue
            counts = dict(zip(ROUNDING_COUNTS, row.unbind(), strict=True))
            if int(counts["stepped"]) == 0:  # read on a logging step
                continue
            fmt, updated = name[len(_ROUNDING):], counts["updated"].clamp(min=1).double()
            metrics[f"precision/update_lost/{fmt}"] = counts["lost_to_nearest"].double() / updated
            metrics[f"precision/update_moved/{fmt}"] = counts["moved"].double() / updated
        return metrics

    def _gradient_metrics(self, stats: dict[str, CastStats]) -> dict[str, Tensor]:
        lost = stats.get("lost/fp16")
        overflowed = lost is not None and int(lost.nonfinite) > 0  # read here, on a logging step
        if lost is not None and int(lost.numel) == 0:
            stats.pop("lost/fp16")  # every probe of the window overflowed: what was lost is unknown, not 0
            lost = None
        metrics: dict[str, Tensor] = {}
        for key, s in stats.items():
            kind, name = key.split("/", 1)
            if kind == "param":
                metrics[f"precision/underflow/{name}"] = s.underflow_fraction
                metrics[f"precision/overflow/{name}"] = s.overflow_fraction
                zeros = s.exact_zero - lost.underflow if lost is not None else s.exact_zero
                metrics["precision/exact_zero"] = zeros.double() / s.numel.clamp(min=1).double()
            elif kind == "param_scaled":
                under = s.underflow + lost.underflow if lost is not None else s.underflow
                metrics[f"precision/underflow/{name}/scaled"] = under.double() / s.numel.clamp(min=1).double()
                metrics[f"precision/overflow/{name}/scaled"] = s.overflow_fraction
            elif kind == "lost":
                metrics[f"precision/underflow/{name}/lost"] = s.underflow_fraction
            elif kind.startswith("act"):
                suffix = "/scaled" if kind == "act_scaled" else ""
                metrics[f"precision/act_underflow/{name}{suffix}"] = s.underflow_fraction
                metrics[f"precision/act_overflow/{name}{suffix}"] = s.overflow_fraction
                metrics["precision/act_exact_zero"] = s.exact_zero_fraction
        layers = {k.split("/", 1)[1]: s.underflow_fraction for k, s in stats.items() if k.startswith("layer/")}
        # one read for every layer's fraction, not one each (on a GPU each read is a synchronisation)
        fractions = dict(zip(layers, torch.stack([v.double() for v in layers.values()]).tolist(), strict=True)) \
            if layers else {}
        for path in sorted(layers, key=lambda p: -fractions[p])[: self.top_k]:
            metrics[f"precision/underflow/{self._label(self.formats[0])}/{path}"] = layers[path]
        if overflowed and self.probe_factor is not None and self.probe_factor > 2:
            self.probe_factor = 2.0 ** (int(math.log2(self.probe_factor)) // 2)
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

    def _forward_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._capturing and isinstance(output, Tensor) and output.requires_grad and output.is_floating_point() \
                and not in_probe_pass(self):
            # A hook on the output tensor, not a full backward hook: those fail when the next op is in-place
            # (ReLU(inplace=True) in torchvision's ResNets); the gradient seen is the same.
            output.register_hook(self._activation_grad)

    def _activation_grad(self, grad: Tensor) -> None:
        if in_probe_pass(self):  # another's pass through this step's graph
            return
        if self._probe_scale is not None:  # inside the probe's backward: its histogram only, at its own scale
            try:
                hist = exponent_histogram(grad, 1.0 / self._probe_scale)
            except (RuntimeError, TypeError, ValueError):
                return  # the real backward's hook reports it
            self._probe_activations = hist if self._probe_activations is None else self._probe_activations + hist
            return
        scale = self._act_scale
        kind = "act_scaled" if scale is not None else "act"
        try:
            per_format = self._at_fp8_scale(grad, multi_format_stats(grad, self.formats))
            hist = exponent_histogram(grad, 1.0 / scale if scale is not None else 1.0)
        except (RuntimeError, TypeError, ValueError) as err:
            self._skip("activation gradients", err)
            return
        for fmt, stats in per_format.items():
            self._count(f"{kind}/{fmt}", stats)
        probe = self._probe
        if probe is not None and probe.activation_histogram is not None:  # judged with the probe, at measure time
            probe.real_activations = hist if probe.real_activations is None else probe.real_activations + hist
        else:
            self._add_histogram(1, hist)

    # ---- Trainer glue -----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.fp8_scaling == "auto":
            self._dynamic = _plugin_scaling(trainer.precision_plugin)
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
        self._probe_due = measure and self.probe_factor is not None and _fp16_backward(trainer.precision_plugin)
        if self.activations:
            self.capturing(measure, _loss_scale_of(trainer.precision_plugin) if measure else None)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if not self._probe_due:
            return
        self._probe_due = False  # the first micro-batch of the step
        plugin = trainer.precision_plugin
        scale = _loss_scale_of(plugin)
        if scale is None:  # not an fp16 backward after all (`_probe_due` says it is)
            return
        real_loss = loss / scale if _hooks_see_scaled_loss(plugin) else loss
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
            carried = _scale_in_gradients(trainer.precision_plugin)
            scale = carried if carried is not None else _loss_scale_of(trainer.precision_plugin)
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
        values = torch.stack([v.float() for v in metrics.values()]).tolist()
        self.last_metrics = dict(zip(metrics, values, strict=True))
        publish_metrics(trainer, self.last_metrics, batches_that_stepped(trainer), callback_metrics=True)
        self._maybe_warn(trainer, self.last_metrics)

    def _maybe_warn(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if self._warned:
            return
        key = next((k for k in ("precision/underflow/fp16/scaled", "precision/act_underflow/fp16/scaled",
                                "precision/underflow/fp16") if k in metrics), None)
        if key is None or metrics[key] <= self.warn_threshold:
            return
        self._warned = True
        scale, under, _ = self.recommend_loss_scale()
        current = _loss_scale_of(trainer.precision_plugin)
        at = f"at loss scale {float(current):g}" if current is not None else "without loss scaling"
        if not ScalerConfig.min_scale <= scale <= ScalerConfig.max_scale:
            advice = (f"No loss scale within [{ScalerConfig.min_scale:g}, {ScalerConfig.max_scale:g}] keeps them"
                      f" without overflow (it would take {scale:g}): train in bf16 (BF16MixedPrecision).")
        else:
            # The plugin to pass it to: the true one when the run is in true fp16, else the mixed one.
            plugin = "FP16TruePrecision" if _scale_in_gradients(trainer.precision_plugin) is not None else \
                "FP16MixedPrecision"
            advice = (f"A loss scale of {scale:g} would leave {under:.3%}: `{plugin}(init_scale={scale:g})`, or"
                      " train in bf16.")
        warn(f"{metrics[key]:.2%} of gradients flush to zero in fp16 {at} ({key}). {advice}")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank is here: sum what was measured since the last logging step, so the plot and the state are global.
        self._sync(_across_processes(trainer), counts=False)
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
        for totals, key in zip(_TOTALS, ("histogram", "activation_histogram"), strict=True):
            self.state.set(totals, state_dict[key].to(torch.int64))
        self.state.reset(*_PENDING)
        self._warned = state_dict["warned"]
        self.probe_factor = state_dict.get("probe_factor", self.probe_factor)
