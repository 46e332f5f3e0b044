"""A chunk of the true-precision step on flat buffers (``_workspace``): the widening of the weights, gradients and
states, the landing of the new weights and the encoding of the states, each a constant number of ops for any number of
parameters.

Lists of per-parameter tensors move in and out of the flat fp32 buffers with one ``torch._foreach_copy_`` each (torch's
CUDA kernel converts the dtype in the copy when every source shares one dtype and every destination another, and sizes
and strides match); everything between runs on the whole flat buffer at once. Per-parameter values (an fp16 state's
power of two) are one reduction over the list (``torch._foreach_norm``) and ``Workspace.per_element``. Nothing here
reads the device from the host.

The results are the bits the per-parameter path (``TrueStep``'s loose path, the same functions of ``_rounding``) gives
on the same values, except the draws of stochastic rounding: one draw per chunk instead of one per parameter (the
weights first, then the states by name).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_precision._rounding import join_remainder, split_remainder, stochastic_round
from lightning_precision._rounding_meter import RoundingMeter
from lightning_precision._true_keys import FP16_TOP, SQUARED
from lightning_precision._workspace import Buffer, Workspace

__all__ = ["FLAT_FORMS", "decode_state", "encode_state", "land_weights", "widen_grads", "widen_weights"]

# How a state is stored that the flat path reads and writes: under its own name in the weight's dtype ("plain"; fp32 in
# a layer kept in fp32), at a power of two in fp16 ("f16"), as its two 16-bit halves ("float32").
FLAT_FORMS = ("plain", "f16", "float32")


def widen_weights(work: Workspace, weights: list[Tensor], remainders: list[Tensor | None] | None) -> Buffer:
    """The weights (one dtype) in fp32, with their remainders (``update="compensated"``; ``None`` where a parameter has
    none yet) added back. The weights as they were stay in ``work``'s ``"old"`` buffer (and the remainders in
    ``"remainder"``)."""
    dtype = weights[0].dtype
    old = work.buffer("old", dtype)
    torch._foreach_copy_(old.views, weights)
    wide = work.buffer("weight", torch.float32)
    if remainders is None:
        wide.flat.copy_(old.flat)
        return wide
    remainder = work.buffer("remainder", dtype)
    present = [(view, r) for view, r in zip(remainder.views, remainders, strict=True) if r is not None]
    if len(present) < len(remainders):
        remainder.flat.zero_()
    if present:
        torch._foreach_copy_([view for view, _ in present], [r for _, r in present])
    wide.flat.copy_(join_remainder(old.flat, remainder.flat.view(torch.int16)))
    return wide


def widen_grads(work: Workspace, grads: list[Tensor], factor: Tensor | None, max_value: float | None) -> Buffer:
    """The gradients in fp32, times ``factor`` (the inverse loss scale, the clipping coefficient), clamped to
    ``max_value``: the per-parameter path's ``grad.float().mul_(factor).clamp_(...)``."""
    wide = work.buffer("grad", torch.float32)
    torch._foreach_copy_(wide.views, grads)
    if factor is not None:
        wide.flat.mul_(factor.to(wide.flat.device))
    if max_value is not None:
        wide.flat.clamp_(-max_value, max_value)
    return wide


def decode_state(work: Workspace, name: str, form: str, stored: list[Tensor], parts: list[Tensor] | None) -> Buffer:
    """A state of every parameter of the chunk in fp32, from its ``form``: ``stored`` (its values, the fp16 values at a
    power of two, or the high halves) and ``parts`` (the powers of two, or the low halves)."""
    wide = work.buffer("state." + name, torch.float32)
    if form == "plain":
        torch._foreach_copy_(wide.views, stored)
        return wide
    dtype = stored[0].dtype
    raw = work.buffer("raw." + name, dtype)
    torch._foreach_copy_(raw.views, stored)
    assert parts is not None
    if form == "float32":
        low = work.buffer("raw-low." + name, dtype)
        torch._foreach_copy_(low.views, parts)
        high = raw.flat.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
        high.bitwise_or_(low.flat.view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF))
        wide.flat.copy_(high.view(torch.float32))
        return wide
    exponents = torch.stack(parts).to(torch.int32).neg_()
    wide.flat.copy_(raw.flat)
    wide.flat.mul_(work.per_element(torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)))
    if name in SQUARED:
        wide.flat.square_()
    return wide


def land_weights(work: Workspace, update: str, generator: torch.Generator | None,
                 meter: RoundingMeter | None) -> Buffer:
    """The stepped fp32 weights (``work``'s ``"weight"`` buffer) landed in the weights' dtype by ``update``, into the
    ``"old"`` buffer, with their new remainders into ``"remainder"`` (``"compensated"``). An element whose new value is
    not finite, or that the 16-bit format cannot hold, keeps its old weight and remainder: nothing non-finite is
    written. Returns the ``"old"`` buffer, now the weights to write."""
    dtype = work.weight_dtype
    new = work.buffer("weight", torch.float32).flat
    old = work.buffer("old", dtype).flat
    bad = torch.isfinite(new).logical_not_()
    if dtype == torch.float32:
        old.copy_(torch.where(bad, old, new))
        return work.buffer("old", dtype)
    clean = new.masked_fill(bad, 0.0)
    remainder = None
    if update == "compensated":
        landed, remainder = split_remainder(clean, dtype)
    elif generator is not None:
        landed = stochastic_round(clean, dtype, generator)
    else:
        landed = clean.to(dtype)
    keep = bad.logical_or_(torch.isfinite(landed).logical_not_())
    landed = torch.where(keep, old, landed)
    if meter is not None:
        old_remainder = work.buffer("remainder", dtype).flat.view(torch.int16) if update == "compensated" else None
        before = old.float() if old_remainder is None else join_remainder(old, old_remainder)
        meter.add(old, before, torch.where(keep, before, new), landed)
    if remainder is not None:
        kept = work.buffer("remainder", dtype).flat.view(torch.int16)
        kept.copy_(torch.where(keep, kept, remainder))
    old.copy_(landed)
    return work.buffer("old", dtype)


def encode_state(work: Workspace, name: str, form: str, dtype: torch.dtype,
                 generator: torch.Generator | None) -> tuple[list[Tensor], list[Tensor] | None]:
    """The stepped fp32 state ``name`` of every parameter of the chunk in its ``form`` for weights of ``dtype``: the
    tensors to copy into the stored values, and into the parts (powers of two, low halves; ``None`` for "plain")."""
    wide = work.buffer("state." + name, torch.float32)
    if dtype == torch.float32:
        return wide.views, None
    raw = work.buffer("raw." + name, dtype)
    if form == "float32":
        bits = wide.flat.view(torch.int32)
        raw.flat.copy_(bits.bitwise_right_shift(16).to(torch.int16).view(dtype))
        low = work.buffer("raw-low." + name, dtype)
        low.flat.copy_(bits.to(torch.int16).view(dtype))
        return raw.views, low.views
    values = wide.flat
    exponents = None
    if form == "f16":
        largest = torch.stack(torch._foreach_norm(wide.views, float("inf")))
        if name in SQUARED:
            values, largest = values.sqrt(), largest.sqrt()
        exponents = torch.where(largest > 0, FP16_TOP - torch.frexp(largest).exponent, 0).to(torch.int32)
        values = values * work.per_element(torch.ldexp(torch.ones_like(largest), exponents))
    raw.flat.copy_(stochastic_round(values, dtype, generator) if generator is not None else values.to(dtype))
    if exponents is None:
        return raw.views, None
    return raw.views, list(exponents.to(dtype).unbind())
