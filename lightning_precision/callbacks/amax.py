"""AmaxHistoryLogger: the amax history and scales of fp8 delayed scaling, recorded and made visible."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.nn.utils.parametrize import is_parametrized
from typing_extensions import override

from lightning_precision._amax_stats import block_sample, pooled_stats, shared_sample
from lightning_precision._checks import is_positive_int
from lightning_precision._core.accumulator import Accumulator, Reduce, all_reduce, as_reduce_op
from lightning_precision._core.fsdp import is_sharded
from lightning_precision._core.probe_pass import in_probe_pass
from lightning_precision._io import check_writable_dir
from lightning_precision._launches import ops_are_cheap
from lightning_precision._upstream.lightning import batches_that_stepped, publish_metrics
from lightning_precision._upstream.torch import CUDA_KERNEL_DTYPES, foreach_copy_, foreach_norm
from lightning_precision._warnings import NoEffectWarning, warn
from lightning_precision.callbacks._cadence import on_cadence, set_cadence
from lightning_precision.formats import BLOCK_FORMATS, FORMATS, BlockFormat, get_format
from lightning_precision.fp8._selection import HYBRID_FORMAT, TENSORS, functional_linears
from lightning_precision.functional import (
    CastStats,
    delayed_scale,
    multi_format_stats,
    multi_scale_stats,
)

__all__ = ["AmaxHistoryLogger", "block_sample"]

# The weight dtypes whose amax the flush takes in one `_foreach_norm` (those its CUDA kernel takes).
_NORM_DTYPES = CUDA_KERNEL_DTYPES["_foreach_norm"][0]
# The dtypes whose first call of a step writes its extremes into a preallocated table (`_record`).
_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_MAX = torch.tensor([FORMATS[HYBRID_FORMAT[t]].max for t in TENSORS])


def _write_plan(key: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor | None]:
    """For a step's records (entry of each, in order): the distinct entries, and where an entry was recorded more than
    once, a gather [entries, most calls] of record positions (padded with the position past the end, a zero) whose
    row max is the entry's amax."""
    entries = list(dict.fromkeys(key))
    if len(entries) == len(key):
        return torch.tensor(entries, device=device), None
    positions: dict[int, list[int]] = {e: [] for e in entries}
    for r, e in enumerate(key):
        positions[e].append(r)
    width = max(len(p) for p in positions.values())
    gather = [positions[e] + [len(key)] * (width - len(positions[e])) for e in entries]
    return torch.tensor(entries, device=device), torch.tensor(gather, device=device)


def _block_format(name: str) -> object:
    try:
        return get_format(name)
    except ValueError:
        return None


def _sum(stats: Iterable[CastStats]) -> CastStats:
    total, *rest = stats
    for s in rest:
        total = total + s
    return total


def _values(weight: Any) -> Tensor:
    """A weight as numbers. Under FSDP2 with torchao's float8 all-gather, a layer's forward sees its weight already
    gathered in fp8 (a ``Float8TrainingTensor``, which has no reductions): its values are the fp8 data times the scale,
    whose amax is the full weight's amax (the scale maps it to the format's max, which fp8 holds exactly)."""
    to_values = getattr(weight, "to_original_precision", None)
    return to_values() if callable(to_values) else weight


