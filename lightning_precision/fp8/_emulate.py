"""How each low-precision format computes a linear layer, emulated on any device, and what its casts lose: the
per-format "emulators" the sensitivity probe (``_sensitivity``) runs beside the layer, and the cast numerics they
report.

Each emulator gives, for a layer's forward, the numerics of its input and weight casts and the layer's output in the
format; for its backward, those of the output gradient's cast and the input gradient in the format. torchao's
per-tensor and per-row recipes run through torchao's own ``Float8Linear`` (emulated); the block formats (MXFP8,
NVFP4) through the block casts of ``lightning_precision.formats``; Transformer Engine's ``Float8BlockScaling`` through
its 1x128 / 128x128 blocks written here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_precision import _imports
from lightning_precision._upstream import torchao as upstream
from lightning_precision._upstream.torchao import FLOAT8_EPS
from lightning_precision.formats import FORMATS, BlockFormat, NumberFormat, get_format
from lightning_precision.fp8._selection import HYBRID_FORMAT, TENSORS

__all__ = [
    "CANDIDATE_CASTS",
    "BlockEmulator",
    "CastSpec",
    "Emulator",
    "TORCHAO_EPS",
    "TileEmulator",
    "TorchaoEmulator",
    "block_cast_numerics",
    "cast_numerics",
    "cast_specs",
    "fp8_grad_input",
    "squares_sum",
    "torchao_scale",
]

TORCHAO_EPS = FLOAT8_EPS  # torchao's floor under amax (tests/upstream/test_upstream_torchao.py checks it)


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


def squares_sum(t: Tensor, buffer: Tensor | None = None) -> Tensor:
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
    noise = squares_sum(q - x if keep else q.sub_(x), buffer)
    signal = squares_sum(x, buffer)
    # torch.full, not torch.tensor: a host-to-device copy from pageable memory would wait for the device.
    return torch.cat([torch.stack([signal, noise]), counts,
                      torch.full((1,), x.numel(), dtype=torch.float64, device=x.device)])


def cast_numerics(t: Tensor, spec: CastSpec) -> Tensor:
    """``[signal power, noise power, non-zero, underflow, non-finite, elements]`` of casting ``t`` to fp8 as torchao
    does (scale ``max / max(amax, EPS)`` in fp64 then fp32, rounded down to a power of two if asked, saturating cast),
    in fp64 on ``t``'s device. Non-finite values are left out of the powers.

    Each figure is the one the straightforward expression gives (tests/sensitivity_reference.py keeps it, and
    tests/fp8/test_sensitivity_equal.py holds this to it), computed with fewer passes and temporaries: in-place steps,
    one fp64 buffer for both powers, ``|x| < inf`` for ``isfinite``."""
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


def fp8_grad_input(fp8: Any, grad_output: Tensor) -> Tensor:
    """The input gradient a torchao ``Float8Linear`` computes in its backward, for ``grad_output``: its casts of the
    output gradient (``cast_config_grad_output``) and of the weight (``cast_config_weight_for_grad_input``), and their
    matmul, as ``matmul_with_hp_or_float8_args.backward`` does them, without the weight gradient that backward also
    computes (the probe reads only the input gradient: a third of the work, and an fp32 input beside a bf16 output
    gradient made that hp weight gradient fail). tests/fp8/test_sensitivity_equal.py holds it to torchao's own
    backward."""
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


class TorchaoEmulator:
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


class _Recast:
    """A format whose casts are written here (``cast``) and whose GEMMs are emulated in fp32: the output from the input
    (in the autocast dtype, as the layer reads it) and the weight (its fp32 master, as torchao casts it), the input
    gradient from the output gradient and the weight as that GEMM reads it (``weight_for_grad_input``); each product
    then rounded to the dtype the real GEMM writes (the layer's output dtype; the output gradient's, then autograd's
    input dtype). The weight's numerics are those of its forward cast; its backward cast shows in the input gradient's
    error."""

    def cannot_run(self, layer: nn.Linear) -> str | None:
        return None

    def clear(self) -> None:
        pass

    def cast(self, t: Tensor, tensor: str) -> tuple[Tensor, Tensor]:
        """The six fields of ``t``'s cast and the cast (fp32, rows of the last dimension); ``tensor``: one of
        ``TENSORS``."""
        raise NotImplementedError

    def weight_for_grad_input(self, w: Tensor) -> Tensor:
        """The weight (N x K, fp32) as the input-gradient GEMM reads it, cast."""
        raise NotImplementedError

    def forward(self, layer: nn.Linear, x: Tensor, xf: Tensor, w: Tensor, b: Tensor | None,
                output_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Any]:
        xa = _gemm_input(x, xf)
        (cast_x, xq), (cast_w, wq) = self.cast(xa, "input"), self.cast(w, "weight")
        with torch.autocast(x.device.type, enabled=False):
            y = nn.functional.linear(xq.view(xa.shape), wq, b)
        return cast_x, cast_w, y.to(output_dtype), x.dtype

    def backward(self, state: Any, grad: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        cast_g, gq = self.cast(grad, "grad_output")
        with torch.autocast(grad.device.type, enabled=False):
            g = (gq @ self.weight_for_grad_input(w)).view(*grad.shape[:-1], w.shape[1])
        return cast_g, g.to(grad.dtype).to(state)


class BlockEmulator(_Recast):
    """A block-scaled format (MXFP8, NVFP4) with its real casts (``formats.BlockFormat.cast``: each block at its own
    scale, NVFP4's tensor scale from the whole tensor): input and weight in blocks along K (``in_features``) for the
    output, output gradient and weight in blocks along N (``out_features``) for the input gradient. A layer whose K or
    N the block does not divide cannot run the format."""

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

    def cast(self, t: Tensor, tensor: str) -> tuple[Tensor, Tensor]:
        return block_cast_numerics(t, self.format)

    def weight_for_grad_input(self, w: Tensor) -> Tensor:
        return self.format.cast(w.t()).t()  # blocks along N


class TileEmulator(_Recast):
    """Transformer Engine's ``Float8BlockScaling``: e4m3 throughout, one fp32 scale (a power of two, TE's default) per
    1x128 block of the input (along K) and of the output gradient (along N), and per 128x128 tile of the weight, so one
    weight cast serves both GEMMs (cast again in the backward, not held: one fp32 weight less per layer). The scale is
    ``448 / amax`` rounded down to a power of two (1 for an all-zero block); a block at a dimension's edge that the 128
    does not fill takes the amax of the values it holds, so every layer runs it."""

    SIZE = 128

    def __init__(self) -> None:
        self.element = FORMATS["e4m3fn"]

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

    def cast(self, t: Tensor, tensor: str) -> tuple[Tensor, Tensor]:
        x, not_finite = _finite_rows(t)
        q = self._cast(x, self.SIZE if tensor == "weight" else 1)
        return _cast_fields(x, q, not_finite, keep=True), q

    def weight_for_grad_input(self, w: Tensor) -> Tensor:
        return self._cast(w, self.SIZE)


Emulator = TorchaoEmulator | BlockEmulator | TileEmulator

# What each candidate format is measured as: torchao's recipes by their own casts; Transformer Engine's per-tensor
# recipes ("delayed", "current") by torchao's tensorwise cast, the same per-tensor e4m3/e5m2 scaling (delayed scaling's
# scale comes from earlier steps' amax: the current step's is what it converges to); block formats by their block casts.
CANDIDATE_CASTS = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_with_gw_hp": "rowwise_with_gw_hp",
                   "delayed": "tensorwise", "current": "tensorwise", "mxfp8": "mxfp8", "nvfp4": "nvfp4",
                   "block": "block"}
