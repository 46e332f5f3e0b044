"""MFUMonitor: model FLOPs utilisation of a Trainer fit, against this package's table of dense peaks."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_precision._core.probe_pass import probe_pass
from lightning_precision._mfu import (
    KINDS,
    PeakChoice,
    choose_peak,
    compute_kind,
    mfu,
    model_flops_per_step,
    parse_peak_override,
    peak_device_name,
    plugin_compute_dtype,
)
from lightning_precision._upstream.lightning import batches_that_stepped, publish_metrics
from lightning_precision._warnings import NoEffectWarning, warn
from lightning_precision.callbacks._cadence import on_cadence, set_cadence

__all__ = ["FlopsPerBatch", "LossFn", "MFUMonitor", "MFUWindow"]

FlopsPerBatch = int | float | Callable[[Any], int | float]
LossFn = Callable[[nn.Module, Any], Tensor]
_OWNER = "MFUMonitor"
_OPTION = "MFUMonitor(peak_tflops=...)"


@dataclass(frozen=True)
class MFUWindow:
    """One measured window of optimizer steps, as logged at ``step`` (the logger's step of its last optimizer step).

    ``start``/``end`` are ``time.perf_counter()`` at the first micro-batch's ``on_train_batch_start`` and, after a
    device synchronisation, the last one's ``on_train_batch_end``; ``paused`` is the validation time between them,
    which is not training."""

    step: int
    start: float
    end: float
    paused: float
    steps: int
    batches: int
    flops: float
    peak: PeakChoice
    achieved_tflops: float
    mfu: float | None

    @property
    def seconds(self) -> float:
        return self.end - self.start - self.paused


@dataclass
class _Open:
    """The window being measured (mutable; becomes an ``MFUWindow`` when it closes)."""

    start: float
    paused: float = 0.0
    pause_start: float | None = None
    batches: int = 0
    steps: int = 0
    flops: float = 0.0


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < float(value) < math.inf


def _peak_overrides(peak_tflops: Any) -> dict[str, float] | None:
    """``peak_tflops`` as ``choose_peak``'s overrides: one number for every kind, kind -> number, or the command line's
    text (``parse_peak_override``)."""
    if peak_tflops is None:
        return None
    bad = f"`{_OWNER}(peak_tflops={peak_tflops!r})`"
    if isinstance(peak_tflops, str):
        try:
            return parse_peak_override(peak_tflops, option=None)  # (the error names the argument, not a flag)
        except ValueError as err:
            raise ValueError(f"{bad}: {err}") from None
    if isinstance(peak_tflops, Mapping):
        unknown = [k for k in peak_tflops if k not in KINDS]
        if unknown or not peak_tflops:
            raise ValueError(f"{bad}: name kinds from {', '.join(KINDS)}, e.g. {{'bf16': 989.0}}.")
        if not all(_positive(v) for v in peak_tflops.values()):
            raise ValueError(f"{bad}: peaks are positive, finite TFLOP/s.")
        return {k: float(v) for k, v in peak_tflops.items()}
    if not _positive(peak_tflops):
        raise ValueError(f"{bad}: the device's dense peak in TFLOP/s (a positive, finite number), kind -> TFLOP/s"
                         " (e.g. {'bf16': 989.0}), 'bf16=989,fp8=1979', or None for the built-in table.")
    return dict.fromkeys(KINDS, float(peak_tflops))


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so the host's clock covers it (CUDA runs ahead of the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@contextlib.contextmanager
def _untouched(module: nn.Module, device: torch.device) -> Iterator[None]:
    """The FLOP count's extra forward must not change the run: random streams (dropout) and buffers (BatchNorm's
    running statistics) are restored after it."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


