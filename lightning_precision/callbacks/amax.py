"""AmaxHistoryLogger: the amax history and scales of fp8 delayed scaling, recorded and made visible."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_precision.callbacks._cadence import check_every, on_cadence
from lightning_precision.formats import FORMATS
from lightning_precision.functional import delayed_scale, multi_format_stats, roll_amax_history

# The tensors of a linear layer that fp8 casts, and the format each is cast to (TE's HYBRID format).
TENSORS = ("input", "weight", "grad_output")
_FORMAT = {"input": "e4m3fn", "weight": "e4m3fn", "grad_output": "e5m2"}
_FP8_MAX = torch.tensor([FORMATS[_FORMAT[t]].max for t in TENSORS])


def strided_sample(t: Tensor, limit: Optional[int]) -> Tensor:
    """At most ``limit`` elements of ``t``, evenly strided (a view of a contiguous tensor: no copy, deterministic)."""
    flat = t.reshape(-1)
    if limit is None or flat.numel() <= limit:
        return flat
    return flat[:: -(-flat.numel() // limit)]


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` and its subclasses (torchao's ``Float8Linear``), and Transformer Engine modules (``fp8_meta``)."""
    return isinstance(module, nn.Linear) or (hasattr(module, "fp8_meta") and hasattr(module, "weight"))


def te_amax_history(module: nn.Module) -> Optional[tuple[Tensor, Tensor]]:
    """``(history [len, 3], scale [3])`` (input, weight, grad_output) from a Transformer Engine module's delayed
    scaling state: ``fp8_meta["scaling_fwd"]`` holds (input, weight, output) per GEMM, ``["scaling_bwd"]`` (grad_output,
    grad_input). None when the module keeps no amax (current scaling, MXFP8, block recipes)."""
    meta = getattr(module, "fp8_meta", None)
    if not isinstance(meta, dict) or "scaling_fwd" not in meta or "scaling_bwd" not in meta:
        return None
    fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
    if getattr(fwd, "amax_history", None) is None or getattr(bwd, "amax_history", None) is None:
        return None
    history = torch.stack([fwd.amax_history[:, 0], fwd.amax_history[:, 1], bwd.amax_history[:, 0]], dim=1)
    scale = torch.stack([fwd.scale[0], fwd.scale[1], bwd.scale[0]])
    return history, scale


