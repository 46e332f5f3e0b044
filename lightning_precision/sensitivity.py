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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_precision import _imports
from lightning_precision import fp8 as _fp8
from lightning_precision.formats import get_format
from lightning_precision.fp8 import HYBRID_FORMAT, TENSORS

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
    "fp8_sensitivity",
]

# torchao clamps amax to this before dividing (torchao.float8.float8_utils.EPS; tests/test_sensitivity.py pins it):
# a tensor whose amax is below it gets a capped scale, and its values may flush to zero.
TORCHAO_EPS = 1e-12

Reduce = Callable[[Tensor], Tensor]
# Per tensor, accumulated over batches: signal power, noise power, non-zero values, underflows, non-finite, elements.
_NUMERIC_FIELDS = 6


@dataclass(frozen=True)
class CastSpec:
    """How one tensor is cast: the fp8 dtype, per-row (``axiswise``) or per-tensor scale, power-of-two scales."""

    dtype: torch.dtype
    axiswise: bool
    pow2: bool


def cast_specs(config: Any) -> dict[str, CastSpec]:
    """The ``CastSpec`` of input, weight and grad_output under a torchao ``Float8LinearConfig``."""
    ScalingGranularity = _imports.import_quietly("torchao.float8.config").ScalingGranularity

    specs = {}
    for tensor in TENSORS:
        cast = getattr(config, f"cast_config_{tensor}")
        default = get_format(HYBRID_FORMAT[tensor]).dtype  # torchao's when the config names none
        specs[tensor] = CastSpec(getattr(cast, "target_dtype", None) or default,
                                 cast.scaling_granularity == ScalingGranularity.AXISWISE,
                                 bool(getattr(config, "round_scales_to_power_of_2", False)))
    return specs


def cast_numerics(t: Tensor, spec: CastSpec) -> Tensor:
    """``[signal power, noise power, non-zero, underflow, non-finite, elements]`` of casting ``t`` to fp8 as torchao
    does (scale ``max / max(amax, EPS)`` in fp64 then fp32, rounded down to a power of two if asked, saturating cast),
    in fp64 on ``t``'s device. Non-finite values are left out of the powers."""
    x = t.detach().float()
    x = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    finite = torch.isfinite(x)
    x = torch.where(finite, x, torch.zeros_like(x))
    amax = x.abs().amax(dim=-1, keepdim=True) if spec.axiswise else x.abs().amax()
    fmax = torch.finfo(spec.dtype).max
    scale = (fmax / amax.double().clamp(min=TORCHAO_EPS)).float()
    if spec.pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (x * scale).clamp(-fmax, fmax).to(spec.dtype).float()
    noise = (q / scale - x).double().pow(2).sum()
    nonzero = x != 0
    # torch.full, not torch.tensor: a host-to-device copy from pageable memory would wait for the device.
    return torch.stack([x.double().pow(2).sum(), noise, nonzero.sum().double(), (nonzero & (q == 0)).sum().double(),
                        (~finite).sum().double(), torch.full((), x.numel(), dtype=torch.float64, device=x.device)])


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
    if ref == 0:
        return 0.0 if err == 0 else math.inf
    return math.sqrt(err / ref)


