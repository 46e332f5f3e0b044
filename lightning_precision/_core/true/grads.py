"""The gradients of the true-precision step in fp32: the clipping asked for, the factor of the total norm's clipping,
and one gradient widened, unscaled and clipped (the per-parameter path; the flat path's is ``true_flat.widen_grads``).

The 16-bit gradients stay as they are (an fp16 one at its loss scale): unscaled in place, fp16 gradients would flush.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_precision._core.true.shards import local_part
from lightning_precision._upstream.torch import foreach_norm

__all__ = ["ClipRequest", "norm_factor", "widen_grad"]


@dataclass(frozen=True)
class ClipRequest:
    """Gradient clipping asked for this step, done in fp32 inside it: ``max_norm`` (total norm of ``norm_type``) or
    ``max_value`` (each element)."""

    max_norm: float | None = None
    norm_type: float = 2.0
    max_value: float | None = None


def norm_factor(params: list[Tensor], grad_of: Callable[[Tensor], Tensor], factor: Tensor | None,
                clip: ClipRequest) -> Tensor | None:
    """``factor`` times the clipping coefficient of the total gradient norm, computed in fp32 (a 16-bit norm of fp16
    gradients at a loss scale overflows): one ``torch._foreach_norm`` per device and dtype. A DTensor's norm is reduced
    across its mesh."""
    if not params:
        return factor
    from torch.distributed.tensor import DTensor

    norms: list[Tensor] = []
    plain: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in params:
        grad = grad_of(p)
        if isinstance(grad, DTensor) or grad.is_sparse:
            values = grad.coalesce().values() if grad.is_sparse else grad
            norm = torch.linalg.vector_norm(values, clip.norm_type, dtype=torch.float32)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        else:
            plain.setdefault((grad.device, grad.dtype), []).append(grad)
    for grads in plain.values():
        norms.extend(foreach_norm(grads, clip.norm_type, dtype=torch.float32))
    device = local_part(params[0]).device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), clip.norm_type)
    if factor is not None:
        total = total * factor
    coefficient = (clip.max_norm / (total + 1e-6)).clamp(max=1.0)
    return coefficient if factor is None else factor * coefficient


def widen_grad(grad: Tensor, factor: Tensor | None, max_value: float | None, sparse: bool) -> Tensor:
    """The gradient in fp32, unscaled and clipped. A sparse one (an embedding with ``sparse=True``) is made dense (its
    optimizer's momentum would be sparse, not storable in 16 bits), except for an optimizer that takes sparse gradients
    only (``sparse``: SparseAdam, whose states are dense): its values widened."""
    grad = local_part(grad)
    if grad.is_sparse and sparse:
        grad = grad.coalesce()
        values = _unscaled(grad.values().float(), factor, max_value)
        return torch.sparse_coo_tensor(grad.indices(), values, grad.shape, is_coalesced=True)
    if grad.is_sparse:
        grad = grad.to_dense()
    return _unscaled(grad.float(), factor, max_value)


def _unscaled(values: Tensor, factor: Tensor | None, max_value: float | None) -> Tensor:
    """``values`` (an fp32 copy) times ``factor``, clamped to ``max_value``, in place."""
    if factor is not None:
        values.mul_(factor.to(values.device))
    if max_value is not None:
        values.clamp_(-max_value, max_value)
    return values