class AmaxHistoryLogger(Callback):
    """Records, every step, the amax of each linear-like layer's input, weight and output gradient into an on-device
    ring buffer of ``history_len`` steps with the roll semantics of Transformer Engine's delayed scaling, and the scale
    that delayed scaling would use: ``fp8_max / amax / 2**margin``.

    torchao keeps no amax history (it rescales every call from the current amax), and a bf16 model has none: this
    callback records it for both, so it is also an fp8-readiness report. With Transformer Engine's delayed scaling it
    reads TE's own ``fp8_meta`` history and scales instead.

    At the logging cadence it writes to the Trainer's loggers (and ``last_metrics``) ``precision/amax/<tensor>/<layer>``, ``precision/fp8_scale/<tensor>/<layer>`` and,
    with ``what_if=True``, the underflow and overflow fractions of each tensor cast to fp8 (e4m3fn for input and weight,
    e5m2 for gradients) with the delayed scale versus the current (just-in-time) scale:
    ``precision/fp8_whatif/<tensor>/<delayed|current>/<underflow|overflow>``. Nothing is read from the device on other
    steps.

    Args:
        history_len: steps in the window (TE's ``amax_history_len``; TE defaults to 1024).
        amax_compute_algo: ``"max"`` over the window or ``"most_recent"``.
        margin: TE's ``margin``: the scale is divided by ``2**margin``.
        log_every_n_steps: ``None`` follows the Trainer.
        what_if: compute the delayed-versus-current cast statistics on logging steps.
        what_if_sample: compute them on an evenly strided sample of at most this many elements per tensor (a view:
            no copy); ``None`` uses every element. At 2**16 a fraction p is estimated within about
            ``2 * sqrt(p / 65536)``; whole weight matrices would make the logging step cost several ordinary steps.
        save_dir: if set, ``amax_history.pt`` and ``amax_history.png`` are written there at the end of training.
    """

    def __init__(
        self,
        history_len: int = 16,
        amax_compute_algo: str = "max",
        margin: int = 0,
        log_every_n_steps: Optional[int] = None,
        what_if: bool = True,
        what_if_sample: Optional[int] = 2**16,
        save_dir: Optional[str] = None,
    ) -> None:
        if not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"`AmaxHistoryLogger(history_len={history_len!r})`: a positive number of steps, e.g. 16.")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"`AmaxHistoryLogger(amax_compute_algo={amax_compute_algo!r})`: use 'max' or 'most_recent'.")
        check_every("AmaxHistoryLogger", "log_every_n_steps", log_every_n_steps)
        self.history_len = history_len
        self.amax_compute_algo = amax_compute_algo
        self.margin = margin
        self.log_every_n_steps = log_every_n_steps
        self.what_if = what_if
        self.what_if_sample = what_if_sample
        self.save_dir = save_dir
        self.layers: list[str] = []
        self.history: Optional[Tensor] = None  # [history_len, layers, 3]; row 0 is the step in progress
        self.scale: Optional[Tensor] = None  # [layers, 3]: the delayed scale in effect for the step in progress
        self.steps = 0
        self._modules: list[nn.Module] = []
        self._handles: list[Any] = []
        self._capture: Optional[list[dict[str, Tensor]]] = None
        self._last_whatif: dict[str, Tensor] = {}
        self._records: list[tuple[int, tuple[Tensor, Tensor]]] = []
        self._index_cache: dict[tuple[int, ...], Tensor] = {}
        self._fp8_max = _FP8_MAX
        self.last_metrics: dict[str, float] = {}
        self._weights_seen: set[int] = set()

    # ---- the part Fabric and plain PyTorch use directly -------------------------------------------------------------

    def attach(self, model: nn.Module) -> None:
        """Hook every linear-like layer of ``model`` (after any fp8 conversion: converted layers are new modules)."""
        self.detach()
        found = [(name, m) for name, m in model.named_modules() if is_linear_like(m)]
        names = [name for name, _ in found]
        device = next(model.parameters()).device
        if names != self.layers or self.history is None:
            self.layers = names
            self.history = torch.zeros(self.history_len, len(names), 3, device=device)
            self.scale = torch.ones(len(names), 3, device=device)
        else:  # resumed: keep the restored state
            self.history, self.scale = self.history.to(device), self.scale.to(device)
        self._modules = [m for _, m in found]
        self._index_cache.clear()
        self._fp8_max = _FP8_MAX.to(device)  # copied once: a per-step host-to-device copy would sync the stream
        for i, (_, module) in enumerate(found):
            self._handles.append(module.register_forward_pre_hook(self._input_hook(i)))
            self._handles.append(module.register_forward_hook(self._output_hook(i)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def capturing(self, on: bool) -> None:
        """Keep this step's tensors for the what-if statistics (only on logging steps: it holds activations)."""
        self._capture = [{} for _ in self.layers] if on and self.what_if else None

    def step(self, log: bool = True, reduce_max: Any = None) -> dict[str, Tensor]:
        """End a step: with ``log``, the metrics (amax, delayed scale, what-if if capturing) as device tensors; then
        the delayed scale is updated and the history rolled. ``reduce_max`` takes the max across processes for the
        logged values (as TE's ``reduce_amax``)."""
        assert self.history is not None and self.scale is not None, "attach(model) first"
        self._flush()
        self._read_te_state()
        metrics: dict[str, Tensor] = {}
        if log:
            current = self.history[0] if reduce_max is None else reduce_max(self.history[0])
            amax, scale = current.unbind(0), self.scale.unbind(0)  # one split each, not an indexing op per key
            for i, layer in enumerate(self.layers):
                for k, tensor in enumerate(TENSORS):
                    metrics[f"precision/amax/{tensor}/{layer}"] = amax[i][k]
                    metrics[f"precision/fp8_scale/{tensor}/{layer}"] = scale[i][k]
            if self._capture is not None:
                metrics.update(self._what_if(current))
        self._capture = None
        self.history, amax_window = roll_amax_history(self.history, self.amax_compute_algo)
        self.scale = delayed_scale(amax_window, self._fp8_max, self.margin, previous=self.scale)
        self.steps += 1
        return metrics

    def _what_if(self, current: Tensor) -> dict[str, Tensor]:
        """Underflow/overflow fractions of this step's tensors cast with the delayed scale vs the current one."""
        jit = delayed_scale(current, self._fp8_max, self.margin)  # the current (just-in-time) scale: this step's amax
        totals: dict[str, Any] = {}
        for i, captured in enumerate(self._capture or []):
            for k, tensor in enumerate(TENSORS):
                if tensor not in captured:
                    continue
                fmt = _FORMAT[tensor]
                sample = strided_sample(captured[tensor], self.what_if_sample)
                for kind, scale in (("delayed", self.scale[i, k]), ("current", jit[i, k])):
                    stats = multi_format_stats(sample, (fmt,), scale)[FORMATS[fmt].name]
                    key = (tensor, kind)
                    totals[key] = stats if key not in totals else totals[key] + stats
        out = {}
        for (tensor, kind), s in totals.items():
            out[f"precision/fp8_whatif/{tensor}/{kind}/underflow"] = s.underflow_fraction
            out[f"precision/fp8_whatif/{tensor}/{kind}/overflow"] = s.overflow_fraction
        self._last_whatif = out
        return out

    def _read_te_state(self) -> None:
        """With TE's delayed scaling, TE's own history and scales replace what the hooks measured."""
        for i, module in enumerate(self._modules):
            te_state = te_amax_history(module)
            if te_state is None:
                continue
            history, scale = te_state
            n = min(self.history_len, history.shape[0])
            self.history[:n, i] = history[:n].to(self.history)
            self.scale[i] = scale.to(self.scale)

    def _record(self, i: int, k: int, t: Tensor) -> None:
        # One fused reduction per tensor, gathered into the history once per step (see _flush): small per-element ops
        # on a device tensor cost more than the reduction itself on small layers.
        # One pass, no |t| temporary (vector_norm(inf) is 10x slower on CPU); combined into amax once per step.
        self._records.append((i * 3 + k, torch.aminmax(t.detach())))

    def _flush(self) -> None:
        """Write this step's recorded amaxes into row 0 (max over repeated calls: accumulation, re-used layers)."""
        if not self._records:
            return
        key = tuple(j for j, _ in self._records)
        index = self._index_cache.get(key)
        if index is None:  # a host-to-device copy from pageable memory syncs the stream: once per pattern, not per step
            index = self._index_cache[key] = torch.tensor(key, device=self.history.device)
        low = torch.stack([lo for _, (lo, _) in self._records]).float()
        high = torch.stack([hi for _, (_, hi) in self._records]).float()
        values = torch.maximum(high, low.neg()).to(self.history.device)
        row = self.history[0].reshape(-1)
        self.history[0] = row.scatter_reduce(0, index, values, reduce="amax").view_as(self.history[0])
        self._records.clear()
        self._weights_seen.clear()

    def _input_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            if not torch.is_grad_enabled() or not module.training:  # training steps only
                return
            x = args[0] if args and isinstance(args[0], Tensor) else None
            if x is not None:
                self._record(i, 0, x)
            if i not in self._weights_seen:  # the weight changes only at the optimizer step
                self._weights_seen.add(i)
                self._record(i, 1, module.weight)
            if self._capture is not None:
                if x is not None:
                    self._capture[i]["input"] = x.detach()
                self._capture[i]["weight"] = module.weight.detach()

        return hook

    def _output_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(lambda g: self._grad(i, g))

        return hook

    def _grad(self, i: int, g: Tensor) -> None:
        self._record(i, 2, g)
        if self._capture is not None:
            self._capture[i]["grad_output"] = g.detach()

    def save(self, directory: str) -> tuple[str, str]:
        """Write ``amax_history.pt`` (layers, history oldest first, scales) and ``amax_history.png``."""
        from lightning_precision.plotting import plot_amax_history

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        chronological = self.chronological_history()
        torch.save(
            {"layers": self.layers, "tensors": TENSORS, "history": chronological.cpu(), "scale": self.scale.cpu(),
             "steps": self.steps, "what_if": {k: float(v) for k, v in self._last_whatif.items()}},
            out / "amax_history.pt",
        )
        png = plot_amax_history(chronological, self.layers, TENSORS, self._last_whatif, str(out / "amax_history.png"))
        return str(out / "amax_history.pt"), png

    def chronological_history(self) -> Tensor:
        """The completed steps of the window, oldest first (after a step, row 0 is the cleared next step)."""
        assert self.history is not None
        filled = min(self.steps, self.history_len - 1)
        return self.history[self.history_len - filled :] if filled else self.history[:0]

    # ---- Trainer glue -----------------------------------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.attach(pl_module)  # after the strategy's setup: fp8 layers are already swapped in

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.capturing(on_cadence(trainer, self.log_every_n_steps))

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        log = on_cadence(trainer, self.log_every_n_steps)
        reduce_max = (lambda t: trainer.strategy.reduce(t, reduce_op="max")) if log and trainer.world_size > 1 else None
        metrics = self.step(log, reduce_max)
        if log and metrics:
            # Straight to the loggers in one device read: per-layer keys are many, and `self.log` costs about a
            # millisecond per key on CPU (more than the statistics themselves).
            values = torch.stack([v.float() for v in metrics.values()]).tolist()
            self.last_metrics = dict(zip(metrics, values))
            for logger in trainer.loggers:
                logger.log_metrics(self.last_metrics, step=trainer.global_step)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.detach()
        if self.save_dir is not None and trainer.is_global_zero:
            self.save(self.save_dir)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "history": None if self.history is None else self.history.cpu(),
            "scale": None if self.scale is None else self.scale.cpu(),
            "steps": self.steps,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.layers = list(state_dict["layers"])
        self.history, self.scale, self.steps = state_dict["history"], state_dict["scale"], state_dict["steps"]
