"""How much each linear layer would lose in fp8 (or another low-precision format), measured on real batches: the
numbers a ``PrecisionPlan`` decides on.

For every linear layer and each tensor the format casts (input, weight, output gradient), under the format's real
scaling: the signal-to-quantization-noise ratio of the cast, and the fractions that underflow (non-zero values cast to
zero) or overflow (non-finite values: dynamic scales never saturate finite ones). Then the error of the layer's output
and input gradient when that layer alone runs in the format, against fp32 results. How each format is computed (an
"emulator" per format; any device): torchao's per-tensor and per-row recipes through its own ``Float8Linear``
(emulated); the block formats (MXFP8, NVFP4) with the block casts of ``lightning_precision.formats``, each block at its
own scale; Transformer Engine's ``Float8BlockScaling`` with its 1x128 / 128x128 blocks (``CANDIDATE_CASTS``).

``SensitivityProbe`` (one format) and ``MultiProbe`` (several, in one pass) are the one place that measures:
``fp8_sensitivity`` and ``measure_candidates`` (before training, weights untouched), ``FP8Precision(layers="auto")``
(the first training steps) and ``FP8Guard`` use them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_precision._core.accumulator import Accumulator, Reduce, as_reduce_op
from lightning_precision._core.probe_pass import in_probe_pass
from lightning_precision._upstream.torch import inside_compiled_call
from lightning_precision._warnings import warn
from lightning_precision.fp8._emulate import (
    CANDIDATE_CASTS,
    TORCHAO_EPS,
    BlockEmulator,
    CastSpec,
    Emulator,
    TileEmulator,
    TorchaoEmulator,
    cast_numerics,
    cast_specs,
    fp8_grad_input,
    squares_sum,
    torchao_scale,
)
from lightning_precision.fp8._selection import TENSORS, TORCHAO_RECIPES, functional_linears, linear_layers
from lightning_precision.fp8._torchao import MXFP8Recipe, torchao_config

__all__ = [
    "CANDIDATE_CASTS",
    "CastSpec",
    "LayerSensitivity",
    "LossFn",
    "MultiProbe",
    "Reduce",
    "SensitivityProbe",
    "TORCHAO_EPS",
    "TensorNumerics",
    "candidate_casts",
    "cast_numerics",
    "cast_specs",
    "fp8_grad_input",
    "fp8_sensitivity",
    "measure_candidates",
    "probe_config",
    "torchao_scale",
]

# Per tensor, accumulated over batches: signal power, noise power, non-zero values, underflows, non-finite, elements.
_NUMERIC_FIELDS = 6
# Per layer: three tensors' fields, then the output's and the input gradient's (error power, reference power).
_WIDTH = 3 * _NUMERIC_FIELDS + 4


@dataclass(frozen=True)
class TensorNumerics:
    """One tensor's fp8 cast: ``sqnr_db`` (inf when exact), and the fractions of values that ``underflow`` (of the
    non-zero ones) and ``overflow`` (non-finite, of all)."""

    sqnr_db: float
    underflow: float
    overflow: float


@dataclass(frozen=True)
class LayerSensitivity:
    """What fp8 costs one linear layer, over ``batches`` batches. ``output_error`` and ``grad_input_error``: relative
    L2 error (``||fp8 - ref|| / ||ref||``, reference in fp32) of the layer's output and of the gradient it passes back
    when it alone runs in fp8."""

    fqn: str
    in_features: int
    out_features: int
    input: TensorNumerics
    weight: TensorNumerics
    grad_output: TensorNumerics
    output_error: float
    grad_input_error: float
    batches: int
    tokens: float = 0.0  # mean tokens (input rows: numel / in_features) per committed batch: the GEMM's M

    def tensors(self) -> dict[str, TensorNumerics]:
        return {t: getattr(self, t) for t in TENSORS}


def _numerics(row: Tensor) -> TensorNumerics:
    signal, noise, nonzero, under, nonfinite, numel = row.tolist()
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    return TensorNumerics(sqnr, under / nonzero if nonzero else 0.0, nonfinite / numel if numel else 0.0)


def _relative(err: float, ref: float) -> float:
    if not math.isfinite(err):  # fp8's result not finite where fp32's is (batches with a non-finite one are dropped)
        return math.inf
    if ref == 0:
        return 0.0 if err == 0 else math.inf
    return math.sqrt(err / ref)


def _error_powers(fp8_result: Tensor, ref: Tensor) -> Tensor:
    """``[||fp8 - ref||^2, ||ref||^2]`` in fp64 (``ref`` fp32), through one fp64 buffer."""
    buffer = torch.empty(ref.shape, dtype=torch.float64, device=ref.device)
    error = squares_sum(fp8_result.float().sub_(ref) if fp8_result.dtype != torch.float32 else fp8_result - ref,
                         buffer)
    return torch.stack([error, squares_sum(ref, buffer)])


class _Eager:
    """How many probes are open, the compiler stance to restore when the last one closes, and whether this process
    was told that compiled code ran eagerly while measured."""

    open = 0
    stance: Any = None
    said = False


def _run_eagerly(on: bool) -> None:
    """While a probe is open, ``torch.compile``d code runs eagerly (``torch.compiler.set_stance("force_eager")``; the
    stance before the first open probe is restored when the last one closes). Compiled, the probe's hooks break the
    graph at every measured layer, and dynamo compiles each such layer's forward, and the hook, once per layer shape:
    a model with more shapes than ``torch._dynamo.config.recompile_limit`` (8) hit it at the first measured step.
    Eagerly nothing is compiled, and the compiled model's cache is left as it was: the steps after run the graph
    compiled before, without a recompile. Only the measured steps pay (FP8Guard's one in ``every_n_steps``,
    ``layers="auto"``'s first batches); ``_say_eager`` says so, once."""
    if on:
        if _Eager.open == 0:
            _Eager.stance = torch.compiler.set_stance("force_eager")  # set now; it holds the stance it replaced
        _Eager.open += 1
        return
    _Eager.open -= 1
    if _Eager.open == 0:
        stance, _Eager.stance = _Eager.stance, None
        stance.__exit__(None, None, None)  # the stance before the first probe


def _say_eager() -> None:
    """Once per process, the first time a measured layer runs inside compiled code: the measured steps run eagerly
    (docs/plan.md, "Under torch.compile")."""
    if _Eager.said or not inside_compiled_call():
        return
    _Eager.said = True
    warn("fp8 measurement (layers='auto' calibration, FP8Guard's measured steps, fp8_sensitivity) runs the compiled"
         " model eagerly: its hooks would break the graph at every measured layer and recompile per layer shape."
         " The compiled graph is kept and runs again, without a recompile, once measuring stops; only the measured"
         " steps pay their eager time.")


def _emulator_for(config: Any, owner: str) -> Emulator:
    """What measures ``config``: a candidate format's name (``CANDIDATE_CASTS``), a torchao ``Float8LinearConfig``,
    or an ``MXFP8Recipe`` (its blocks)."""
    if isinstance(config, MXFP8Recipe):
        return BlockEmulator("mxfp8")
    cast = CANDIDATE_CASTS.get(config) if isinstance(config, str) else None
    if cast == "block":
        return TileEmulator()
    if cast in ("mxfp8", "nvfp4"):
        return BlockEmulator(cast)
    if cast is not None:
        config = torchao_config(cast, emulate=True)
    if dataclasses.is_dataclass(config) and hasattr(config, "cast_config_input"):
        return TorchaoEmulator(config)
    raise ValueError(f"{owner}: {config!r} is not what the probe measures: a candidate format's name"
                     f" {tuple(CANDIDATE_CASTS)}, a torchao `Float8LinearConfig` or an `MXFP8Recipe`.")


class _Probe:
    """Forward hooks on the given linear layers that measure each training forward and backward, for one or more
    emulators (formats) at once: the fp32 reference results are computed once and every emulator's error is taken
    against them. Accumulates on the device; the subclasses read the sums (``result``).

    A batch's numbers are staged, and ``commit()`` (the caller's batch boundary) adds them to the sums only if every
    tensor measured in that batch was finite: its inputs, weights and output gradients and the fp32 reference results.
    A non-finite input or loss is a fault of the data, not of fp8, and one such batch would otherwise mark every layer
    as overflowing. The choice is made on the device, without a read, for each emulator over the layers it measures
    (so each one's numbers are those it would have alone). An fp8 result that is not finite where the fp32 one is
    stays counted: that is fp8 failing. Empty tensors (a layer that received no tokens, as an idle mixture-of-experts
    expert) are not measured. A layer an emulator's format cannot run (its block does not divide the layer's
    dimensions) is not measured by it: ``_skipped[i]`` says why."""

    def __init__(self, layers: Mapping[str, nn.Linear], emulators: list[Emulator], keep_outputs: bool) -> None:
        self.layers = dict(layers)
        self._emulators = emulators
        self._skipped = [{fqn: why for fqn, m in self.layers.items() if (why := e.cannot_run(m))} for e in emulators]
        # Per layer, the emulators that measure it (by index).
        self._measuring = {fqn: [i for i, s in enumerate(self._skipped) if fqn not in s] for fqn in self.layers}
        self.batches = 0  # batches committed, summed across processes: known after `result()`
        self.dropped = 0  # batches left out for a non-finite value, likewise
        self._row = {fqn: i for i, fqn in enumerate(self.layers)}
        # Declared at the first measurement, on its device, one block per emulator:
        # - "sums" (summed across processes by `result`): one row per layer, 3 tensors x _NUMERIC_FIELDS, then output
        #   error/ref powers and grad-input error/ref powers; one more row for the batch counts (committed, dropped).
        # - "staged": this process's batch in progress, the same rows but the last (summed into "sums" by `commit`).
        # - "finite": 1.0 while every tensor of the staged batch is finite, else 0.0 (the min of what was measured).
        self.state = Accumulator()
        self._pending = False  # something is staged (host-side: no device read)
        self.ran = False  # a layer's forward ran with gradients on (on no tokens too): its hooks are seen
        self.keep_outputs = keep_outputs
        self.outputs: list[Tensor] = []  # this step's layer outputs: where a gradient-only backward must reach
        self._handles: list[Any] = []
        self._open = False
        self.reopen()

    def reopen(self) -> None:
        """Measure again after ``close()`` (the sums so far are kept); nothing if open. While open, compiled code runs
        eagerly (``_run_eagerly``)."""
        if self._open:
            return
        # First among the forward hooks: the output measured (and its gradient) is the one the layer produced, not one
        # a later hook put in its place, which could hide what the layer's own fp8 backward receives.
        self._handles = [m.register_forward_hook(self._forward(fqn), prepend=True) for fqn, m in self.layers.items()]
        self._open = True
        _run_eagerly(True)

    def close(self) -> None:
        """Stop measuring: the hooks go, and compiled code runs compiled again once no probe is open."""
        if not self._open:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for emulator in self._emulators:
            emulator.clear()
        self._open = False
        _run_eagerly(False)

    def _allocate(self, device: torch.device) -> None:
        sums = torch.zeros(len(self._emulators), len(self.layers) + 1, _WIDTH, dtype=torch.float64, device=device)
        self.state.add_state("sums", sums, "sum")
        self.state.add_state("staged", sums[:, :-1], "sum")
        self.state.add_state("finite", torch.ones(len(self._emulators), dtype=torch.float64, device=device), "min")

    def _add(self, fqn: str, index: slice, values: Tensor, finite: Tensor, emulator: int = 0) -> None:
        """Stage ``values`` for ``emulator``; ``finite``: whether the tensors they were measured on were all finite."""
        if "staged" not in self.state:
            self._allocate(values.device)
        staged, flags = self.state["staged"], self.state["finite"]
        staged[emulator, self._row[fqn], index] += values.to(staged.device)  # in place: this process's own
        flags[emulator] = torch.minimum(flags[emulator], finite.to(flags))
        self._pending = True

    def mark_loss(self, loss: Tensor) -> None:
        """The staged batch's loss: a non-finite one leaves the batch out, as a non-finite input or gradient does (a
        term of the loss that reaches no layer's gradient, an inf penalty say, would not). Device ops only; nothing
        when nothing was staged."""
        if self._pending:
            flags = self.state["finite"]
            flags.copy_(torch.minimum(flags, torch.isfinite(loss.detach()).all().to(flags)))

    def commit(self) -> None:
        """End of a batch: its staged numbers join the sums if every tensor measured in it was finite; counted either
        way. Device ops only; nothing when nothing was staged."""
        if not self._pending:
            return
        finite = self.state["finite"].view(-1, 1, 1)
        counts = torch.cat([finite, 1 - finite, finite.new_zeros(len(finite), 1, _WIDTH - 2)], dim=-1)
        # `where`, not `staged * finite`: a dropped batch's staged numbers may be inf or nan, and inf * 0 is nan.
        self.state.update("sums", torch.cat([torch.where(finite > 0, self.state["staged"], 0.0), counts], dim=1))
        self.state.reset("staged", "finite")
        self._pending = False

    def _forward(self, fqn: str) -> Callable[..., None]:
        measuring = self._measuring[fqn]

        def hook(module: nn.Linear, args: tuple, output: Any) -> None:
            x = args[0] if args else None
            if not torch.is_grad_enabled() or not isinstance(x, Tensor) or not isinstance(output, Tensor) \
                    or in_probe_pass():
                return
            self.ran = True
            _say_eager()
            if x.numel() == 0 or not measuring:  # no tokens (an idle expert): nothing to measure, nothing to cast
                return
            n = _NUMERIC_FIELDS
            x = x.detach()
            xf = x.float()  # once: the casts and the fp32 reference all read it
            w = module.weight.detach().float()
            b = module.bias.detach().float() if module.bias is not None else None
            ref: Tensor | None = None
            states = []
            for i in measuring:
                cast_x, cast_w, y, state = self._emulators[i].forward(module, x, xf, w, b, output.dtype)
                if ref is None:  # after the first format's casts, not beside them: the measurement's peak stays lower
                    with torch.autocast(x.device.type, enabled=False):  # the hook runs inside the forward's autocast
                        ref = nn.functional.linear(xf, w, b)
                    ref_finite = torch.isfinite(ref).all()
                finite = (cast_x[4] == 0) & (cast_w[4] == 0) & ref_finite
                self._add(fqn, slice(0, n), cast_x, finite, i)
                self._add(fqn, slice(n, 2 * n), cast_w, finite, i)
                self._add(fqn, slice(3 * n, 3 * n + 2), _error_powers(y, ref), finite, i)
                states.append((i, state))
            del xf, ref
            if output.requires_grad:
                output.register_hook(self._backward(fqn, states, w))
                if self.keep_outputs:
                    self.outputs.append(output)

        return hook

    def _backward(self, fqn: str, states: list[tuple[int, Any]], w: Tensor) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if in_probe_pass():  # another's pass through this step's graph (GradientUnderflowMonitor's probe)
                return
            n = _NUMERIC_FIELDS
            with torch.autocast(grad.device.type, enabled=False):
                ref = grad.detach().float() @ w
            ref_finite = torch.isfinite(ref).all()
            for i, state in states:
                cast_g, g = self._emulators[i].backward(state, grad, w)
                finite = (cast_g[4] == 0) & ref_finite
                self._add(fqn, slice(2 * n, 3 * n), cast_g, finite, i)
                self._add(fqn, slice(3 * n + 2, 3 * n + 4), _error_powers(g, ref), finite, i)

        return hook

    def _results(self, reduce: Reduce | None) -> list[tuple[int, int, dict[str, LayerSensitivity]]]:
        """Per emulator: batches committed, batches dropped, and per layer it measured that ran (on any process) its
        ``LayerSensitivity``. What is staged is committed first; one device read. ``reduce`` gets the same shape on
        every rank (a row for every probed layer, ran or not), even when a layer runs on some ranks only
        (data-dependent routing)."""
        if not self.layers:
            return [(0, 0, {}) for _ in self._emulators]
        self.commit()
        # Nothing measured here? Other ranks may have: take part in the reduce all the same.
        if "sums" not in self.state:
            self._allocate(next(iter(self.layers.values())).weight.device)
        stacked = self.state.sync(as_reduce_op(reduce), ["sums"])["sums"].detach().cpu()
        n = _NUMERIC_FIELDS
        out = []
        for rows, skipped in zip(stacked, self._skipped, strict=True):
            batches, dropped = (int(v) for v in rows[-1, :2].tolist())
            measured = {}
            for (fqn, layer), row in zip(self.layers.items(), rows[:-1], strict=True):
                if row[n - 1] == 0 or fqn in skipped:  # the input's element count: never ran in a committed batch
                    continue
                cast_x, cast_w, cast_g = (_numerics(row[i * n : (i + 1) * n]) for i in range(3))
                out_err, out_ref, gin_err, gin_ref = row[3 * n :].tolist()
                measured[fqn] = LayerSensitivity(
                    fqn, layer.in_features, layer.out_features, cast_x, cast_w, cast_g,
                    output_error=_relative(out_err, out_ref), grad_input_error=_relative(gin_err, gin_ref),
                    batches=batches, tokens=row[n - 1].item() / layer.in_features / batches)
            out.append((batches, dropped, measured))
        return out


class SensitivityProbe(_Probe):
    """The probe for one format (see ``_Probe``; the module docstring): ``config`` is a candidate format's name
    (``CANDIDATE_CASTS``: "tensorwise", "mxfp8", "nvfp4", "block", ...), a torchao ``Float8LinearConfig`` or an
    ``MXFP8Recipe``. Holds, per layer, what its backward needs (the fp8 copy) until the backward. ``keep_outputs``:
    collect each forward's layer outputs in ``outputs`` (for a gradient-only backward; the caller empties it every
    step, since each output holds its step's graph). ``batches`` and ``dropped`` count the batches committed and
    dropped, summed across processes by ``result(reduce)``. ``skipped``: the layers the format cannot run ({fqn:
    why}), not measured and absent from the result."""

    def __init__(self, layers: Mapping[str, nn.Linear], config: Any, keep_outputs: bool = False) -> None:
        emulator = _emulator_for(config, "SensitivityProbe")
        self.config = emulator.config if isinstance(emulator, TorchaoEmulator) else config
        self.specs = emulator.specs if isinstance(emulator, TorchaoEmulator) else {}
        super().__init__(layers, [emulator], keep_outputs)
        self.skipped = self._skipped[0]

    def result(self, reduce: Reduce | None = None) -> dict[str, LayerSensitivity]:
        """Per layer that ran (on any process): its ``LayerSensitivity`` over the committed batches (what is staged is
        committed first; one device read). ``reduce`` sums across processes, so every rank decides on the same
        numbers. Sets ``batches`` and ``dropped``."""
        if not self.layers:
            return {}
        self.batches, self.dropped, out = self._results(reduce)[0]
        return out


def candidate_casts(candidates: Iterable[str], owner: str) -> dict[str, str]:
    """Each candidate format and the cast that measures it (``CANDIDATE_CASTS``), or a ``ValueError`` naming ``owner``'s
    call and the known candidates. A high label ("bf16", ...) is no candidate to measure: it is the reference."""
    if isinstance(candidates, str):
        raise ValueError(f"`{owner}(candidates={candidates!r})`: a tuple of format names, e.g. ({candidates!r},).")
    casts = {}
    for name in candidates:
        if name not in CANDIDATE_CASTS:
            raise ValueError(f"`{owner}(candidates=...)`: {name!r} is not a format it measures; use some of"
                             f" {tuple(CANDIDATE_CASTS)} (the high-precision dtype needs no measurement: it is the"
                             " reference).")
        casts[name] = CANDIDATE_CASTS[name]
    if not casts:
        raise ValueError(f"`{owner}(candidates=())`: name at least one format to measure, e.g. ('tensorwise',).")
    return casts


class MultiProbe(_Probe):
    """Several candidate formats measured on the same layers in one pass (``SensitivityProbe``'s interface): the fp32
    references once, each format's casts and errors beside them, each candidate's numbers the float for float those of
    a ``SensitivityProbe`` measuring it alone. Candidates measured by the same cast (``CANDIDATE_CASTS``: "delayed",
    "current" and "tensorwise") are measured once. ``result(reduce)``: candidate -> fqn -> ``LayerSensitivity``; a layer
    a candidate cannot run is absent from its numbers (``skipped``: candidate -> {fqn: why}). ``batches`` and
    ``dropped``: the fewest batches any candidate kept and the most it dropped (they differ only when a non-finite
    value was in a layer some candidate cannot run)."""

    def __init__(self, layers: Mapping[str, nn.Linear], candidates: Iterable[str], keep_outputs: bool = False) -> None:
        self.candidates = candidate_casts(candidates, "MultiProbe")
        self._casts = list(dict.fromkeys(self.candidates.values()))
        super().__init__(layers, [_emulator_for(cast, "MultiProbe") for cast in self._casts], keep_outputs)
        self.skipped = {name: self._skipped[self._casts.index(cast)] for name, cast in self.candidates.items()}

    def result(self, reduce: Reduce | None = None) -> dict[str, dict[str, LayerSensitivity]]:
        """Per candidate, per layer that ran (on any process) and that the candidate can run: its ``LayerSensitivity``
        (see ``SensitivityProbe.result``). Sets ``batches`` and ``dropped``."""
        results = self._results(reduce)
        if results:
            self.batches, self.dropped = min(r[0] for r in results), max(r[1] for r in results)
        return {name: results[self._casts.index(cast)][2] for name, cast in self.candidates.items()}


LossFn = Callable[[nn.Module, Any], Tensor]


def probe_config(recipe: str | Any, owner: str = "fp8_sensitivity") -> Any:
    """What measures ``recipe``, a torchao recipe (a name, ``Float8LinearConfig`` or ``MXFP8Recipe``): the emulated
    ``Float8LinearConfig`` of a per-tensor or per-row recipe, an ``MXFP8Recipe`` (emulated) for MXFP8, whose blocks the
    probe casts. Another name (Transformer Engine's formats, NVFP4) is a ``ValueError`` naming ``owner``'s call and
    ``measure_candidates``, which measures those."""
    if isinstance(recipe, MXFP8Recipe):
        return dataclasses.replace(recipe, emulate=True)
    if recipe == "mxfp8":
        return MXFP8Recipe(emulate=True)
    if isinstance(recipe, str) and recipe in CANDIDATE_CASTS and recipe not in TORCHAO_RECIPES:
        raise ValueError(f"`{owner}(recipe={recipe!r})`: not a torchao recipe ({TORCHAO_RECIPES}). Measure"
                         f" Transformer Engine's formats and NVFP4 with `measure_candidates(model, batches,"
                         f" candidates=({recipe!r},))`.")
    return torchao_config(recipe, emulate=True)


def _default_loss(model: nn.Module, batch: Any) -> Tensor:
    out = model(batch) if not isinstance(batch, (tuple, list)) else model(*batch)
    loss = getattr(out, "loss", out)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(
            "fp8_sensitivity: the model's output is not a scalar loss (nor has a `.loss`). Pass"
            " `loss_fn=lambda model, batch: ...` returning the training loss of a batch: the gradients measured are"
            " those of that loss."
        )
    return loss


def _measure(owner: str, model: nn.Module, batches: Iterable[Any], make_probe: Callable[[dict[str, nn.Linear]], _Probe],
             loss_fn: LossFn | None, layers: Iterable[str] | None, autocast_dtype: torch.dtype | None) -> _Probe | None:
    """``owner``'s loop: the probe ``make_probe`` makes over the layers asked for, forward and a gradient-only
    backward on each batch, then closed (None when no layer is to be measured). Its ``result()`` is the caller's."""
    linears = {fqn: m for fqn, m, _ in linear_layers(model)}
    if not linears:
        raise ValueError(f"{owner}: {type(model).__name__} has no nn.Linear layer, so there is nothing to measure;"
                         " pass the model whose linear layers would run in fp8.")
    functional = functional_linears(model)
    wanted = list(layers) if layers is not None else [f for f, m in linears.items() if id(m) not in functional]
    unknown = [f for f in wanted if f not in linears]
    if unknown:
        raise ValueError(f"{owner}(layers=...): not nn.Linear layers of the model: {', '.join(unknown)}.")
    if not wanted:  # none asked for (or every one used functionally): no batch needs to run
        return None
    probe = make_probe({f: linears[f] for f in wanted})
    loss_fn = loss_fn or _default_loss
    device = linears[wanted[0]].weight.device
    try:
        with torch.enable_grad():  # under a caller's no_grad the hooks would see nothing and every layer "not run"
            for batch in batches:
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    loss = loss_fn(model, batch)
                outputs, probe.outputs = probe.outputs, []
                if outputs:  # the layers' output gradients only: no parameter's .grad is written
                    torch.autograd.grad(loss, outputs, allow_unused=True)
                probe.mark_loss(loss)
                probe.commit()
    finally:
        probe.close()
    return probe


def _say_dropped(owner: str, probe: _Probe) -> None:
    if probe.dropped:
        warn(f"{owner}: {probe.dropped} of {probe.dropped + probe.batches} batches had a non-finite input, loss or"
             " gradient in a measured layer: a fault of the data, not of fp8. They were left out; the numbers are"
             f" those of the other {probe.batches}.")


def fp8_sensitivity(
    model: nn.Module,
    batches: Iterable[Any],
    recipe: str | Any = "tensorwise",
    loss_fn: LossFn | None = None,
    layers: Iterable[str] | None = None,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
) -> dict[str, LayerSensitivity]:
    """Measure, per linear layer, what fp8 under ``recipe`` would lose on these batches (see the module docstring).

    Forward and backward run on each batch (``loss_fn(model, batch)``, by default the model's scalar output or its
    ``.loss``) under ``autocast_dtype`` autocast, as training would; gradients are taken with respect to the layers'
    outputs only, so no parameter's ``.grad`` changes and the weights are not updated. ``layers``: the paths to measure
    (default: every ``nn.Linear`` whose forward runs). ``recipe``: a torchao recipe name (``"mxfp8"`` included: its
    blocks are cast), ``Float8LinearConfig`` or ``MXFP8Recipe``; ``measure_candidates`` measures Transformer Engine's
    formats and NVFP4, and several at once. A layer whose dimensions the format's block does not divide cannot run it
    and is absent from the result. torchao must be installed; it runs emulated, so any device works. Gradients are
    enabled inside (the measurement needs a backward), also when called under ``torch.no_grad()``. A batch with a
    non-finite input, loss or gradient is left out with a warning (``SensitivityProbe``), and ``batches`` counts the
    others.
    """
    owner = "fp8_sensitivity"
    config = probe_config(recipe, owner)
    probe = _measure(owner, model, batches, lambda layers: SensitivityProbe(layers, config, keep_outputs=True),
                     loss_fn, layers, autocast_dtype)
    if probe is None:
        return {}
    result = cast(SensitivityProbe, probe).result()
    _say_dropped(owner, probe)
    return result


def measure_candidates(
    model: nn.Module,
    batches: Iterable[Any],
    candidates: Iterable[str],
    loss_fn: LossFn | None = None,
    layers: Iterable[str] | None = None,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
) -> dict[str, dict[str, LayerSensitivity]]:
    """``fp8_sensitivity`` for several candidate formats in one pass over ``batches`` (one forward and one backward per
    batch; ``MultiProbe``): candidate -> fqn -> ``LayerSensitivity``, each candidate's numbers those it would get
    measured alone. ``candidates``: names from ``CANDIDATE_CASTS`` (torchao's "tensorwise", "rowwise",
    "rowwise_with_gw_hp", "mxfp8"; Transformer Engine's "delayed", "current", "mxfp8", "block", "nvfp4"). A layer a
    candidate cannot run (its block does not divide the layer's dimensions) is absent from that candidate's numbers.
    Other arguments as ``fp8_sensitivity``.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
        >>> numbers = measure_candidates(model, [torch.randn(8, 64)], ("tensorwise", "mxfp8", "nvfp4"),
        ...                              loss_fn=lambda m, x: m(x).float().pow(2).mean())
        >>> sorted(numbers), sorted(numbers["mxfp8"]), numbers["nvfp4"]["0"].tokens
        (['mxfp8', 'nvfp4', 'tensorwise'], ['0', '2'], 8.0)
    """
    owner = "measure_candidates"
    names = candidate_casts(candidates, owner)
    probe = _measure(owner, model, batches, lambda layers: MultiProbe(layers, names, keep_outputs=True), loss_fn,
                     layers, autocast_dtype)
    if probe is None:
        return {name: {} for name in names}
    result = cast(MultiProbe, probe).result()
    _say_dropped(owner, probe)
    return result
