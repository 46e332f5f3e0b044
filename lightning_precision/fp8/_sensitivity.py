"""How much each linear layer would lose in fp8, measured on real batches: the numbers a ``PrecisionPlan`` decides on.

For every linear layer and each tensor fp8 casts (input, weight, output gradient), under the recipe's real scaling
(torchao's dynamic scales: per tensor or per row, e4m3fn forward and e5m2 or e4m3fn gradients as the recipe says):
the signal-to-quantization-noise ratio of the cast, and the fractions that underflow (non-zero values cast to zero)
or overflow (non-finite values: dynamic scales never saturate finite ones). Then the error of the layer's output and
input gradient when that layer alone runs in fp8, through torchao's own ``Float8Linear`` (emulated: any device).

``SensitivityProbe`` is the one place that measures: ``fp8_sensitivity`` (before training, weights untouched) and
``FP8Precision(layers="auto")`` (the first training steps) both use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_precision import _imports
from lightning_precision._accumulator import Accumulator, Reduce, as_reduce_op
from lightning_precision._upstream import torchao as upstream
from lightning_precision._upstream.torch import inside_compiled_call
from lightning_precision._upstream.torchao import FLOAT8_EPS
from lightning_precision._warnings import warn
from lightning_precision.formats import NumberFormat, get_format
from lightning_precision.fp8._selection import BLOCK_SCALED, HYBRID_FORMAT, TENSORS, functional_linears, linear_layers
from lightning_precision.fp8._torchao import MXFP8Recipe, torchao_config

__all__ = [
    "CastSpec",
    "LayerSensitivity",
    "LossFn",
    "Reduce",
    "SensitivityProbe",
    "TORCHAO_EPS",
    "TensorNumerics",
    "cast_numerics",
    "cast_specs",
    "fp8_grad_input",
    "fp8_sensitivity",
    "probe_config",
    "torchao_scale",
]

TORCHAO_EPS = FLOAT8_EPS  # torchao's floor under amax (tests/test_upstream_torchao.py checks it against torchao's)

# Per tensor, accumulated over batches: signal power, noise power, non-zero values, underflows, non-finite, elements.
_NUMERIC_FIELDS = 6
# Per layer: three tensors' fields, then the output's and the input gradient's (error power, reference power).
_WIDTH = 3 * _NUMERIC_FIELDS + 4


@dataclass(frozen=True)
class CastSpec:
    """How one tensor is cast: the fp8 dtype, per-row (``axiswise``) or per-tensor scale, power-of-two scales."""

    dtype: torch.dtype
    axiswise: bool
    pow2: bool


def _fp8_dtype(name: str) -> torch.dtype:
    """The torch dtype of an fp8 format (torchao's when a config names none)."""
    fmt = get_format(name)
    if not isinstance(fmt, NumberFormat) or fmt.dtype is None:
        raise ValueError(f"{name!r} is not an fp8 format with a torch dtype")
    return fmt.dtype


def cast_specs(config: Any) -> dict[str, CastSpec]:
    """The ``CastSpec`` of input, weight and grad_output under a torchao ``Float8LinearConfig``."""
    ScalingGranularity = _imports.import_quietly("torchao.float8.config").ScalingGranularity

    specs = {}
    for tensor in TENSORS:
        cast = getattr(config, f"cast_config_{tensor}")
        target: torch.dtype = getattr(cast, "target_dtype", None) or _fp8_dtype(HYBRID_FORMAT[tensor])
        specs[tensor] = CastSpec(target,
                                 cast.scaling_granularity == ScalingGranularity.AXISWISE,
                                 bool(getattr(config, "round_scales_to_power_of_2", False)))
    return specs


def torchao_scale(amax: Tensor, fmax: float, pow2: bool = False) -> Tensor:
    """torchao's dynamic scale for a largest magnitude ``amax`` (per tensor or per row): ``fmax / max(amax, EPS)`` in
    fp64, then fp32, rounded down to a power of two when ``pow2`` (its rowwise recipes). The one place it is computed:
    ``cast_numerics`` and ``functional.dynamic_scale_stats`` both use it.

    Example:
        >>> torchao_scale(torch.tensor(2.0), 448.0).item(), torchao_scale(torch.tensor(2.0), 448.0, pow2=True).item()
        (224.0, 128.0)
    """
    scale = (fmax / amax.double().clamp(min=TORCHAO_EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def _squares_sum(t: Tensor, buffer: Tensor | None = None) -> Tensor:
    """The sum of ``t``'s squares in fp64 (each square exact: an fp32 value squared fits fp64's mantissa), summed as
    ``t.double().pow(2).sum()`` sums them, so the same float; ``buffer``: an fp64 tensor of ``t``'s shape to hold the
    squares (no new one)."""
    d = buffer.copy_(t) if buffer is not None else t.double()
    return d.mul_(d).sum()


def cast_numerics(t: Tensor, spec: CastSpec) -> Tensor:
    """``[signal power, noise power, non-zero, underflow, non-finite, elements]`` of casting ``t`` to fp8 as torchao
    does (scale ``max / max(amax, EPS)`` in fp64 then fp32, rounded down to a power of two if asked, saturating cast),
    in fp64 on ``t``'s device. Non-finite values are left out of the powers.

    Each figure is the one the straightforward expression gives (tests/sensitivity_reference.py keeps it, and
    tests/test_sensitivity_equal.py holds this to it), computed with fewer passes and temporaries: in-place steps, one
    fp64 buffer for both powers, ``|x| < inf`` for ``isfinite``."""
    x = t.detach().float()
    x = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    # Each temporary goes as soon as it is read: the peak is what a layer's measurement adds to the step's.
    finite = x.abs() < math.inf  # isfinite (nan and inf compare false), in a third of its time
    not_finite = (~finite).sum()
    x = torch.where(finite, x, 0.0)
    del finite
    magnitude = x.abs()
    amax = magnitude.amax(dim=-1, keepdim=True) if spec.axiswise else magnitude.amax()
    del magnitude
    fmax = torch.finfo(spec.dtype).max
    scale = torchao_scale(amax, fmax, spec.pow2)
    q = (x * scale).clamp_(-fmax, fmax).to(spec.dtype).float()
    nonzero = x != 0
    counts = torch.stack([nonzero.sum(), (nonzero & (q == 0)).sum(), not_finite]).double()
    del nonzero
    buffer = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    noise = _squares_sum(q.div_(scale).sub_(x), buffer)
    del q
    signal = _squares_sum(x, buffer)
    # torch.full, not torch.tensor: a host-to-device copy from pageable memory would wait for the device.
    return torch.cat([torch.stack([signal, noise]), counts,
                      torch.full((1,), x.numel(), dtype=torch.float64, device=x.device)])


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
    error = _squares_sum(fp8_result.float().sub_(ref) if fp8_result.dtype != torch.float32 else fp8_result - ref,
                         buffer)
    return torch.stack([error, _squares_sum(ref, buffer)])


def fp8_grad_input(fp8: Any, grad_output: Tensor) -> Tensor:
    """The input gradient a torchao ``Float8Linear`` computes in its backward, for ``grad_output``: its casts of the
    output gradient (``cast_config_grad_output``) and of the weight (``cast_config_weight_for_grad_input``), and their
    matmul, as ``matmul_with_hp_or_float8_args.backward`` does them, without the weight gradient that backward also
    computes (the probe reads only the input gradient: a third of the work, and an fp32 input beside a bf16 output
    gradient made that hp weight gradient fail). tests/test_sensitivity_equal.py holds it to torchao's own backward."""
    to_float8, axiswise_dim, roles = upstream.float8_dynamic_cast()
    disabled = _imports.import_quietly("torchao.float8.config").ScalingType.DISABLED
    config, mm_config = fp8.config, fp8.linear_mm_config

    def cast(t: Tensor, cast_config: Any, role: Any) -> Any:
        if cast_config.scaling_type is disabled:
            return t
        return to_float8(
            t, cast_config.target_dtype, mm_config, gemm_input_role=role,
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=axiswise_dim(-1, cast_config.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2)

    shape = grad_output.shape
    g = cast(grad_output.reshape(-1, shape[-1]), config.cast_config_grad_output, roles.GRAD_OUTPUT)
    w = cast(fp8.weight.t(), config.cast_config_weight_for_grad_input, roles.WEIGHT)
    return torch.mm(g, w.t()).reshape(*shape[:-1], -1)


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


class SensitivityProbe:
    """Forward hooks on the given linear layers that measure each training forward and backward (see the module
    docstring) and accumulate on the device; ``result(reduce)`` reads them once (``reduce`` sums across processes, so
    every rank decides on the same numbers). Holds, per layer, the fp8 copy's input and output until the backward.
    ``keep_outputs``: collect each forward's layer outputs in ``outputs`` (for a gradient-only backward; the caller
    empties it every step, since each output holds its step's graph).

    A batch's numbers are staged, and ``commit()`` (the caller's batch boundary; ``result`` commits what is pending)
    adds them to the sums only if every tensor measured in that batch was finite: its inputs, weights and output
    gradients and the fp32 reference results. A non-finite input or loss is a fault of the data, not of fp8, and one
    such batch would otherwise mark every layer as overflowing. The choice is made on the device, without a read;
    ``batches`` and ``dropped`` count the batches committed and dropped, summed across processes by
    ``result(reduce)``. An fp8 result that is not finite where the fp32 one is stays counted: that is fp8 failing.
    Empty tensors (a layer that received no tokens, as an idle mixture-of-experts expert) are not measured."""

    def __init__(self, layers: Mapping[str, nn.Linear], config: Any, keep_outputs: bool = False) -> None:
        if not dataclasses.is_dataclass(config) or not hasattr(config, "cast_config_input"):
            raise ValueError(f"SensitivityProbe: {config!r} is not a torchao `Float8LinearConfig`: the probe measures"
                             " torchao's per-tensor and per-row casts. Block-scaled casts (MXFP8, NVFP4) are measured"
                             " by `lightning_precision.functional.underflow_stats(x, 'mxfp8')`.")
        config = dataclasses.replace(cast(Any, config), emulate=True, enable_fsdp_float8_all_gather=False)
        self.specs = cast_specs(config)
        self.config = config
        self.layers = dict(layers)
        self.batches = 0  # batches committed, summed across processes: known after `result()`
        self.dropped = 0  # batches left out for a non-finite value, likewise
        self._row = {fqn: i for i, fqn in enumerate(self.layers)}
        # Declared at the first measurement, on its device:
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
        self._copies: dict[nn.Module, tuple[tuple, nn.Module]] = {}  # per layer: its fp8 copy, and what it copied
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
        self._copies.clear()  # views of the layers' weights: a replaced weight is not kept alive by them
        self._open = False
        _run_eagerly(False)

    def _allocate(self, device: torch.device) -> None:
        sums = torch.zeros(len(self.layers) + 1, _WIDTH, dtype=torch.float64, device=device)
        self.state.add_state("sums", sums, "sum")
        self.state.add_state("staged", sums[:-1], "sum")
        self.state.add_state("finite", torch.ones((), dtype=torch.float64, device=device), "min")

    def _add(self, fqn: str, index: slice, values: Tensor, finite: Tensor) -> None:
        """Stage ``values``; ``finite``: whether the tensors they were measured on were all finite."""
        if "staged" not in self.state:
            self._allocate(values.device)
        staged = self.state["staged"]
        staged[self._row[fqn], index] += values.to(staged.device)  # in place: this process's own, never shared
        self.state.update("finite", finite.to(self.state["finite"]))
        self._pending = True

    def commit(self) -> None:
        """End of a batch: its staged numbers join the sums if every tensor measured in it was finite; counted either
        way. Device ops only; nothing when nothing was staged."""
        if not self._pending:
            return
        finite = self.state["finite"]
        counts = torch.cat([finite.view(1), (1 - finite).view(1), finite.new_zeros(_WIDTH - 2)]).view(1, _WIDTH)
        # `where`, not `staged * finite`: a dropped batch's staged numbers may be inf or nan, and inf * 0 is nan.
        self.state.update("sums", torch.cat([torch.where(finite > 0, self.state["staged"], 0.0), counts]))
        self.state.reset("staged", "finite")
        self._pending = False

    def _fp8_copy(self, layer: nn.Linear) -> nn.Module:
        """torchao's ``Float8Linear`` over the layer's current weight and bias (views, no gradient of their own): the
        layer's forward in fp8, without touching its parameters or their ``.grad``. Made once per layer and kept while
        the layer's parameters are the same tensors (views: an optimizer's in-place update is seen); made again when
        one is replaced (``.data`` set, the model moved)."""
        key = (layer.weight, layer.weight.data_ptr(), layer.bias,
               layer.bias.data_ptr() if layer.bias is not None else None)
        kept = self._copies.get(layer)
        if kept is not None and all(a is b if isinstance(a, Tensor) else a == b for a, b in zip(kept[0], key,
                                                                                                 strict=True)):
            return kept[1]
        convert = _imports.import_quietly("torchao.float8").convert_to_float8_training
        shadow = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        shadow.weight = nn.Parameter(layer.weight.detach(), requires_grad=False)
        if layer.bias is not None:
            shadow.bias = nn.Parameter(layer.bias.detach(), requires_grad=False)
        copy = convert(shadow, config=self.config)
        self._copies[layer] = (key, copy)
        return copy

    def _forward(self, fqn: str) -> Callable[..., None]:
        def hook(module: nn.Linear, args: tuple, output: Any) -> None:
            x = args[0] if args else None
            if not torch.is_grad_enabled() or not isinstance(x, Tensor) or not isinstance(output, Tensor):
                return
            self.ran = True
            _say_eager()
            if x.numel() == 0:  # no tokens reached this layer (an idle expert): nothing to measure, nothing to cast
                return
            n = _NUMERIC_FIELDS
            x = x.detach()
            xf = x.float()  # once: the input's numerics and the fp32 reference both read it
            cast_x, cast_w = cast_numerics(xf, self.specs["input"]), cast_numerics(module.weight, self.specs["weight"])
            fp8 = self._fp8_copy(module)
            with torch.no_grad():  # the fp8 input gradient is computed in the backward hook: no graph is kept
                y8 = fp8(x)
            w = module.weight.detach().float()
            b = module.bias.detach().float() if module.bias is not None else None
            with torch.autocast(x.device.type, enabled=False):  # the hook runs inside the forward's autocast
                ref = nn.functional.linear(xf, w, b)
            del xf
            finite = (cast_x[4] == 0) & (cast_w[4] == 0) & torch.isfinite(ref).all()
            self._add(fqn, slice(0, n), cast_x, finite)
            self._add(fqn, slice(n, 2 * n), cast_w, finite)
            self._add(fqn, slice(3 * n, 3 * n + 2), _error_powers(y8, ref), finite)
            if output.requires_grad:
                output.register_hook(self._backward(fqn, fp8, x.dtype, y8.dtype, w))
                if self.keep_outputs:
                    self.outputs.append(output)

        return hook

    def _backward(self, fqn: str, fp8: nn.Module, input_dtype: torch.dtype, output_dtype: torch.dtype,
                  w: Tensor) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            n = _NUMERIC_FIELDS
            cast_g = cast_numerics(grad, self.specs["grad_output"])
            g8 = fp8_grad_input(fp8, grad.to(output_dtype)).to(input_dtype)
            with torch.autocast(grad.device.type, enabled=False):
                ref = grad.detach().float() @ w
            finite = (cast_g[4] == 0) & torch.isfinite(ref).all()
            self._add(fqn, slice(2 * n, 3 * n), cast_g, finite)
            self._add(fqn, slice(3 * n + 2, 3 * n + 4), _error_powers(g8, ref), finite)

        return hook

    def result(self, reduce: Reduce | None = None) -> dict[str, LayerSensitivity]:
        """Per layer that ran (on any process): its ``LayerSensitivity`` over the committed batches (what is staged is
        committed first; one device read). ``reduce`` gets one row for every probed layer, ran or not, and one of batch
        counts, so the all-reduce has the same shape on every rank even when a layer runs on some ranks only
        (data-dependent routing). Sets ``batches`` and ``dropped``."""
        if not self.layers:
            return {}
        self.commit()
        # Nothing measured here? Other ranks may have: take part in the reduce all the same.
        if "sums" not in self.state:
            self._allocate(next(iter(self.layers.values())).weight.device)
        stacked = self.state.sync(as_reduce_op(reduce), ["sums"])["sums"].cpu()
        self.batches, self.dropped = (int(v) for v in stacked[-1, :2].tolist())
        n = _NUMERIC_FIELDS
        out = {}
        for (fqn, layer), row in zip(self.layers.items(), stacked[:-1], strict=True):
            if row[n - 1] == 0:  # the input's element count: the layer never ran (with tokens) in a committed batch
                continue
            cast_x, cast_w, cast_g = (_numerics(row[i * n : (i + 1) * n]) for i in range(3))
            out_err, out_ref, gin_err, gin_ref = row[3 * n :].tolist()
            out[fqn] = LayerSensitivity(fqn, layer.in_features, layer.out_features, cast_x, cast_w, cast_g,
                                        output_error=_relative(out_err, out_ref),
                                        grad_input_error=_relative(gin_err, gin_ref), batches=self.batches)
        return out


LossFn = Callable[[nn.Module, Any], Tensor]


def probe_config(recipe: str | Any, owner: str = "fp8_sensitivity") -> Any:
    """The emulated torchao ``Float8LinearConfig`` that measures ``recipe`` (a torchao recipe name or config), or a
    ``ValueError`` naming ``owner``'s call: the probe casts per tensor or per row, as those recipes do, and MXFP8's
    blocks are another measurement."""
    if (isinstance(recipe, str) and recipe in BLOCK_SCALED) or isinstance(recipe, MXFP8Recipe):
        raise ValueError(f"`{owner}(recipe={recipe!r})`: it measures torchao's per-tensor and per-row casts"
                         " ('tensorwise', 'rowwise', 'rowwise_with_gw_hp' or a Float8LinearConfig), not the blocks of a"
                         " block-scaled format. Measure what a block-scaled cast loses with"
                         " `lightning_precision.functional.underflow_stats(x, 'mxfp8')`.")
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
    (default: every ``nn.Linear`` whose forward runs). ``recipe``: a torchao recipe name or ``Float8LinearConfig``.
    torchao must be installed; it runs emulated, so any device works. Gradients are enabled inside (the measurement
    needs a backward), also when called under ``torch.no_grad()``. A batch with a non-finite input, loss or gradient
    is left out with a warning (``SensitivityProbe``), and ``batches`` counts the others.
    """
    owner = "fp8_sensitivity"
    config = probe_config(recipe, owner)
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
        return {}
    probe = SensitivityProbe({f: linears[f] for f in wanted}, config, keep_outputs=True)
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
                probe.commit()
    finally:
        probe.close()
    result = probe.result()
    if probe.dropped:
        warn(f"{owner}: {probe.dropped} of {probe.dropped + probe.batches} batches had a non-finite input, loss or"
             " gradient in a measured layer: a fault of the data, not of fp8. They were left out; the numbers are"
             f" those of the other {probe.batches}.")
    return result
