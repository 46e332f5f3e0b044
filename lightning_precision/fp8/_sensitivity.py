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
from lightning_precision.formats import BLOCK_FORMATS, FORMATS, BlockFormat, NumberFormat, get_format
from lightning_precision.fp8._selection import (
    HYBRID_FORMAT,
    TENSORS,
    TORCHAO_RECIPES,
    functional_linears,
    linear_layers,
)
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
    "block_cast_numerics",
    "candidate_casts",
    "cast_numerics",
    "cast_specs",
    "fp8_grad_input",
    "fp8_sensitivity",
    "measure_candidates",
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


def _finite_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """``t`` in fp32 as rows of its last dimension, non-finite values set to 0 (a new tensor: ``t`` is not written),
    and how many were non-finite."""
    x = t.detach().float()
    x = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    finite = x.abs() < math.inf  # isfinite (nan and inf compare false), in a third of its time
    not_finite = (~finite).sum()
    return torch.where(finite, x, 0.0), not_finite


def _cast_fields(x: Tensor, q: Tensor, not_finite: Tensor, keep: bool = False) -> Tensor:
    """The six fields of casting ``x`` (finite, fp32) to ``q`` (its cast, dequantized: what the matmul reads);
    ``keep``: ``q`` is read afterwards, else its storage holds the cast's error."""
    nonzero = x != 0
    counts = torch.stack([nonzero.sum(), (nonzero & (q == 0)).sum(), not_finite]).double()
    del nonzero
    buffer = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    noise = _squares_sum(q - x if keep else q.sub_(x), buffer)
    signal = _squares_sum(x, buffer)
    # torch.full, not torch.tensor: a host-to-device copy from pageable memory would wait for the device.
    return torch.cat([torch.stack([signal, noise]), counts,
                      torch.full((1,), x.numel(), dtype=torch.float64, device=x.device)])


def cast_numerics(t: Tensor, spec: CastSpec) -> Tensor:
    """``[signal power, noise power, non-zero, underflow, non-finite, elements]`` of casting ``t`` to fp8 as torchao
    does (scale ``max / max(amax, EPS)`` in fp64 then fp32, rounded down to a power of two if asked, saturating cast),
    in fp64 on ``t``'s device. Non-finite values are left out of the powers.

    Each figure is the one the straightforward expression gives (tests/sensitivity_reference.py keeps it, and
    tests/test_sensitivity_equal.py holds this to it), computed with fewer passes and temporaries: in-place steps, one
    fp64 buffer for both powers, ``|x| < inf`` for ``isfinite``."""
    # Each temporary goes as soon as it is read: the peak is what a layer's measurement adds to the step's.
    x, not_finite = _finite_rows(t)
    magnitude = x.abs()
    amax = magnitude.amax(dim=-1, keepdim=True) if spec.axiswise else magnitude.amax()
    del magnitude
    fmax = torch.finfo(spec.dtype).max
    scale = torchao_scale(amax, fmax, spec.pow2)
    # Dequantized in place; a value cast to zero stays zero (scale <= fmax / EPS: q / scale never underflows fp32).
    q = (x * scale).clamp_(-fmax, fmax).to(spec.dtype).float().div_(scale)
    return _cast_fields(x, q, not_finite)


def block_cast_numerics(t: Tensor, fmt: BlockFormat) -> tuple[Tensor, Tensor]:
    """``cast_numerics``'s six fields for the block-scaled cast ``fmt.cast`` (blocks of ``fmt.block_size`` along the
    last dimension, each at its own scale; NVFP4's tensor scale from the whole of ``t``), and the cast itself
    (dequantized, fp32, rows of the last dimension): what the emulated matmul reads, cast once for both. The error is
    taken in fp32, as ``cast_numerics`` takes it."""
    x, not_finite = _finite_rows(t)
    q = fmt.cast(x)
    return _cast_fields(x, q, not_finite, keep=True), q


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


