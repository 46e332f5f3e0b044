"""The sensitivity probe's measurement as it was written before it was made cheaper, kept as the reference that
tests/fp8/test_sensitivity_equal.py holds the probe to: every figure it measures must stay the same float.

Its bookkeeping (staging, commit, the sums' layout, ``result``) is the probe's own; what is kept here is what computes
the numbers: the cast's numerics (float64 sums over float64 copies), a new torchao ``Float8Linear`` per layer per step
(whose backward also computes the weight's fp8 gradient) and the fp32 reference results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_precision import _imports
from lightning_precision.fp8._sensitivity import CastSpec, SensitivityProbe, torchao_scale

FIELDS = 6  # per tensor: signal power, noise power, non-zero, underflows, non-finite, elements


def reference_cast_numerics(t: Tensor, spec: CastSpec) -> Tensor:
    x = t.detach().float()
    x = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    finite = torch.isfinite(x)
    x = torch.where(finite, x, torch.zeros_like(x))
    amax = x.abs().amax(dim=-1, keepdim=True) if spec.axiswise else x.abs().amax()
    fmax = torch.finfo(spec.dtype).max
    scale = torchao_scale(amax, fmax, spec.pow2)
    q = (x * scale).clamp(-fmax, fmax).to(spec.dtype).float()
    noise = (q / scale - x).double().pow(2).sum()
    nonzero = x != 0
    return torch.stack([x.double().pow(2).sum(), noise, nonzero.sum().double(), (nonzero & (q == 0)).sum().double(),
                        (~finite).sum().double(), torch.full((), x.numel(), dtype=torch.float64, device=x.device)])


class ReferenceProbe(SensitivityProbe):
    """The probe's hooks as they were: measures the same layers, beside the probe under test, on the same passes."""

    def __init__(self, layers: Any, config: Any, keep_outputs: bool = False) -> None:
        super().__init__(layers, config, keep_outputs)
        self.config = dataclasses.replace(config, emulate=True, enable_fsdp_float8_all_gather=False)

    def _fp8_copy(self, layer: nn.Linear) -> nn.Module:
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
            self.ran = True
            if x.numel() == 0:
                return
            n = FIELDS
            cast_x = reference_cast_numerics(x, self.specs["input"])
            cast_w = reference_cast_numerics(module.weight, self.specs["weight"])
            x8 = x.detach().requires_grad_()
            y8 = self._fp8_copy(module)(x8)
            w = module.weight.detach().float()
            b = module.bias.detach().float() if module.bias is not None else None
            with torch.autocast(x.device.type, enabled=False):
                ref = nn.functional.linear(x.detach().float(), w, b)
            finite = (cast_x[4] == 0) & (cast_w[4] == 0) & torch.isfinite(ref).all()
            self._add(fqn, slice(0, n), cast_x, finite)
            self._add(fqn, slice(n, 2 * n), cast_w, finite)
            self._add(fqn, slice(3 * n, 3 * n + 2), torch.stack([(y8.float() - ref).double().pow(2).sum(),
                                                                ref.double().pow(2).sum()]), finite)
            if output.requires_grad:
                output.register_hook(self._reference_backward(fqn, x8, y8, w))
                if self.keep_outputs:
                    self.outputs.append(output)

        return hook

    def _reference_backward(self, fqn: str, x8: Tensor, y8: Tensor, w: Tensor) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            n = FIELDS
            cast_g = reference_cast_numerics(grad, self.specs["grad_output"])
            (g8,) = torch.autograd.grad(y8, x8, grad.to(y8.dtype))
            with torch.autocast(grad.device.type, enabled=False):
                ref = grad.detach().float() @ w
            finite = (cast_g[4] == 0) & torch.isfinite(ref).all()
            self._add(fqn, slice(2 * n, 3 * n), cast_g, finite)
            self._add(fqn, slice(3 * n + 2, 3 * n + 4), torch.stack([(g8.float() - ref).double().pow(2).sum(),
                                                                    ref.double().pow(2).sum()]), finite)

        return hook
