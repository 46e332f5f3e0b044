"""AmaxHistoryLogger: the amax history and scales of fp8 delayed scaling, recorded and made visible.

The callback is the Trainer glue, the window (the ring of amaxes in the accumulator, and the scale it gives) and the
order of the work; the work is in the private modules beside it: the argument checks (``_amax.checks``), the layers'
hooks (``_amax.hooks``) recording each step (``_amax.extremes``), Transformer Engine's own state (``_amax.te``), the
logged keys (``_amax.report``) and the what-if statistics (``lightning_precision._amax_stats``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_precision._amax_stats import block_sample, what_if
from lightning_precision._core.accumulator import Accumulator, Reduce, all_reduce, as_reduce_op
from lightning_precision._core.fsdp import is_sharded
from lightning_precision._io import check_writable_dir
from lightning_precision._launches import ops_are_cheap
from lightning_precision._upstream.lightning import batches_that_stepped, publish_metrics
from lightning_precision.callbacks._amax.checks import check_window, what_if_formats
from lightning_precision.callbacks._amax.extremes import StepExtremes
from lightning_precision.callbacks._amax.hooks import LayerHooks, linear_layers
from lightning_precision.callbacks._amax.report import layer_metrics
from lightning_precision.callbacks._amax.te import write_te_history
from lightning_precision.callbacks._cadence import on_cadence, set_cadence
from lightning_precision.callbacks._publish import read_metrics
from lightning_precision.formats import FORMATS
from lightning_precision.fp8._selection import HYBRID_FORMAT, TENSORS
from lightning_precision.functional import delayed_scale

__all__ = ["AmaxHistoryLogger", "block_sample"]

_FP8_MAX = torch.tensor([FORMATS[HYBRID_FORMAT[t]].max for t in TENSORS])


class AmaxHistoryLogger(Callback):
    """Records, every step, the amax of each linear-like layer's input, weight and output gradient into an on-device
    ring buffer of ``history_len`` steps with the roll semantics of Transformer Engine's delayed scaling, and the scale
    that delayed scaling would use: ``fp8_max / amax / 2**margin``.

    torchao keeps no amax history (it rescales every call from the current amax), and a bf16 model has none: this
    callback records it for both, so it is also an fp8-readiness report. With Transformer Engine's delayed scaling it
    reads TE's own ``fp8_meta`` history and scales instead.

    At the logging cadence it writes to the Trainer's loggers (and ``last_metrics``)
    ``precision/amax/<tensor>/<layer>``, ``precision/fp8_scale/<tensor>/<layer>`` and, with ``what_if=True``, the
    underflow and overflow fractions of each tensor cast to fp8 (e4m3fn for input and weight, e5m2 for gradients) with
    the delayed scale versus the current (just-in-time) scale:
    ``precision/fp8_whatif/<tensor>/<delayed|current>/<underflow|overflow>``, and of the same tensors cast to each
    block-scaled format in ``block_formats`` (each block at its own scale, NVFP4's tensor scale from the tensor's amax):
    ``precision/fp8_whatif/<tensor>/<mxfp8|nvfp4>/<underflow|overflow>``. Nothing is read from the device on other
    steps. Layers whose forward never ran (``nn.MultiheadAttention.out_proj``, whose weight the attention uses directly,
    or a layer the model skips) are left out of the logs and the plot: they have no amax.

    Args:
        history_len: steps in the window (TE's ``amax_history_len``; TE defaults to 1024), at most 65536.
        amax_compute_algo: ``"max"`` over the window or ``"most_recent"``.
        margin: TE's ``margin``, a whole number >= 0: the scale is divided by ``2**margin``.
        log_every_n_steps: ``None`` follows the Trainer.
        what_if: compute the delayed-versus-current cast statistics on logging steps.
        what_if_sample: compute them, per tensor kind (input, weight, gradient), on one sample of about this many
            elements shared by all layers in proportion to their sizes (evenly spaced runs of 32, block-aligned;
            deterministic); every element (exact) where a kind's tensors together hold at most this many; ``None``
            uses every element. At 2**16 a fraction p is estimated within about ``2 * sqrt(p / 65536)`` (the block
            formats, whose flushes depend on each block's max: ``2 * sqrt(p / 2048)``); measuring every layer whole
            would make the logging step cost several ordinary steps.
        block_formats: block-scaled formats the what-if also asks about (``"mxfp8"``, ``"mxfp8_floor"``,
            ``"nvfp4"``; ``()`` for none): would this run's tensors survive MXFP8 or NVFP4?
        save_dir: if set, ``amax_history.pt`` and ``amax_history.png`` are written there at the end of training (the
            folder is checked at setup, before any step).
    """

    MAX_HISTORY_LEN = 2**16
    log_every_n_steps: int | None  # set by `set_cadence`

    def __init__(
        self,
        history_len: int = 16,
        amax_compute_algo: str = "max",
        margin: int = 0,
        log_every_n_steps: int | None = None,
        what_if: bool = True,
        what_if_sample: int | None = 2**16,
        save_dir: str | None = None,
        block_formats: Sequence[str] = ("mxfp8", "nvfp4"),
    ) -> None:
        owner = "AmaxHistoryLogger"
        check_window(history_len, amax_compute_algo, margin, self.MAX_HISTORY_LEN)
        set_cadence(self, owner, log_every_n_steps=log_every_n_steps)
        block_names = what_if_formats(what_if, what_if_sample, block_formats, save_dir)
        self.history_len = history_len
        self.amax_compute_algo = amax_compute_algo
        self.margin = margin
        self.what_if = what_if
        self.what_if_sample = what_if_sample
        self.block_formats = block_names
        self.save_dir = save_dir
        self.layers: list[str] = []
        # Declared at `attach` (or restored), on the model's device:
        # - "ring": history_len rows [layers, 3], this process's own ("last": never combined). `_pos` is the slot of the
        #   step in progress, so the history in Transformer Engine's order (row 0 the step in progress, then the
        #   completed steps oldest first) is the ring rolled by -_pos. Writing a slot and moving `_pos` replaces TE's
        #   per-step roll, which allocates.
        # - "last_nonzero" [layers, 3]: the last non-zero amax of each entry. With it the delayed scale is computed only
        #   when read, and exactly: where the window saw nothing, TE keeps the scale of the last window that saw
        #   something, which is fp8_max / (that last non-zero amax) / 2**margin.
        # - "amax" [layers, 3]: the logged step's amax, the max across processes (TE's ``reduce_amax``).
        self.state = Accumulator()
        self._pos = 0
        self._stale_slot = False  # slot `_pos` still holds the oldest step of the window until this step writes it
        self._te_scale: dict[int, Tensor] = {}
        self.steps = 0
        self._modules: list[nn.Module] = []
        self._te_layers: list[int] = []
        self._last_whatif: dict[str, Tensor] = {}
        self._extremes = StepExtremes()  # this step's amaxes, until the flush writes them into the ring
        self._layer_hooks = LayerHooks(self._extremes, self._weight_sample)
        self._fp8_max = _FP8_MAX
        self._step_open = False  # Trainer: a batch began and its step has not ended (several optimizers end it once)
        self.last_metrics: dict[str, float] = {}

    @property
    def _ring(self) -> Tensor | None:
        return self.state["ring"] if "ring" in self.state else None

    @property
    def _last_nonzero(self) -> Tensor | None:
        return self.state["last_nonzero"] if "last_nonzero" in self.state else None

    def _declare(self, ring: Tensor, last_nonzero: Tensor) -> None:
        self.state.add_state("ring", ring, "last")
        self.state.add_state("last_nonzero", last_nonzero, "last")
        self.state.add_state("amax", torch.zeros_like(last_nonzero), "max")

    @property
    def history(self) -> Tensor | None:
        """``[history_len, layers, 3]`` in Transformer Engine's order: row 0 is the step in progress."""
        if self._ring is None:
            return None
        history = self._ring.roll(-self._pos, 0)
        if self._stale_slot:
            history[0] = 0
        return history

    @property
    def scale(self) -> Tensor | None:
        """``[layers, 3]``: the delayed scale in effect for the step in progress (TE's ``fp8_max / amax / 2**margin``
        over the window; where the window saw nothing, the scale from the last amax seen; 1 where none was)."""
        if self._ring is None or self._last_nonzero is None:
            return None
        last = delayed_scale(self._last_nonzero, self._fp8_max, self.margin)
        window = self._ring.amax(dim=0) if self.amax_compute_algo == "max" else self._last_nonzero
        scale = delayed_scale(window, self._fp8_max, self.margin, previous=last)
        for i, te_scale in self._te_scale.items():
            scale[i] = te_scale
        return scale

    # ---- the part Fabric and plain PyTorch use directly -------------------------------------------------------------

    def attach(self, model: nn.Module) -> None:
        """Hook every linear-like layer of ``model`` (after any fp8 conversion: converted layers are new modules)."""
        self.detach()
        found = linear_layers(model)
        names = [name for name, _ in found]
        # from the parameters, not `.weight`: a parametrized weight is computed at each read (see `_amax_hooks`)
        device = next((p.device for _, m in found for p in m.parameters()), torch.device("cpu"))
        if names != self.layers or self._ring is None or self._last_nonzero is None:
            self.layers = names
            self._declare(torch.zeros(self.history_len, len(names), 3, device=device),
                          torch.zeros(len(names), 3, device=device))
            self._pos, self._stale_slot = 0, False
        else:  # resumed: keep the restored state
            self._declare(self._ring.to(device, torch.float32), self._last_nonzero.to(device, torch.float32))
        self._modules = [m for _, m in found]
        self._te_layers = [i for i, m in enumerate(self._modules) if hasattr(m, "fp8_meta")]
        # On an accelerator the weights' amaxes are one `_foreach_norm` at the flush (a launch, not one a layer); where
        # ops are cheap (a CPU) one `aminmax` each before the layer's forward.
        fused, sharded = not ops_are_cheap(device), is_sharded(model)
        self._layer_hooks.attach(names, self._modules, device, fused, sharded)
        # Copied once: a per-step host-to-device copy would sync the stream.
        self._fp8_max = _FP8_MAX.to(device)

    def detach(self) -> None:
        self._layer_hooks.detach()

    def _weight_sample(self, values: Tensor) -> Tensor:
        return block_sample(values, self.what_if_sample)

    def capturing(self, on: bool) -> None:
        """Keep this step's tensors for the what-if statistics (only on logging steps: it holds activations)."""
        self._layer_hooks.capture = [{} for _ in self.layers] if on and self.what_if else None

    def end_step(self, log: bool = True, reduce_max: Reduce | None = None) -> dict[str, Tensor]:
        """End a step, after its backward and before its optimizer step (the what-if reads the weights the step used):
        with ``log``, the metrics (amax, delayed scale, what-if if capturing) as device tensors; then the history moves
        on. ``reduce_max`` takes the max across processes for the logged values, which the window
        then keeps in place of this process's own (as TE's ``reduce_amax``). On other steps: about ten small device
        ops whatever the number of layers (the ring write; on a GPU the weights' fused amax too), no host read."""
        if self._ring is None or self._last_nonzero is None:
            raise RuntimeError("AmaxHistoryLogger.end_step() before attach(model): attach the model first.")
        scale = self.scale if log else None  # in effect for this step: from the window before its amax is written
        self._extremes.flush(self.state["ring"][self._pos].view(-1), self.state["last_nonzero"].view(-1))
        self._stale_slot = False
        if self._te_layers:
            self._read_te_state()
            if scale is not None:  # TE's own scales are the ones in effect for its layers
                for i, te_scale in self._te_scale.items():
                    scale[i] = te_scale
        current = self._ring[self._pos]
        metrics = self._log(current, scale, reduce_max) if log and scale is not None else {}
        self._layer_hooks.capture = None
        self._pos = (self._pos + 1) % self.history_len
        self._stale_slot = True
        self.steps += 1
        return metrics

    def _log(self, current: Tensor, scale: Tensor, reduce_max: Reduce | None) -> dict[str, Tensor]:
        """The logged step's metrics from its amax ``current`` (its ring slot): each layer's amax (the max across
        processes, which the window keeps) and scale, and the what-if if capturing."""
        self.state.reset("amax")
        self.state.update("amax", current)
        logged = self.state.sync(as_reduce_op(reduce_max), ["amax"])["amax"]
        if reduce_max is not None:
            current.copy_(logged)  # the window holds the global amax: every rank's delayed scale is the same
        metrics = layer_metrics(self.layers, self._layer_hooks.ran, logged, scale)
        if self._layer_hooks.capture is not None:
            jit = delayed_scale(logged, self._fp8_max, self.margin)  # the current (just-in-time) scale: the step's amax
            self._last_whatif = what_if(self._layer_hooks.capture, logged, scale, jit, self.block_formats,
                                        self.what_if_sample)
            metrics.update(self._last_whatif)
        return metrics

    def _read_te_state(self) -> None:
        """With TE's delayed scaling, TE's own history and scales replace what the hooks measured."""
        for i in self._te_layers:
            te_scale = write_te_history(self._modules[i], self.state["ring"], i, self._pos, self.history_len)
            if te_scale is not None:
                self._te_scale[i] = te_scale
                self._layer_hooks.ran[i] = True

    def save(self, directory: str) -> tuple[str, str]:
        """Write ``amax_history.pt`` (layers, history oldest first, scales) and ``amax_history.png`` (layers that
        ran)."""
        from lightning_precision._plots import plot_amax_history

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        chronological, scale = self.chronological_history(), self.scale
        assert scale is not None  # there is a history
        torch.save(
            {"layers": self.layers, "tensors": TENSORS, "history": chronological.cpu(), "scale": scale.cpu(),
             "steps": self.steps, "what_if": {k: float(v) for k, v in self._last_whatif.items()},
             "ran": list(self._layer_hooks.ran)},
            out / "amax_history.pt",
        )
        ran = [i for i, r in enumerate(self._layer_hooks.ran) if r]
        png = plot_amax_history(chronological[:, ran], [self.layers[i] for i in ran], TENSORS, self._last_whatif,
                                str(out / "amax_history.png"))
        return str(out / "amax_history.pt"), png

    def chronological_history(self) -> Tensor:
        """The completed steps of the window, oldest first (after a step, row 0 is the cleared next step)."""
        history = self.history
        if history is None:
            raise RuntimeError("AmaxHistoryLogger has no history before attach(model).")
        filled = min(self.steps, self.history_len - 1)
        return history[self.history_len - filled :] if filled else history[:0]

    # ---- Trainer glue -----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.save_dir is not None and stage == "fit" and trainer.is_global_zero:
            check_writable_dir(self.save_dir, f"AmaxHistoryLogger(save_dir={self.save_dir!r})")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.attach(pl_module)  # after the strategy's setup: fp8 layers are already swapped in

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.capturing(on_cadence(trainer, self.log_every_n_steps))
        self._step_open = True

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self._step_open:  # the batch's second optimizer (manual optimization): its step is already ended
            return
        self._step_open = False
        log = on_cadence(trainer, self.log_every_n_steps)
        reduce_max = functools.partial(all_reduce, op="max") if log and trainer.world_size > 1 else None
        metrics = self.end_step(log, reduce_max)
        if log and metrics:
            # Straight to the loggers in one device read: per-layer keys are many, and `self.log` costs about a
            # millisecond per key on CPU (more than the statistics themselves).
            self.last_metrics = read_metrics(metrics)
            # at the step Lightning logs this batch's metrics (`global_step` counts every optimizer's steps)
            publish_metrics(trainer, self.last_metrics, batches_that_stepped(trainer))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.detach()  # no hook of a failed fit stays on the model

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.detach()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.detach()
        if self.save_dir is not None and trainer.is_global_zero:
            self.save(self.save_dir)

    @override
    def state_dict(self) -> dict[str, Any]:
        # The history as the ring holds it: between steps, row 0 is the window's oldest step, which the scale in
        # effect still counts until the next step overwrites it (`stale`). Saved zeroed, a restored logger computed its
        # next scale from one step less than the live one.
        ring, scale = self._ring, self.scale
        return {
            "layers": list(self.layers),
            "history": None if ring is None else ring.roll(-self._pos, 0).cpu(),
            "stale": self._stale_slot,
            "scale": None if scale is None else scale.cpu(),
            "last_nonzero": None if self._last_nonzero is None else self._last_nonzero.cpu(),
            "steps": self.steps,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.layers = list(state_dict["layers"])
        ring, last_nonzero = state_dict["history"], state_dict.get("last_nonzero")
        # Checkpoints without "stale" saved row 0 zeroed: nothing stale to count.
        self._pos, self._stale_slot, self.steps = 0, bool(state_dict.get("stale", False)), state_dict["steps"]
        self.state = Accumulator()
        if ring is not None:  # a checkpoint of 0.1 has no last_nonzero: the window's newest amax
            self._declare(ring, last_nonzero if last_nonzero is not None else ring.amax(dim=0))
