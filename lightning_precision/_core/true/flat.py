"""A chunk of the true-precision step on flat buffers (``workspace``, kept by ``chunks``): the widening of the
weights, gradients and states, the landing of the new weights and the encoding of the states, each a constant number of
ops for any number of parameters.

Lists of per-parameter tensors move in and out of the flat buffers with one ``torch._foreach_copy_`` each (torch's CUDA
kernel converts the dtype in the copy when every source shares one dtype and every destination another, and sizes and
strides match); everything between runs on the whole flat buffer at once. Per-parameter values (an fp16 state's power
of two) are one reduction over the list (``torch._foreach_norm``) and ``Workspace.per_element``.

Nothing is read from the device on an accelerator: every new weight goes through the element-wise check (a value not
finite, or out of the 16-bit range, keeps the old weight). On a CPU a read waits for nothing, and one pass tells
whether any value needs that check: mostly none does, and the check's passes are skipped (the same bits either way).

The results are the bits the per-parameter path (``rounding_policy`` and ``states``, the same functions of
``rounding``) gives on the same values, except the draws of stochastic rounding: one draw per chunk instead of one per
parameter (the weights first, then the states by name).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from lightning_precision._core.true.keys import FP16_TOP, SQUARED
from lightning_precision._core.true.rounding import split_remainder, stochastic_round
from lightning_precision._core.true.rounding_meter import RoundingMeter
from lightning_precision._core.true.workspace import Buffer, Workspace
from lightning_precision._upstream.torch import foreach_copy_, foreach_norm

__all__ = ["FLAT_FORMS", "decode_state", "encode_state", "land_weights", "reads_are_free", "widen_grads",
           "widen_weights"]

# How a state is stored that the flat path reads and writes: under its own name in the weight's dtype ("plain"; fp32 in
# a layer kept in fp32), at a power of two in fp16 ("f16"), as its two 16-bit halves ("float32").
FLAT_FORMS = ("plain", "f16", "float32")
# An fp32 value's 16-bit halves as the two int16 of its bytes: the high one second on a little-endian machine.
_HIGH_HALF, _LOW_HALF = (1, 0) if sys.byteorder == "little" else (0, 1)


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a tensor of ``device`` on the host waits for nothing (a CPU tensor)."""
    return device.type == "cpu"


def _halves(flat32: Tensor) -> tuple[Tensor, Tensor]:
    """The high and low 16-bit halves of each element of a flat fp32 tensor, as strided int16 views."""
    pairs = flat32.view(torch.int16)
    return pairs[_HIGH_HALF::2], pairs[_LOW_HALF::2]


def widen_weights(work: Workspace, weights: list[Tensor], remainders: list[Tensor | None] | None) -> Buffer:
    """The weights (one dtype) in fp32, with their remainders (``update="compensated"``; ``None`` where a parameter has
    none yet) added back; the remainders as they were stay in ``work``'s ``"remainder"`` buffer."""
    wide = work.buffer("weight", torch.float32)
    foreach_copy_(wide.views, weights)
    if remainders is None:
        return wide
    dtype = weights[0].dtype
    remainder = work.buffer("remainder", dtype)
    present = [(view, r) for view, r in zip(remainder.views, remainders, strict=True) if r is not None]
    if len(present) < len(remainders):
        remainder.flat.zero_()
    if present:
        foreach_copy_([view for view, _ in present], [r for _, r in present])
    if dtype == torch.bfloat16:  # the fp32 bit pattern is the bf16 one shifted up: the remainder is its low half
        wide.flat.view(torch.int32).add_(remainder.flat.view(torch.int16))
    else:
        wide.flat.add_(remainder.flat.view(torch.bfloat16))
    return wide


def widen_grads(work: Workspace, grads: list[Tensor], factor: Tensor | None, max_value: float | None) -> Buffer:
    """The gradients in fp32, times ``factor`` (the inverse loss scale, the clipping coefficient), clamped to
    ``max_value``: the per-parameter path's ``grad.float().mul_(factor).clamp_(...)``."""
    wide = work.buffer("grad", torch.float32)
    foreach_copy_(wide.views, grads)
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
        foreach_copy_(wide.views, stored)
        return wide
    dtype = stored[0].dtype
    raw = work.buffer("raw." + name, dtype)
    foreach_copy_(raw.views, stored)
    assert parts is not None
    if form == "float32":
        low = work.buffer("raw-low." + name, dtype)
        foreach_copy_(low.views, parts)
        high_half, low_half = _halves(wide.flat)
        high_half.copy_(raw.flat.view(torch.int16))
        low_half.copy_(low.flat.view(torch.int16))
        return wide
    exponents = torch.stack(parts).to(torch.int32).neg_()
    wide.flat.copy_(raw.flat)
    wide.flat.mul_(work.per_element(torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)))
    if name in SQUARED:
        wide.flat.square_()
    return wide