def _is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` and its subclasses (torchao's ``Float8Linear``), and Transformer Engine modules (``fp8_meta``)."""
    return isinstance(module, nn.Linear) or (hasattr(module, "fp8_meta") and hasattr(module, "weight"))


def _te_amax_history(module: nn.Module) -> tuple[Tensor, Tensor] | None:
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
        if not is_positive_int(history_len) or history_len > self.MAX_HISTORY_LEN:
            raise ValueError(f"`{owner}(history_len={history_len!r})`: a number of steps from 1 to"
                             f" {self.MAX_HISTORY_LEN}, e.g. 16 (Transformer Engine's default is 1024).")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"`{owner}(amax_compute_algo={amax_compute_algo!r})`: use 'max' or 'most_recent'.")
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"`{owner}(margin={margin!r})`: Transformer Engine's margin, a whole number of powers of"
                             " two >= 0, e.g. 0.")
        set_cadence(self, owner, log_every_n_steps=log_every_n_steps)
        if not isinstance(what_if, bool):
            raise ValueError(f"`{owner}(what_if={what_if!r})`: pass True or False.")
        if what_if_sample is not None and not is_positive_int(what_if_sample):
            raise ValueError(f"`{owner}(what_if_sample={what_if_sample!r})`: a positive number of elements, e.g. 65536,"
                             " or None for all.")
        if isinstance(block_formats, str) or not all(
                isinstance(f, str) and isinstance(_block_format(f), BlockFormat) for f in block_formats):
            raise ValueError(f"`{owner}(block_formats={block_formats!r})`: a tuple of block-scaled formats from"
                             f" {tuple(BLOCK_FORMATS)}, or ().")
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            raise ValueError(f"`{owner}(save_dir={save_dir!r})`: a folder path, or None.")
        self.history_len = history_len
        self.amax_compute_algo = amax_compute_algo
        self.margin = margin
        self.what_if = what_if
        self.what_if_sample = what_if_sample
        self.block_formats = tuple(get_format(f).name for f in block_formats)
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
        self._handles: list[Any] = []
        # per layer and tensor kind: (the tensor, or under FSDP a copy of its sample; its real number of elements)
        self._capture: list[dict[str, tuple[Tensor, int]]] | None = None
        self._last_whatif: dict[str, Tensor] = {}
        self._copy_weights = False
        # This step's extremes: a tensor's first call of the step writes (min, max) straight into a preallocated row per
        # entry of its dtype's table (fp32, bf16, fp16); repeated calls, float64 and subclasses go to `_records`. See
        # `_record`. `_extremes` is the fp32 table, which the flush reduces into the ring.
        self._extremes = torch.zeros(0, 2)
        self._tables: dict[torch.dtype, tuple[Tensor, list[tuple[Tensor, Tensor]]]] = {}
        self._written: dict[torch.dtype, set[int]] = {}
        self._records: list[tuple[int, tuple[Tensor, Tensor]]] = []
        self._index_cache: dict[tuple[int, ...], tuple[Tensor, Tensor | None]] = {}
        self._fp8_max = _FP8_MAX
        self._parametrized: set[int] = set()
        self._step_open = False  # Trainer: a batch began and its step has not ended (several optimizers end it once)
        self._device = torch.device("cpu")
        self._fused_weights = False
        self.last_metrics: dict[str, float] = {}
        self._weights_seen: set[int] = set()
        # Layers whose plain weight ran this step: their amaxes are taken together at the flush (`_record_weights`).
        self._weights_ran: dict[int, None] = {}
        self._ran: list[bool] = []

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
        functional = functional_linears(model)
        found = [(name, m) for name, m in model.named_modules() if _is_linear_like(m) and id(m) not in functional]
        names = [name for name, _ in found]
        # from the parameters, not `.weight`: a parametrized weight is computed at each read (see `_parametrized`)
        device = next((p.device for _, m in found for p in m.parameters()), torch.device("cpu"))
        if names != self.layers or self._ring is None or self._last_nonzero is None:
            self.layers = names
            self._declare(torch.zeros(self.history_len, len(names), 3, device=device),
                          torch.zeros(len(names), 3, device=device))
            self._pos, self._stale_slot = 0, False
        else:  # resumed: keep the restored state
            self._declare(self._ring.to(device, torch.float32), self._last_nonzero.to(device, torch.float32))
        self._modules = [m for _, m in found]
        # FSDP2 frees a gathered weight's storage after the forward: the what-if keeps a copy of its sample instead.
        self._copy_weights = is_sharded(model)
        self._te_layers = [i for i, m in enumerate(self._modules) if hasattr(m, "fp8_meta")]
        # A parametrized weight (spectral_norm, weight_norm, orthogonal) is computed anew at each read, and
        # spectral_norm's read runs a power iteration in training mode: reading it would change the training.
        self._parametrized = {i for i, m in enumerate(self._modules) if is_parametrized(m, "weight")}
        if self._parametrized:
            warn("AmaxHistoryLogger: the weights of " + ", ".join(names[i] for i in sorted(self._parametrized))
                 + " are parametrized (`torch.nn.utils.parametrize`: spectral_norm, weight_norm, ...); reading one"
                 " computes it again (spectral_norm's power iteration would change your training), so their weight"
                 " amax is not recorded (0 in the history, no `fp8_scale` for it); inputs and gradients are.",
                 NoEffectWarning)
        self._ran = [False] * len(found)
        # Nothing of a step that did not end (an exception, a fit stopped between forward and step) carries over.
        self._weights_seen.clear()
        self._records.clear()
        self._capture = None
        self._index_cache.clear()
        self._device = device
        # On an accelerator the weights' amaxes are one `_foreach_norm` at the flush (a launch, not one a layer); where
        # ops are cheap (a CPU) one `aminmax` each before the layer's forward (see the hooks below).
        self._fused_weights = not ops_are_cheap(device)
        self._tables = {dtype: self._table(len(names) * 3, dtype, device) for dtype in _TABLE_DTYPES}
        self._extremes = self._tables[torch.float32][0]
        self._written = {dtype: set() for dtype in _TABLE_DTYPES}
        self._weights_ran.clear()
        # Copied once: a per-step host-to-device copy would sync the stream.
        self._fp8_max = _FP8_MAX.to(device)
        # Input and weight before the forward where ops are cheap (a CPU: the forward then finds them in cache; after
        # it, a 16 x 512 x 512 MLP's reads cost 1 ms a step more) or the weight is gathered only then (FSDP2, whose
        # post-forward hook frees it before a forward hook of ours runs); elsewhere (a GPU) in the one forward hook a
        # layer, which also hooks the output's gradient.
        early = not self._fused_weights or self._copy_weights
        for i, (_, module) in enumerate(found):
            if early:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(i)))
            self._handles.append(module.register_forward_hook(self._layer_hook(i, inputs=not early)))

    @staticmethod
    def _table(entries: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        table = torch.zeros(entries, 2, dtype=dtype, device=device)
        return table, [(row[0], row[1]) for row in table]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def capturing(self, on: bool) -> None:
        """Keep this step's tensors for the what-if statistics (only on logging steps: it holds activations)."""
        self._capture = [{} for _ in self.layers] if on and self.what_if else None

    def end_step(self, log: bool = True, reduce_max: Reduce | None = None) -> dict[str, Tensor]:
        """End a step, after its backward and before its optimizer step (the what-if reads the weights the step used):
        with ``log``, the metrics (amax, delayed scale, what-if if capturing) as device tensors; then the history moves
        on. ``reduce_max`` takes the max across processes for the logged values, which the window
        then keeps in place of this process's own (as TE's ``reduce_amax``). On other steps: about ten small device
        ops whatever the number of layers (the ring write; on a GPU the weights' fused amax too), no host read."""
        if self._ring is None or self._last_nonzero is None:
            raise RuntimeError("AmaxHistoryLogger.end_step() before attach(model): attach the model first.")
        scale = self.scale if log else None  # in effect for this step: from the window before its amax is written
        self._flush()
        if self._te_layers:
            self._read_te_state()
            if scale is not None:  # TE's own scales are the ones in effect for its layers
                for i, te_scale in self._te_scale.items():
                    scale[i] = te_scale
        current = self._ring[self._pos]
        metrics: dict[str, Tensor] = {}
        if log and scale is not None:
            self.state.reset("amax")
            self.state.update("amax", current)
            logged = self.state.sync(as_reduce_op(reduce_max), ["amax"])["amax"]
            if reduce_max is not None:
                current.copy_(logged)  # the window holds the global amax: every rank's delayed scale is the same
            amax, scales = logged.unbind(0), scale.unbind(0)  # one split each, not an indexing op per key
            for i, layer in enumerate(self.layers):
                if not self._ran[i]:
                    continue  # never ran: it has no amax to report
                for k, tensor in enumerate(TENSORS):
                    metrics[f"precision/amax/{tensor}/{layer}"] = amax[i][k]
                    metrics[f"precision/fp8_scale/{tensor}/{layer}"] = scales[i][k]
            if self._capture is not None:
                metrics.update(self._what_if(logged, scale))
        self._capture = None
        self._pos = (self._pos + 1) % self.history_len
        self._stale_slot = True
        self.steps += 1
        return metrics

    def _what_if(self, current: Tensor, delayed: Tensor) -> dict[str, Tensor]:
        """Underflow/overflow fractions of this step's tensors cast with the delayed scale vs the current one, and in
        each block format. Per tensor kind, one sample shared by all layers (``shared_sample``: every element when
        they fit in ``what_if_sample``), measured in one pass, each element at its layer's scale."""
        jit = delayed_scale(current, self._fp8_max, self.margin)  # the current (just-in-time) scale: this step's amax
        blocks = [get_format(f) for f in self.block_formats]
        out = {}
        for k, tensor in enumerate(TENSORS):
            captured = [(i, c[tensor]) for i, c in enumerate(self._capture or []) if tensor in c]
            if not captured:
                continue
            rows = [i for i, _ in captured]
            parts = shared_sample([t for _, (t, _) in captured], [n for _, (_, n) in captured], self.what_if_sample)
            index = torch.tensor(rows, device=current.device)
            pooled = pooled_stats(parts, HYBRID_FORMAT[tensor], [delayed[index, k], jit[index, k]],
                                  [b for b in blocks if isinstance(b, BlockFormat)], current[index, k])
            if pooled is None:  # float64 tensors: per layer
                per_layer = [dict(zip(("delayed", "current"), multi_scale_stats(
                    part.float(), HYBRID_FORMAT[tensor], [delayed[i, k], jit[i, k]]), strict=True)) |
                    multi_format_stats(part, self.block_formats, tensor_amax=current[i, k])
                    for i, part in zip(rows, parts, strict=True)]
                per_kind = {kind: _sum(layer[kind] for layer in per_layer) for kind in per_layer[0]}
            else:
                per_kind = {"delayed": pooled["0"], "current": pooled["1"]}
                per_kind.update({f: pooled[f] for f in self.block_formats})
            for kind, stats in per_kind.items():
                out[f"precision/fp8_whatif/{tensor}/{kind}/underflow"] = stats.underflow_fraction
                out[f"precision/fp8_whatif/{tensor}/{kind}/overflow"] = stats.overflow_fraction
        self._last_whatif = out
        return out

    def _read_te_state(self) -> None:
        """With TE's delayed scaling, TE's own history and scales replace what the hooks measured."""
        for i in self._te_layers:
            te_state = _te_amax_history(self._modules[i])
            if te_state is None:
                continue
            history, scale = te_state
            ring = self.state["ring"]
            n = min(self.history_len, history.shape[0])
            rows = history[:n].to(ring)
            # TE's row r is our ring slot (_pos + r) % history_len: two slices, no index tensor (which would be a
            # host-to-device copy every step)
            head = min(n, self.history_len - self._pos)
            ring[self._pos : self._pos + head, i] = rows[:head]
            ring[: n - head, i] = rows[head:]
            self._te_scale[i] = scale.to(ring)
            self._ran[i] = True

    def _record(self, i: int, k: int, t: Tensor) -> None:
        # One reduction per tensor, one pass with no |t| temporary (abs().amax() writes |t| first; vector_norm(inf) is
        # 10x slower on CPU), combined into the history once per step (see _flush). An fp32 tensor's first call in the
        # step writes its extremes into this step's preallocated row: no allocation, nothing to gather at the flush.
        # The caller turns gradients off (once a hook, not once a tensor: the context costs microseconds on a CPU),
        # rather than `t.detach()`: a detach is an aten op per tensor.
        j = i * 3 + k
        written = self._written.get(t.dtype)
        if written is not None and j not in written and type(t) in (Tensor, nn.Parameter) and t.device == self._device:
            written.add(j)
            torch.aminmax(t, out=self._tables[t.dtype][1][j])
        else:  # float64, a subclass, or a repeated call (accumulation, a re-used layer)
            self._records.append((j, torch.aminmax(t)))

    def _record_weights(self) -> None:
        """On an accelerator, the amax of every plain weight that ran this step, taken at the flush (weights change
        only at the optimizer step, after it): one ``_foreach_norm(inf)`` for all layers written into their rows by
        one copy, not a reduction per layer."""
        if not self._weights_ran:
            return
        layers = list(self._weights_ran)
        self._weights_ran.clear()
        weights: list[Tensor] = [cast(Tensor, self._modules[i].weight) for i in layers]  # plain: `_weight`
        with torch.no_grad():
            amaxes = foreach_norm(weights, math.inf)
        rows = self._tables[torch.float32][1]
        foreach_copy_([rows[i * 3 + 1][1] for i in layers], amaxes)
        self._written[torch.float32].update(i * 3 + 1 for i in layers)

    def _flush(self) -> None:
        """Write this step's recorded amaxes into its ring slot (max over repeated calls: accumulation, re-used
        layers), in place, and remember each entry's last non-zero amax. An ordinary step: about ten small ops, two
        more for each other dtype whose table was written, whatever the number of layers (each distinct op costs tens
        of microseconds on a CPU right after a backward, whose matrix products have evicted the caches)."""
        self._record_weights()
        slot = self.state["ring"][self._pos].view(-1)
        # Every entry: the tables' rows (zero where nothing was written) replace the slot's stale values; the other
        # dtypes' tables join the fp32 one where they were written (widening to fp32 is exact; nan propagates).
        extremes = self._extremes.abs_()
        for dtype, (table, _) in self._tables.items():
            if dtype != torch.float32 and self._written[dtype]:
                torch.maximum(extremes, table.abs(), out=extremes)
                table.zero_()
                self._written[dtype].clear()
        torch.amax(extremes, dim=1, out=slot)
        self._stale_slot = False
        extremes.zero_()
        self._written[torch.float32].clear()
        if self._records:
            key = tuple(j for j, _ in self._records)
            plan = self._index_cache.get(key)
            if plan is None:  # a host-to-device copy from pageable memory syncs the stream: once per pattern
                plan = self._index_cache[key] = _write_plan(key, slot.device)
            entries, gather = plan
            extremes = torch.stack([v for _, pair in self._records for v in pair]).view(-1, 2)
            amax = extremes.abs().amax(dim=1).to(slot)
            if gather is not None:  # an entry recorded more than once: the max of its calls
                amax = torch.cat([amax, amax.new_zeros(1)])[gather].amax(dim=1)
            slot.index_copy_(0, entries, torch.maximum(slot.index_select(0, entries), amax))
            self._records.clear()
        last = self.state["last_nonzero"].view(-1)
        torch.where(slot > 0, slot, last, out=last)
        self._weights_seen.clear()

    @staticmethod
    def _training_call(module: nn.Module) -> bool:
        """A training forward of the step: not evaluation, not another part's pass beside the step (`_probe_pass`)."""
        return torch.is_grad_enabled() and module.training and not in_probe_pass()

    def _pre_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            if self._training_call(module):
                self._inputs(i, module, args)

        return hook

    def _layer_hook(self, i: int, inputs: bool) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._training_call(module):
                return
            if inputs:
                self._inputs(i, module, args)
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(functools.partial(self._grad, i))

        return hook

    def _inputs(self, i: int, module: nn.Module, args: tuple) -> None:
        """A training call's input and weight."""
        self._ran[i] = True
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if x is not None and x.numel() == 0:
            x = None  # no tokens reached it this call (an idle expert): its weight is still recorded
        with torch.no_grad():
            if x is not None:
                self._record(i, 0, x)
            self._weight(i, module)
        if self._capture is not None and x is not None:
            self._capture[i]["input"] = (x.detach(), x.numel())

    def _weight(self, i: int, module: nn.Module) -> None:
        if i in self._parametrized:
            return  # not read: see `attach`
        weight = module.weight
        if self._fused_weights and not self._copy_weights and type(weight) in (Tensor, nn.Parameter) and \
                weight.dtype in _NORM_DTYPES and weight.device == self._device:
            self._weights_ran[i] = None  # measured with the others at the flush
        elif i not in self._weights_seen:  # the weight changes only at the optimizer step
            self._weights_seen.add(i)
            self._record(i, 1, _values(weight))
        if self._capture is not None:
            values = _values(weight).detach()
            self._capture[i]["weight"] = (block_sample(values, self.what_if_sample).clone() if self._copy_weights
                                          else values, values.numel())

    def _grad(self, i: int, g: Tensor) -> None:
        if g.numel() == 0 or in_probe_pass():  # no tokens; or another's pass through this step's graph
            return
        if self._weights_ran:  # inside the backward, before any optimizer step: the weights the forward used
            self._record_weights()
        if torch.is_grad_enabled():  # a backward with create_graph=True
            with torch.no_grad():
                self._record(i, 2, g)
        else:
            self._record(i, 2, g)
        if self._capture is not None:
            self._capture[i]["grad_output"] = (g.detach(), g.numel())

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
             "ran": list(self._ran)},
            out / "amax_history.pt",
        )
        ran = [i for i, r in enumerate(self._ran) if r]
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
            values = torch.stack([v.float() for v in metrics.values()]).tolist()
            self.last_metrics = dict(zip(metrics, values, strict=True))
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