class _Torchao:
    """How torchao's per-tensor and per-row recipes compute a layer: its casts (``cast_specs``) and its own
    ``Float8Linear`` (emulated), the input gradient as its backward computes it (``fp8_grad_input``)."""

    def __init__(self, config: Any) -> None:
        self.config = dataclasses.replace(config, emulate=True, enable_fsdp_float8_all_gather=False)
        self.specs = cast_specs(self.config)
        self._copies: dict[nn.Module, tuple[tuple, nn.Module]] = {}  # per layer: its fp8 copy, and what it copied

    def cannot_run(self, layer: nn.Linear) -> str | None:
        return None

    def clear(self) -> None:
        self._copies.clear()  # views of the layers' weights: a replaced weight is not kept alive by them

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

    def forward(self, layer: nn.Linear, x: Tensor, xf: Tensor, w: Tensor, b: Tensor | None,
                output_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Any]:
        cast_x, cast_w = cast_numerics(xf, self.specs["input"]), cast_numerics(w, self.specs["weight"])
        fp8 = self._fp8_copy(layer)
        with torch.no_grad():  # the fp8 input gradient is computed in the backward hook: no graph is kept
            y8 = fp8(x)
        return cast_x, cast_w, y8, (fp8, x.dtype, y8.dtype)

    def backward(self, state: Any, grad: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        fp8, input_dtype, output_dtype = state
        return (cast_numerics(grad, self.specs["grad_output"]),
                fp8_grad_input(fp8, grad.to(output_dtype)).to(input_dtype))


def _gemm_input(x: Tensor, xf: Tensor) -> Tensor:
    """The layer's input (fp32) as a low-precision layer reads it: rounded to the autocast dtype when autocast is on
    (the forward hook runs inside the forward's autocast), as torchao's fp8 and MXFP8 layers round it first."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return xf
    return x.to(torch.get_autocast_dtype(device)).float()


class _Blocks:
    """How a block-scaled format computes a layer, with its real casts (``formats.BlockFormat.cast``: each block at its
    own scale, NVFP4's tensor scale from the whole tensor): the output from input (in the autocast dtype, as the layer
    reads it) and weight (its fp32 master, as torchao casts it) cast in blocks along K
    (``in_features``), the input gradient from the output gradient and the weight cast in blocks along N
    (``out_features``), each product in fp32 then rounded to the dtype the layer's own result had (a low-precision
    GEMM writes the autocast dtype). The weight's numerics are those of its forward cast (along K); the backward's cast
    shows in the input gradient's error. A layer whose K or N the block does not divide cannot run the format."""

    def __init__(self, name: str) -> None:
        fmt = get_format(name)
        assert isinstance(fmt, BlockFormat)
        self.format = fmt

    def cannot_run(self, layer: nn.Linear) -> str | None:
        size = self.format.block_size
        if layer.in_features % size == 0 and layer.out_features % size == 0:
            return None
        return (f"{self.format.name} casts blocks of {size} along in_features and out_features, and"
                f" {size} does not divide {layer.in_features} x {layer.out_features}")

    def clear(self) -> None:
        pass

    def forward(self, layer: nn.Linear, x: Tensor, xf: Tensor, w: Tensor, b: Tensor | None,
                output_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Any]:
        xa = _gemm_input(x, xf)
        (cast_x, xq), (cast_w, wq) = block_cast_numerics(xa, self.format), block_cast_numerics(w, self.format)
        with torch.autocast(x.device.type, enabled=False):
            y = nn.functional.linear(xq.view(xa.shape), wq, b)
        return cast_x, cast_w, y.to(output_dtype), x.dtype

    def backward(self, state: Any, grad: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        cast_g, gq = block_cast_numerics(grad, self.format)
        wt = self.format.cast(w.t())  # blocks along N: the weight as the input-gradient GEMM reads it
        with torch.autocast(grad.device.type, enabled=False):
            g = (gq @ wt.t()).view(*grad.shape[:-1], w.shape[1])
        return cast_g, g.to(grad.dtype).to(state)  # the GEMM writes the output gradient's dtype; autograd the input's


class _Tiles:
    """Transformer Engine's ``Float8BlockScaling``: e4m3 throughout, one fp32 scale (a power of two, TE's default) per
    1x128 block of the input (along K) and of the output gradient (along N), and per 128x128 tile of the weight, so one
    weight cast serves both GEMMs. The scale is ``448 / amax`` rounded down to a power of two (1 for an all-zero block);
    a block at a dimension's edge that the 128 does not fill takes the amax of the values it holds, so every layer
    runs it."""

    SIZE = 128

    def __init__(self) -> None:
        self.element = FORMATS["e4m3fn"]

    def cannot_run(self, layer: nn.Linear) -> str | None:
        return None

    def clear(self) -> None:
        pass

    def _cast(self, x: Tensor, tile_rows: int) -> Tensor:
        """``x`` (2-d, finite, fp32) cast in tiles of ``tile_rows`` x 128, back in fp32."""
        rows, cols = x.shape
        padded = nn.functional.pad(x, (0, -cols % self.SIZE, 0, -rows % tile_rows))  # zeros: no block's amax moves
        tiles = padded.view(padded.shape[0] // tile_rows, tile_rows, -1, self.SIZE)
        amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
        scale = (self.element.max / amax).clamp(max=torch.finfo(torch.float32).max)  # fp32 amax near 0: TE's largest
        scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(scale))), 1.0)
        q = self.element.cast(tiles * scale).div_(scale)
        return q.view(padded.shape)[:rows, :cols]

    def _numerics(self, t: Tensor, tile_rows: int) -> tuple[Tensor, Tensor]:
        x, not_finite = _finite_rows(t)
        q = self._cast(x, tile_rows)
        return _cast_fields(x, q, not_finite, keep=True), q

    def forward(self, layer: nn.Linear, x: Tensor, xf: Tensor, w: Tensor, b: Tensor | None,
                output_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Any]:
        xa = _gemm_input(x, xf)
        (cast_x, xq), (cast_w, wq) = self._numerics(xa, 1), self._numerics(w, self.SIZE)
        with torch.autocast(x.device.type, enabled=False):
            y = nn.functional.linear(xq.view(xa.shape), wq, b)
        return cast_x, cast_w, y.to(output_dtype), x.dtype

    def backward(self, state: Any, grad: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        cast_g, gq = self._numerics(grad, 1)
        wq = self._cast(w, self.SIZE)  # cast again, not held from the forward: one more fp32 weight per layer
        with torch.autocast(grad.device.type, enabled=False):
            g = (gq @ wq).view(*grad.shape[:-1], w.shape[1])
        return cast_g, g.to(grad.dtype).to(state)  # the GEMM writes the output gradient's dtype; autograd the input's


_Emulator = _Torchao | _Blocks | _Tiles

# What each candidate format is measured as: torchao's recipes by their own casts; Transformer Engine's per-tensor
# recipes ("delayed", "current") by torchao's tensorwise cast, the same per-tensor e4m3/e5m2 scaling (delayed scaling's
# scale comes from earlier steps' amax: the current step's is what it converges to); block formats by their block casts.
CANDIDATE_CASTS = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_with_gw_hp": "rowwise_with_gw_hp",
                   "delayed": "tensorwise", "current": "tensorwise", "mxfp8": "mxfp8", "nvfp4": "nvfp4",
                   "block": "block"}


