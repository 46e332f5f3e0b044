"""How the true-precision step stores an optimizer's states (``optimizer_states``), under the keys of ``keys``:
each read into fp32 for the optimizer (``StateCodec.decode``) and written back after its step (``StateCodec.encode``),
one parameter at a time; and the forms the flat path reads and writes on its buffers (``stored_form``,
``stored_keys``).

An fp16 state is kept at a power of two (``lp.f16.<state>`` and ``lp.exp.<state>``) so that Adam's second moment does
not flush to zero, a sum of squares as its square root, whose range is the gradients'; an fp32 value as its two 16-bit
halves (``lp.hi.<state>``/``lp.lo.<state>``); an 8-bit state as its codes, two to an element, and its fp32 block scales
(``lp.q8.<state>``/``lp.q8scale.<state>``): torchao's ``OptimState8bit`` quantizes and dequantizes, but is not what is
stored, because ``torch.load`` cannot rebuild a tensor subclass under the callable ``map_location`` that Lightning's
Trainer and ``fabric.load`` pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_precision import _imports
from lightning_precision._core.true.keys import (
    BLOCK,
    CODES,
    EXP,
    FP16_TOP,
    HIGH,
    LOW,
    MIN_8BIT,
    NON_NEGATIVE,
    SCALED,
    SCALES,
    SQUARED,
    is_low_bit,
    is_moment,
    is_own_key,
    is_scalar_fp32,
)
from lightning_precision._core.true.rounding import stochastic_round
from lightning_precision._core.true.shards import is_sharded, like, like_flat, local_part, shard_count
from lightning_precision._upstream.torch import foreach_mul

__all__ = ["StateCodec", "clone_all", "fits_8bit", "own_state_bytes", "stored_form", "stored_keys"]


def fits_8bit(p: Tensor, local: Tensor) -> bool:
    """Whether a state is stored in 8 bits: a whole number of torchao's blocks, not a small tensor; and, sharded, only
    when every rank's shard is of this one's size, so that one DTensor is 8-bit on every rank or on none (mixed, a
    full checkpoint or a load into another number of ranks would gather 8-bit codes with 16-bit values)."""
    if local.numel() < MIN_8BIT or local.numel() % BLOCK:
        return False
    return not is_sharded(p) or local.numel() * shard_count(p) == p.numel()


def own_state_bytes(value: Any) -> int:
    """Bytes a state tensor holds on this rank (an 8-bit state's codes, block scales and map)."""
    if not isinstance(value, Tensor):
        return 0
    local = local_part(value)
    if is_low_bit(local):  # the tensors it is made of (an 8-bit state's codes, block scales and map)
        names, _ = local.__tensor_flatten__()  # type: ignore[attr-defined]
        parts = [getattr(local, name) for name in names]
        return sum(t.numel() * t.element_size() for t in parts)
    return local.numel() * local.element_size()


def stored_form(key: Any, value: Any, p: Tensor) -> tuple[str, str] | None:
    """(state name, form) of a stored entry the flat path can read: a moment under its own name ("plain"), at a power
    of two ("f16"), or as its two halves ("float32"); ``None`` for any other entry."""
    if not isinstance(key, str):
        return None
    if key.startswith(SCALED):
        return key[len(SCALED):], "f16"
    if key.startswith(HIGH):
        return (key[len(HIGH):], "float32") if value.shape == p.shape and p.dim() > 0 else None
    local = local_part(value) if is_moment(key, value, p) else None
    if local is not None and not is_low_bit(local) and local.dtype == local_part(p).dtype:
        return key, "plain"  # (a state of another dtype, such as Adagrad's fp32 sum made before the model was cast,
    return None  # goes the per-parameter way, which stores it in the weight's dtype)


def stored_keys(name: str, form: str) -> tuple[str, str | None]:
    """The state keys a state of ``form`` is stored under: its values, and its parts (powers of two, low halves)."""
    if form == "f16":
        return SCALED + name, EXP + name
    if form == "float32":
        return HIGH + name, LOW + name
    return name, None


def clone_all(tensors: list[Tensor]) -> list[Tensor]:
    """Copies of ``tensors`` (the optimizer's step counters), one op per device and dtype (``x * 1`` keeps every bit,
    -0.0 and NaN included); a bool tensor by itself."""
    copies: list[Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if type(t) is not Tensor or t.dtype == torch.bool or t.is_complex():
            copies[i] = t.clone()
        else:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for members in groups.values():
        for i, copy in zip(members, foreach_mul([tensors[i] for i in members], 1), strict=True):
            copies[i] = copy
    return copies  # type: ignore[return-value]


def _halves(value: Tensor, local: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """An fp32 ``local`` as its high and low 16-bit halves in ``dtype``, each made as ``value`` is."""
    bits = local.contiguous().view(torch.int32)
    return (like(value, bits.bitwise_right_shift(16).to(torch.int16).view(dtype)),
            like(value, bits.to(torch.int16).view(dtype)))


class StateCodec:
    """The optimizer states of a ``TrueStep``, stored as ``states`` (``"weight"``, ``"float32"`` or ``"8bit"``) asks."""

    def __init__(self, states: str) -> None:
        self.states = states
        self._8bit: Any = None
        self._qmaps: dict[tuple[bool, torch.device], Tensor] = {}

    def target_form(self, p: Tensor, local: Tensor) -> str:
        """How the step stores a moment of ``p`` now: a form of ``true_flat.FLAT_FORMS``, or ``"other"`` (8-bit)."""
        if local.dtype == torch.float32:
            return "plain"
        if self.states == "float32":
            return "float32"
        if self.states == "8bit" and fits_8bit(p, local):
            return "other"
        if local.dtype == torch.float16:  # at a power of two, one for the whole tensor: sharded, its largest is global
            return "other" if is_sharded(p) else "f16"
        return "plain"

    def decode(self, p: Tensor, stored: dict[str, Any], clones: dict[tuple[int, Any], Tensor] | None = None,
               position: int = 0) -> dict[str, Any]:
        """The parameter's states as its optimizer keeps them, in fp32 where they are stored otherwise. A plain tensor
        that is not a moment (a step counter) is copied: the optimizer updates it in place, and a step that fails or is
        interrupted gives the parameter back its state as it was (copied here, or by the caller, together, when
        ``clones`` collects them)."""
        states: dict[str, Any] = {}
        for key, value in stored.items():
            if isinstance(key, str) and key.startswith(HIGH):
                name = key[len(HIGH):]
                high = local_part(value).view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
                low = local_part(stored[LOW + name]).view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)
                states[name] = like(value, high.bitwise_or_(low).view(torch.float32))
            elif isinstance(key, str) and key.startswith(SCALED):
                name = key[len(SCALED):]
                values = local_part(value).float()
                widened = torch.ldexp(values, -local_part(stored[EXP + name]).to(value.device, torch.int32))
                states[name] = like(p, widened.square() if name in SQUARED else widened)
            elif isinstance(key, str) and key.startswith(CODES):
                states[key[len(CODES):]] = like(p, self._dequantize(p, key[len(CODES):], local_part(value), stored))
            elif is_own_key(key) or (isinstance(key, str) and HIGH + key in stored):
                continue  # (a value also kept as its halves: read from them, exact)
            elif not is_moment(key, value, p):
                if type(value) is Tensor and clones is not None:
                    clones[(position, key)] = value
                    states[key] = value
                else:
                    states[key] = value.clone() if isinstance(value, Tensor) else value
            elif is_low_bit(local_part(value)):
                # A torchao low-bit optimizer's state: already compact, and read and written by that optimizer itself
                # (in place: a step that fails inside it may leave it updated).
                states[key] = value
            else:
                widened = local_part(value).to(torch.float32, copy=True)  # (fp32 already in a layer kept so: copied)
                states[key] = like(p, widened)
        return states

    def encode_all(self, new_state: dict[str, Any], p: Tensor, own: dict[str, Any],
                   generator: torch.Generator | None) -> None:
        """The optimizer's stepped states of ``p`` stored into ``own`` (its new state)."""
        for key, value in new_state.items():
            encoded = self.encode(key, value, p, own, generator)
            if encoded is not None:
                own[key] = encoded

    def encode(self, key: Any, value: Any, p: Tensor, own: dict[str, Any], generator: torch.Generator | None) -> Any:
        """State ``key`` of ``p`` as it is stored under that name (None: only under keys of ours, set in ``own``)."""
        weight_dtype = local_part(p).dtype
        if weight_dtype != torch.float32 and is_scalar_fp32(key, value, p):
            # Also as its two halves, which the step reads: torch's load casts it to the weight dtype (a resumed run
            # would differ). Kept under its name too: the optimizer's own load requires it there (ASGD's `eta`).
            own[HIGH + str(key)], own[LOW + str(key)] = _halves(value, local_part(value), weight_dtype)
            return value
        if not is_moment(key, value, p) or weight_dtype == torch.float32 or is_low_bit(local_part(value)):
            return value
        local = local_part(value).float()
        if self.states == "float32":
            own[HIGH + str(key)], own[LOW + str(key)] = _halves(p, local, weight_dtype)
            return None
        if self.states == "8bit" and fits_8bit(p, local):
            quantized = self._optim_state_8bit().zeros(local.shape, signed=key not in NON_NEGATIVE,
                                                       block_size=BLOCK, device=local.device)
            quantized.copy_(local)
            own[CODES + str(key)] = like_flat(p, quantized.codes.reshape(-1).view(torch.int16).view(weight_dtype))
            own[SCALES + str(key)] = like_flat(p, quantized.scale.view(torch.int16).view(weight_dtype))
            return None
        if weight_dtype == torch.float16 and value.numel() > 0:  # (an empty state has no largest element)
            # fp16 would flush a second moment of small gradients to zero (and the next update would divide by ~0):
            # stored at a power of two that puts its largest element near 2**14, one for the whole (sharded) tensor so
            # that a checkpoint holds one value for every rank; a sum of squares as its square root (SQUARED).
            largest = value.abs().amax()
            largest = local_part(largest.full_tensor() if is_sharded(largest) else largest)
            if key in SQUARED:
                local, largest = local.sqrt(), largest.sqrt()
            exponent = torch.where(largest > 0, FP16_TOP - torch.frexp(largest).exponent, 0).to(torch.int32)
            local = torch.ldexp(local, exponent.to(local.device))
            own[EXP + str(key)] = exponent.to(weight_dtype)  # a small integer: exact in fp16
        rounded = stochastic_round(local.contiguous(), weight_dtype, generator) if generator is not None \
            else local.to(weight_dtype)
        if EXP + str(key) in own:
            own[SCALED + str(key)] = like(p, rounded)
            return None
        return like(p, rounded)

    def _dequantize(self, p: Tensor, key: str, codes: Tensor, stored: dict[str, Any]) -> Tensor:
        """An 8-bit state (``lp.q8.<key>`` and ``lp.q8scale.<key>``) in fp32, through torchao's own dequantization."""
        local = local_part(p)
        signed = key not in NON_NEGATIVE
        qmap = self._qmaps.get((signed, local.device))
        if qmap is None:  # torchao's map of 256 values, the same for every state of a sign
            qmap = self._optim_state_8bit().zeros((BLOCK,), signed=signed, block_size=BLOCK, device=local.device).qmap
            self._qmaps[(signed, local.device)] = qmap
        scale = local_part(stored[SCALES + key]).view(torch.int16).view(torch.float32)
        quantized = self._optim_state_8bit()(codes.view(torch.int16).view(torch.uint8).reshape(local.shape), scale,
                                              qmap, signed)
        return quantized.dequantize()

    def _optim_state_8bit(self) -> Any:
        if self._8bit is None:
            self._8bit = _imports.import_quietly("torchao.optim.subclass_8bit").OptimState8bit
        return self._8bit