def _sum_across_processes(t: Tensor) -> Tensor:
    """All processes' sum (plain torch.distributed: Fabric and the Trainer alike), so every rank decides alike."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t)
    return t


class SensitivityProbe:
    """Forward hooks on the given linear layers that measure each training forward and backward (see the module
    docstring) and accumulate on the device; ``result(reduce)`` reads them once (``reduce`` sums across processes, so
    every rank decides on the same numbers). Holds, per layer, the fp8 copy's input and output until the backward.
    ``keep_outputs``: collect each forward's layer outputs in ``outputs`` (for a gradient-only backward; the caller
    empties it every step, since each output holds its step's graph)."""

    def __init__(self, layers: Mapping[str, nn.Linear], config: Any, keep_outputs: bool = False) -> None:
        config = dataclasses.replace(config, emulate=True, enable_fsdp_float8_all_gather=False)
        self.specs = cast_specs(config)
        self.config = config
        self.layers = dict(layers)
        self.batches = 0
        # Per layer: 3 tensors x _NUMERIC_FIELDS, then output error/ref powers and grad-input error/ref powers.
        self._sums: dict[str, Tensor] = {}
        self.keep_outputs = keep_outputs
        self.outputs: list[Tensor] = []  # this step's layer outputs: where a gradient-only backward must reach
        self._handles = [m.register_forward_hook(self._forward(fqn)) for fqn, m in self.layers.items()]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _add(self, fqn: str, index: slice, values: Tensor) -> None:
        sums = self._sums.get(fqn)
        if sums is None:
            sums = self._sums[fqn] = torch.zeros(3 * _NUMERIC_FIELDS + 4, dtype=torch.float64, device=values.device)
        sums[index] += values.to(sums.device)

    def _fp8_copy(self, layer: nn.Linear) -> nn.Module:
        """torchao's ``Float8Linear`` over the layer's current weight and bias (views, no gradient of their own): the
        layer's forward and backward in fp8, without touching its parameters or their ``.grad``."""
        convert = _imports.import_quietly("torchao.float8").convert_to_float8_training
        shadow = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        shadow.weight = nn.Parameter(layer.weight.detach(), requires_grad=False)
        if layer.bias is not None:
            shadow.bias = nn.Parameter(layer.bias.detach(), requires_grad=False)
        return convert(shadow, config=self.config)

    def _forward(self, fqn: str) -> Callable[..., None]:
        def hook(module: nn.Linear, args: tuple, output: Any) -> None:
            x = args[0] if args else None
            if not torch.is_grad_enabled() or not isinstance(x, Tensor) or not isinstance(output, Tensor):
                return
            n = _NUMERIC_FIELDS
            self._add(fqn, slice(0, n), cast_numerics(x, self.specs["input"]))
            self._add(fqn, slice(n, 2 * n), cast_numerics(module.weight, self.specs["weight"]))
            x8 = x.detach().requires_grad_()
            y8 = self._fp8_copy(module)(x8)
            w = module.weight.detach().float()
            b = module.bias.detach().float() if module.bias is not None else None
            with torch.autocast(x.device.type, enabled=False):  # the hook runs inside the forward's autocast
                ref = nn.functional.linear(x.detach().float(), w, b)
            self._add(fqn, slice(3 * n, 3 * n + 2), torch.stack([(y8.float() - ref).double().pow(2).sum(),
                                                                ref.double().pow(2).sum()]))
            if output.requires_grad:
                output.register_hook(self._backward(fqn, x8, y8, w))
                if self.keep_outputs:
                    self.outputs.append(output)

        return hook

    def _backward(self, fqn: str, x8: Tensor, y8: Tensor, w: Tensor) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            n = _NUMERIC_FIELDS
            self._add(fqn, slice(2 * n, 3 * n), cast_numerics(grad, self.specs["grad_output"]))
            (g8,) = torch.autograd.grad(y8, x8, grad.to(y8.dtype))
            with torch.autocast(grad.device.type, enabled=False):
                ref = grad.detach().float() @ w
            self._add(fqn, slice(3 * n + 2, 3 * n + 4), torch.stack([(g8.float() - ref).double().pow(2).sum(),
                                                                    ref.double().pow(2).sum()]))

        return hook

    def result(self, reduce: Optional[Reduce] = None) -> dict[str, LayerSensitivity]:
        """Per layer that ran (on any process): its ``LayerSensitivity`` over the batches so far (one device read).
        ``reduce`` gets one row for every probed layer, ran or not, so the all-reduce has the same shape on every
        rank even when a layer runs on some ranks only (data-dependent routing)."""
        if not self.layers:
            return {}
        device = next(iter(self._sums.values())).device if self._sums else \
            next(iter(self.layers.values())).weight.device
        width = 3 * _NUMERIC_FIELDS + 4
        stacked = torch.stack([self._sums.get(fqn, torch.zeros(width, dtype=torch.float64, device=device))
                               for fqn in self.layers])
        if reduce is not None:
            stacked = reduce(stacked)
        n = _NUMERIC_FIELDS
        out = {}
        for (fqn, layer), row in zip(self.layers.items(), stacked.cpu()):
            if row[n - 1] == 0:  # the input's element count: the layer never ran while measured
                continue
            numerics = [_numerics(row[i * n : (i + 1) * n]) for i in range(3)]
            out_err, out_ref, gin_err, gin_ref = row[3 * n :].tolist()
            out[fqn] = LayerSensitivity(fqn, layer.in_features, layer.out_features, *numerics,
                                        output_error=_relative(out_err, out_ref),
                                        grad_input_error=_relative(gin_err, gin_ref), batches=self.batches)
        return out


LossFn = Callable[[nn.Module, Any], Tensor]


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
    recipe: Union[str, Any] = "tensorwise",
    loss_fn: Optional[LossFn] = None,
    layers: Optional[Iterable[str]] = None,
    autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
) -> dict[str, LayerSensitivity]:
    """Measure, per linear layer, what fp8 under ``recipe`` would lose on these batches (see the module docstring).

    Forward and backward run on each batch (``loss_fn(model, batch)``, by default the model's scalar output or its
    ``.loss``) under ``autocast_dtype`` autocast, as training would; gradients are taken with respect to the layers'
    outputs only, so no parameter's ``.grad`` changes and the weights are not updated. ``layers``: the paths to measure
    (default: every ``nn.Linear`` whose forward runs). ``recipe``: a torchao recipe name or ``Float8LinearConfig``.
    torchao must be installed; it runs emulated, so any device works.
    """
    config = _fp8.torchao_config(recipe, emulate=True)
    linears = {fqn: m for fqn, m, _ in _fp8._linear_layers(model)}
    functional = _fp8.functional_linears(model)
    wanted = list(layers) if layers is not None else [f for f, m in linears.items() if id(m) not in functional]
    unknown = [f for f in wanted if f not in linears]
    if unknown:
        raise ValueError(f"fp8_sensitivity(layers=...): not nn.Linear layers of the model: {', '.join(unknown)}.")
    probe = SensitivityProbe({f: linears[f] for f in wanted}, config, keep_outputs=True)
    loss_fn = loss_fn or _default_loss
    device = next(model.parameters()).device
    try:
        for batch in batches:
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = loss_fn(model, batch)
            outputs, probe.outputs = probe.outputs, []
            if outputs:  # the layers' output gradients only: no parameter's .grad is written
                torch.autograd.grad(loss, outputs, allow_unused=True)
            probe.batches += 1
    finally:
        probe.close()
    return probe.result()