def _fits(new: Tensor, dtype: torch.dtype) -> bool:
    """Whether every value is finite and within ``dtype``'s range (so that no rounding makes it inf): one pass and one
    read (of a CPU tensor: ``reads_are_free``)."""
    limit = torch.finfo(dtype).max
    low, high = torch.aminmax(new)  # nan in either: False below
    return bool((high <= limit) & (low >= -limit))


def land_weights(work: Workspace, weights: list[Tensor], update: str, generator: torch.Generator | None,
                 meter: RoundingMeter | None) -> Buffer:
    """The stepped fp32 weights (``work``'s ``"weight"`` buffer) landed in ``weights``' dtype by ``update`` (not yet
    written: ``weights`` are the weights as they were), with their new remainders into ``"remainder"``
    (``"compensated"``). An element whose new value is not finite, or that the 16-bit format cannot hold, keeps its old
    weight and remainder: nothing non-finite is written. Returns the buffer of the weights to write."""
    dtype = work.weight_dtype
    wide = work.buffer("weight", torch.float32)
    new = wide.flat
    if meter is None and reads_are_free(new.device) and _fits(new, dtype):
        if dtype == torch.float32:
            return wide
        out = work.buffer("new", dtype)
        if update == "compensated":
            landed, fresh = split_remainder(new, dtype)
            out.flat.copy_(landed)
            work.buffer("remainder", dtype).flat.view(torch.int16).copy_(fresh)
        elif generator is not None:
            stochastic_round(new, dtype, generator, out=out.flat)
        else:
            out.flat.copy_(new)
        return out
    old = work.buffer("new", dtype)
    foreach_copy_(old.views, weights)
    bad = torch.isfinite(new).logical_not_()
    if dtype == torch.float32:
        old.flat.copy_(torch.where(bad, old.flat, new))
        return old
    clean = new.masked_fill(bad, 0.0)
    remainder = None
    if update == "compensated":
        landed, remainder = split_remainder(clean, dtype)
    elif generator is not None:
        landed = stochastic_round(clean, dtype, generator)
    else:
        landed = clean.to(dtype)
    keep = torch.isfinite(landed).logical_not_().logical_or_(bad)
    landed = torch.where(keep, old.flat, landed)
    kept = work.buffer("remainder", dtype).flat.view(torch.int16) if update == "compensated" else None
    if meter is not None:  # what the per-parameter path counts: a value out of range is an update that did not land
        before = old.flat.float()
        if kept is not None:
            before = before.view(torch.int32).add_(kept).view(torch.float32) if dtype == torch.bfloat16 \
                else before.add_(kept.view(torch.bfloat16))
        meter.add(old.flat, before, torch.where(bad, before, new), landed)
    if kept is not None and remainder is not None:
        kept.copy_(torch.where(keep, kept, remainder))
    old.flat.copy_(landed)
    return old


def encode_state(work: Workspace, name: str, form: str, dtype: torch.dtype,
                 generator: torch.Generator | None) -> tuple[list[Tensor], list[Tensor] | None]:
    """The stepped fp32 state ``name`` of every parameter of the chunk in its ``form`` for weights of ``dtype``: the
    tensors to copy into the stored values, and into the parts (powers of two, low halves; ``None`` for "plain")."""
    wide = work.buffer("state." + name, torch.float32)
    if dtype == torch.float32:
        return wide.views, None
    raw = work.buffer("raw." + name, dtype)
    if form == "float32":
        low = work.buffer("raw-low." + name, dtype)
        high_half, low_half = _halves(wide.flat)
        raw.flat.view(torch.int16).copy_(high_half)
        low.flat.view(torch.int16).copy_(low_half)
        return raw.views, low.views
    values = wide.flat
    exponents = None
    if form == "f16":
        largest = torch.stack(foreach_norm(wide.views, float("inf")))
        if name in SQUARED:
            values, largest = values.sqrt(), largest.sqrt()
        exponents = torch.where(largest > 0, FP16_TOP - torch.frexp(largest).exponent, 0).to(torch.int32)
        values = values * work.per_element(torch.ldexp(torch.ones_like(largest), exponents))
    if generator is not None:
        stochastic_round(values, dtype, generator, out=raw.flat)
    else:
        raw.flat.copy_(values)
    if exponents is None:
        return raw.views, None
    return raw.views, list(exponents.to(dtype).unbind())