def _emulator(config: Any, owner: str) -> _Emulator:
    """What measures ``config``: a torchao ``Float8LinearConfig``, an ``MXFP8Recipe`` (its blocks), or a block format's
    name ("mxfp8", "nvfp4", "block")."""
    if isinstance(config, MXFP8Recipe):
        return _Blocks("mxfp8")
    if config == "block":
        return _Tiles()
    if isinstance(config, str) and config in BLOCK_FORMATS and config != "mxfp8_floor":
        return _Blocks(config)
    if dataclasses.is_dataclass(config) and hasattr(config, "cast_config_input"):
        return _Torchao(config)
    raise ValueError(f"{owner}: {config!r} is not what the probe measures: a torchao `Float8LinearConfig`, an"
                     " `MXFP8Recipe`, or a block format's name ('mxfp8', 'nvfp4', or 'block' for Transformer Engine's"
                     " 1x128 / 128x128 blocks).")


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

    def __init__(self, layers: Mapping[str, nn.Linear], emulators: list[_Emulator], keep_outputs: bool) -> None:
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
            if not torch.is_grad_enabled() or not isinstance(x, Tensor) or not isinstance(output, Tensor):
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
            with torch.autocast(x.device.type, enabled=False):  # the hook runs inside the forward's autocast
                ref = nn.functional.linear(xf, w, b)
            ref_finite = torch.isfinite(ref).all()
            states = []
            for i in measuring:
                cast_x, cast_w, y, state = self._emulators[i].forward(module, x, xf, w, b, output.dtype)
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
    """The probe for one format (see ``_Probe``; the module docstring): ``config`` is a torchao
    ``Float8LinearConfig``, an ``MXFP8Recipe``, or a block format's name ("mxfp8", "nvfp4", "block"). Holds, per layer,
    what its backward needs (the fp8 copy, or the weight's cast) until the backward. ``keep_outputs``: collect each
    forward's layer outputs in ``outputs`` (for a gradient-only backward; the caller empties it every step, since each
    output holds its step's graph). ``batches`` and ``dropped`` count the batches committed and dropped, summed across
    processes by ``result(reduce)``. ``skipped``: the layers the format cannot run ({fqn: why}), not measured and absent
    from the result."""

    def __init__(self, layers: Mapping[str, nn.Linear], config: Any, keep_outputs: bool = False) -> None:
        emulator = _emulator(config, "SensitivityProbe")
        self.config = emulator.config if isinstance(emulator, _Torchao) else config
        self.specs = emulator.specs if isinstance(emulator, _Torchao) else {}
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
        configs = [cast if cast in ("mxfp8", "nvfp4", "block") else torchao_config(cast, emulate=True)
                   for cast in self._casts]
        super().__init__(layers, [_emulator(config, "MultiProbe") for config in configs], keep_outputs)
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