class MFUMonitor(Callback):
    """Logs model FLOPs utilisation during ``Trainer.fit``: ``precision/achieved_tflops``, ``precision/mfu`` (a
    fraction of the peak, 0..1) and, once and again whenever it changes, ``precision/peak_tflops``.

    Each value is measured over a window of optimizer steps ending on a logging step (every ``log_every_n_steps``
    steps): the wall clock from the window's first micro-batch's ``on_train_batch_start`` to its last micro-batch's
    ``on_train_batch_end`` (validation inside the window excluded), with one device synchronisation at the end of each
    window and none per step. Achieved TFLOP/s is the window's FLOPs (summed over every micro-batch, so gradient
    accumulation counts each optimizer step's micro-batches) over that time. The first window of each fit is not
    logged: it holds the warm-up (CUDA context, kernel autotuning, ``torch.compile``) and the FLOP count itself.

    The peak is the device's dense peak for the kind the precision plugin's matmuls run in
    (``lightning_precision._mfu.choose_peak``): this package's plugins name it (``peak_flops_dtype``; read again at
    every log, so an fp8 plugin's peak follows ``layers="auto"``), Lightning's own plugins by their precision string,
    fp32 (tf32 when torch allows it) otherwise. Without a peak (a CPU, a GPU not in the table) a ``NoEffectWarning``
    says why, once, and only achieved TFLOP/s is logged.

    Each process measures its own device, its own batches and its own peak; what is logged is global rank zero's
    (Lightning's loggers write on rank zero only), with no reduction across processes. Every process keeps its own
    values in ``last_metrics`` and ``windows``.

    Args:
        flops_per_batch: the model's training FLOPs (forward and backward) of one micro-batch, or a function
            ``(batch) -> FLOPs`` for batches that differ (a shorter last batch, variable sequence lengths).
        loss_fn: instead of ``flops_per_batch``, ``(module, batch) -> loss``: the FLOPs are counted once, on the first
            training batch, with ``lightning_precision._mfu.model_flops_per_step`` (``torch.utils.flop_counter``:
            matmuls, convolutions, attention). ``training_step`` is never called for it: it logs and may have other
            side effects.
        peak_tflops: the device's dense peak in TFLOP/s instead of the built-in table: one number for every kind,
            kind -> TFLOP/s (``{"bf16": 989.0, "fp8": 1979.0}``; kinds without one fall back to the table), or the
            command line's text (``"bf16=989,fp8=1979"``).
        log_every_n_steps: the window, in optimizer steps; ``None`` follows ``Trainer(log_every_n_steps=...)``.
        keep_windows: how many of the most recent ``MFUWindow`` records ``windows`` keeps.
    """

    log_every_n_steps: int | None  # set by `set_cadence`, which checks it

    def __init__(
        self,
        flops_per_batch: FlopsPerBatch | None = None,
        loss_fn: LossFn | None = None,
        peak_tflops: float | Mapping[str, float] | str | None = None,
        log_every_n_steps: int | None = None,
        keep_windows: int = 100,
    ) -> None:
        if flops_per_batch is None and loss_fn is None:
            raise ValueError(f"`{_OWNER}()` needs the model's FLOPs: pass `flops_per_batch=` (FLOPs of one training"
                             " micro-batch, or a function of the batch) or `loss_fn=` (`(module, batch) -> loss`,"
                             " counted on the first batch). It does not call `training_step` to guess them: that logs"
                             " and may have side effects.")
        if flops_per_batch is not None and loss_fn is not None:
            raise ValueError(f"`{_OWNER}(flops_per_batch=..., loss_fn=...)`: pass one; `loss_fn` only serves to count"
                             " the FLOPs that `flops_per_batch` gives.")
        if flops_per_batch is not None and not callable(flops_per_batch) and not _positive(flops_per_batch):
            raise ValueError(f"`{_OWNER}(flops_per_batch={flops_per_batch!r})`: a positive, finite number of FLOPs per"
                             " micro-batch, or a function `(batch) -> FLOPs`.")
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"`{_OWNER}(loss_fn={loss_fn!r})`: a function `(module, batch) -> loss tensor`.")
        set_cadence(self, _OWNER, log_every_n_steps=log_every_n_steps)
        if isinstance(keep_windows, bool) or not isinstance(keep_windows, int) or keep_windows < 1:
            raise ValueError(f"`{_OWNER}(keep_windows={keep_windows!r})`: a positive int.")
        self.flops_per_batch = flops_per_batch
        self.loss_fn = loss_fn
        self.peak_overrides = _peak_overrides(peak_tflops)
        self.measured_flops: int | None = None  # loss_fn's count, per micro-batch
        self.windows: deque[MFUWindow] = deque(maxlen=keep_windows)
        self.last_metrics: dict[str, float] = {}
        self._device = torch.device("cpu")
        self._device_name = "cpu"
        self._open: _Open | None = None
        self._warmup = True
        self._step_at_start = 0
        self._logged_peak: float | None = None
        self._warned: set[str] = set()
        self._failed = False

    # ---- the peak ---------------------------------------------------------------------------------------------------

    def peak(self, plugin: Any) -> PeakChoice:
        """The peak the plugin's compute kind counts against on this fit's device (read now: it may change)."""
        dtype = plugin_compute_dtype(plugin)
        try:
            kind = compute_kind(dtype)
        except ValueError:
            return PeakChoice(None, f"n/a: no peak for {str(dtype).removeprefix('torch.')} matmuls", "")
        return choose_peak(self._device_name, kind, self.peak_overrides, option=_OPTION)

    def _warn_once(self, message: str, category: type[Warning] = NoEffectWarning) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warn(message, category)

    def _check_peak(self, choice: PeakChoice) -> None:
        if choice.tflops is None:
            self._warn_once(f"{_OWNER}: precision/mfu is n/a ({choice.source}); only precision/achieved_tflops is"
                            " logged.")

    # ---- FLOPs ------------------------------------------------------------------------------------------------------

    def _batch_flops(self, batch: Any) -> float | None:
        if self.flops_per_batch is None:
            return self.measured_flops
        flops = self.flops_per_batch(batch) if callable(self.flops_per_batch) else self.flops_per_batch
        if not _positive(flops):
            raise ValueError(f"`{_OWNER}(flops_per_batch=...)` returned {flops!r} for a batch: it must return a"
                             " positive, finite number of FLOPs.")
        return float(flops)

    def _measure(self, pl_module: pl.LightningModule, batch: Any) -> None:
        assert self.loss_fn is not None
        try:
            with _untouched(pl_module, self._device), probe_pass(self):  # no other callback measures it
                self.measured_flops = model_flops_per_step(pl_module, batch, self.loss_fn)
        except Exception as err:  # a model the flop counter cannot trace must not stop the fit
            self._failed = True
            self._warn_once(f"{_OWNER}: counting the FLOPs of the first batch with `loss_fn` failed"
                            f" ({type(err).__name__}: {err}); nothing is logged. Pass `flops_per_batch=` instead.",
                            UserWarning)
            return
        if not self.measured_flops:
            self._failed = True
            self._warn_once(f"{_OWNER}: `loss_fn` ran no operation that torch.utils.flop_counter counts (matmuls,"
                            " convolutions, attention); nothing is logged. Pass `flops_per_batch=` instead.")

    # ---- Trainer glue -----------------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._device = trainer.strategy.root_device
        self._device_name = peak_device_name(self._device)
        self._open, self._warmup, self._logged_peak = None, True, None
        self._check_peak(self.peak(trainer.precision_plugin))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.loss_fn is not None and self.measured_flops is None and not self._failed:
            self._measure(pl_module, batch)  # before the clock starts: it is not training
        self._step_at_start = trainer.global_step
        if self._open is None:
            self._open = _Open(start=perf_counter())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        window = self._open
        if window is None or self._failed:
            return
        window.batches += 1
        window.flops += self._batch_flops(batch) or 0.0
        # `global_step` counts optimizer steps: a micro-batch that did not step belongs to the step that follows.
        if trainer.global_step == self._step_at_start:
            return
        window.steps += 1
        if not on_cadence(trainer, self.log_every_n_steps):
            return
        _synchronize(self._device)  # once per window: the steps' queued device work is part of their time
        end = perf_counter()
        self._open = None
        if self._warmup:
            self._warmup = False
            return
        self._close(trainer, window, end)

    def _close(self, trainer: pl.Trainer, window: _Open, end: float) -> None:
        seconds = end - window.start - window.paused
        if seconds <= 0 or window.flops <= 0:
            return  # a clock that did not advance: nothing to divide by
        choice = self.peak(trainer.precision_plugin)
        self._check_peak(choice)
        achieved, utilisation = mfu(window.flops / window.steps, seconds / window.steps, choice.tflops)
        step = batches_that_stepped(trainer)
        self.windows.append(MFUWindow(step, window.start, end, window.paused, window.steps, window.batches,
                                      window.flops, choice, achieved, utilisation))
        metrics = {"precision/achieved_tflops": achieved}
        if utilisation is not None:
            metrics["precision/mfu"] = utilisation
        if choice.tflops is not None and choice.tflops != self._logged_peak:
            metrics["precision/peak_tflops"] = choice.tflops
            self._logged_peak = choice.tflops
        self.last_metrics = metrics
        # Straight to the loggers, which write on rank zero only: this cadence may not be the Trainer's, and each
        # rank's value is its own device's (no reduction, no `sync_dist`).
        publish_metrics(trainer, metrics, step)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = self._open
        if window is not None and not trainer.sanity_checking:
            _synchronize(self._device)  # training's queued work is the window's, not validation's
            window.pause_start = perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = self._open
        if window is not None and window.pause_start is not None:
            _synchronize(self._device)
            window.paused += perf_counter() - window.pause_start
            window.pause_start = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open = None  # steps after the last logging step are not a whole window
