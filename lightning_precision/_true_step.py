"""The optimizer step of the true-precision plugins: the user's own optimizer, stepped in fp32 on 16-bit weights.

Weights and gradients live in bf16/fp16, optimizer states in the dtype asked for. At each step, a chunk of parameters
at a time (``step_chunk`` elements: the transient memory is bounded by it, not by the model):

1. each weight is widened to fp32 (its remainder added back under ``update="compensated"``), its gradient too (unscaled
   and clipped in fp32), its states decoded to fp32;
2. those fp32 stand-ins replace the parameters in the optimizer's groups, and its own ``step()`` runs on them: any
   ``torch.optim`` optimizer, with its hyperparameters, foreach/fused kernels and schedulers as configured;
3. the new fp32 weights land in the 16-bit weights by the chosen rounding, an element whose new value is not finite
   keeping its old one (nothing non-finite is ever written), and the states are encoded again.

A step whose gradients hold inf/nan never gets here: the plugin skips it (and an fp16 plugin backs its scale off).

The optimizer's step hooks (``register_step_pre_hook``/``register_step_post_hook``, torch's global ones) run once a
step, around all the chunks, and see the real parameters. A Ctrl-C during the step is raised when it has landed (a
second one at once). An error the optimizer raises leaves the chunk it was stepping as it was; chunks landed before it
stay stepped (undoing them would take a copy of the weights and states, the memory the chunks exist to bound).

What the step keeps beside the user's states lives in the optimizer's own state, so that every checkpoint (the
Trainer's, ``fabric.save``, a sharded one) carries it: ``lp.remainder`` (the compensation), ``lp.rounds`` (how many
times this parameter was rounded: with the plugin's seed, the parameter's index and, for a sharded weight, the shard, it
seeds the stochastic rounding, so that a resumed run draws the same numbers as one never stopped), ``lp.f16.<state>``
and ``lp.exp.<state>`` (an fp16 state and the power of two it is stored at, so that Adam's second moment does not
flush to zero; a sum of squares is stored as its square root, whose range is the gradients'), and
``lp.hi.<state>``/``lp.lo.<state>`` (an fp32 state's two 16-bit halves), ``lp.q8.<state>``/``lp.q8scale.<state>``
(an 8-bit state's codes, two to an element, and its fp32 block scales: torchao's ``OptimState8bit`` quantizes and
dequantizes, but is not what is stored, because ``torch.load`` cannot rebuild a tensor subclass under the callable
``map_location`` that Lightning's Trainer and ``fabric.load`` pass). Every tensor among them is kept in the weight's
dtype (integers as bit patterns, exponents as small integers that dtype holds exactly): ``Optimizer.load_state_dict``
casts every state tensor to its parameter's dtype, and a cast to the same dtype changes no bit. A state stored in any
form but its own value is stored under a key of ours only, never under the optimizer's name: a checkpoint resumed by
another precision then fails to find the state (a ``KeyError``) instead of training on encoded values.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_precision import _imports
from lightning_precision._fsdp import local_shard
from lightning_precision._rounding import join_remainder, split_remainder, stochastic_round
from lightning_precision._upstream.torch import optimizer_step_hooks

__all__ = ["OPTIMIZER_STATES", "ROUNDING_COUNTS", "STATE_PREFIX", "ClipRequest", "RoundingMeter", "TrueStep",
           "is_own_key", "is_stepping", "own_state_bytes"]

OPTIMIZER_STATES = ("weight", "float32", "8bit")
STATE_PREFIX = "lp."
_REMAINDER = STATE_PREFIX + "remainder"
_ROUNDS = STATE_PREFIX + "rounds"
_EXP = STATE_PREFIX + "exp."
# An fp16 state at its power of two, under a key of ours: under torch's own name, a checkpoint resumed by another
# precision (Lightning's, plain torch) would read the scaled values as the state, silently; so it fails to find it.
_SCALED = STATE_PREFIX + "f16."
_HIGH = STATE_PREFIX + "hi."
_LOW = STATE_PREFIX + "lo."
_CODES = STATE_PREFIX + "q8."
_SCALES = STATE_PREFIX + "q8scale."
# A param-group key: the weight dtype whose step wrote the group's states. Their 16-bit encodings (remainders, fp32
# states' halves, 8-bit codes, fp16 states at a power of two) mean nothing in the other 16-bit dtype, and torch casts
# them to it on load: a checkpoint of one plugin resumed by the other would step on garbage states.
_WRITTEN_BY = STATE_PREFIX + "dtype"
_PLUGIN_OF = {"bfloat16": "BF16TruePrecision", "float16": "FP16TruePrecision"}
# States that are never negative: torchao's unsigned 8-bit map gives them its 256 codes.
_NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf"})
# States that are sums of squares (Adam's second moment, Adagrad's sum, RMSprop's average, Adadelta's deltas): their
# range is the square of the gradients', wider than fp16 holds at one power of two when the gradients of one tensor span
# more than about 6 decades. Stored in fp16 as their square roots (the gradients' own range), squared when read.
_SQUARED = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta"})
_BLOCK = 256  # torchao's 8-bit block; smaller tensors (and those not a whole number of blocks) stay 16-bit
_MIN_8BIT = 4096  # torchao's own low-bit optimizers keep tensors under 4096 elements in full precision
# An fp16 state is stored times 2**e, with e chosen so that its largest element lands in [2**13, 2**14): headroom below
# 65504, and 2**-24 * 2**-13 of the largest element still representable.
_FP16_TOP = 14


# What a `RoundingMeter` counts per weight dtype, in this order (one int64 row).
ROUNDING_COUNTS = ("stepped", "updated", "lost_to_nearest", "moved")


class RoundingMeter:
    """What rounding does to the 16-bit weights, counted on the device (no host read) while a ``TrueStep`` holds it as
    its ``meter``: per weight dtype, one int64 row of ``ROUNDING_COUNTS``: the elements stepped, those whose fp32
    update was nonzero, those of them that rounding to nearest leaves at their old 16-bit value (what a plain 16-bit
    step, Lightning's ``bf16-true``, loses), and those whose stored 16-bit value changed under the step's own rounding
    (a compensated weight keeps the rest of its update in its remainder)."""

    def __init__(self) -> None:
        self.counts: dict[torch.dtype, Tensor] = {}

    def add(self, old: Tensor, before: Tensor, new: Tensor, landed: Tensor | None) -> None:
        """``old``: the 16-bit weight before the step; ``before``: the fp32 value it stood for (with its remainder);
        ``new``: the fp32 value after the step; ``landed``: what the step writes (``None``: ``new`` rounded to
        nearest)."""
        nearest = new.to(old.dtype)
        updated = new != before
        written = nearest if landed is None else landed
        row = torch.stack([torch.zeros((), dtype=torch.int64, device=old.device) + old.numel(),
                           torch.count_nonzero(updated), torch.count_nonzero(updated & (nearest == old)),
                           torch.count_nonzero(updated & (written != old))])
        total = self.counts.get(old.dtype)
        self.counts[old.dtype] = row if total is None else total + row.to(total.device)

    def take(self) -> dict[torch.dtype, Tensor]:
        """The counts so far, forgotten here."""
        counts, self.counts = self.counts, {}
        return counts


def is_own_key(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(STATE_PREFIX)


_STEPPING: set[int] = set()  # ids of the optimizers a TrueStep is stepping now


def is_stepping(optimizer: Optimizer) -> bool:
    """Whether a ``TrueStep`` is inside a step of ``optimizer`` (its step hooks see the real parameters then)."""
    return id(optimizer) in _STEPPING


@contextmanager
def _step_hooks_once(optimizer: Optimizer) -> Generator[None, None, None]:
    """The optimizer's step hooks (its own and torch's global ones) run once around the whole step, on the real
    parameters, and are held while the optimizer steps chunk by chunk on stand-ins: run per chunk, a hook that counts
    steps, or averages the model's weights (an EMA), would run several times a step and see it half taken. The
    post-hooks run only when the step completes. What a pre-hook returns is ignored (the step takes no arguments)."""
    pre, post = optimizer_step_hooks(optimizer)
    args: tuple[Any, ...] = (optimizer,)  # what torch's step wrapper passes its hooks
    for hook in [hook for hooks in pre for hook in hooks.values()]:
        hook(optimizer, args, {})
    held = [dict(hooks) for hooks in pre + post]
    for hooks in pre + post:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, kept in zip(pre + post, held, strict=True):
            added = dict(hooks)  # registered during the step: kept, after the others
            hooks.clear()
            hooks.update(kept)
            hooks.update(added)
    for hook in [hook for hooks in post for hook in hooks.values()]:
        hook(optimizer, args, {})


@contextmanager
def _interrupts_held() -> Generator[None, None, None]:
    """A Ctrl-C during the step is held until the step ends and raised then: raised between two chunks (or two
    parameters landing), it would leave some parameters stepped and others not. A second Ctrl-C raises at once (a step
    that hangs can still be stopped). Only in the main thread and where SIGINT has Python's default handler."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []

    def hold(signum: int, _: Any) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


@dataclass(frozen=True)
class ClipRequest:
    """Gradient clipping asked for this step, done in fp32 inside it: ``max_norm`` (total norm of ``norm_type``) or
    ``max_value`` (each element)."""

    max_norm: float | None = None
    norm_type: float = 2.0
    max_value: float | None = None


def _local(tensor: Tensor) -> Tensor:
    local = local_shard(tensor)
    assert local is not None
    return local


def _like(param: Tensor, local: Tensor) -> Tensor:
    """``local`` as the parameter is: a DTensor with its mesh and placements when it is one (no communication)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _like_flat(param: Tensor, flat: Tensor) -> Tensor:
    """A flat per-element companion of a sharded parameter (8-bit codes, block scales) as a 1-D DTensor sharded as it
    is (every shard of one size: ``_fits_8bit``), so that a distributed checkpoint saves each rank's part; a plain
    tensor as it is."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return flat
    shards = 1
    for dim, placement in enumerate(param.placements):
        if placement.is_shard():
            shards *= param.device_mesh.size(dim)
    placements = [Shard(0) if placement.is_shard() else placement for placement in param.placements]
    return DTensor.from_local(flat, param.device_mesh, placements, run_check=False,
                              shape=torch.Size((flat.numel() * shards,)), stride=(1,))


def _is_sharded(param: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _shard_index(p: Tensor) -> int:
    """Which shard of a parameter this rank holds (0 for one not sharded): its coordinate along the mesh dimensions
    the parameter is sharded over. Ranks that hold the same shard (DDP's replicas, HSDP's replicated dimension) draw
    the same rounding numbers and stay identical; under plain FSDP2 it is the rank."""
    if not _is_sharded(p):
        return 0
    mesh, index = p.device_mesh, 0  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(p.placements):  # type: ignore[attr-defined]
        if placement.is_shard():
            index = index * mesh.size(dim) + coordinate[dim]
    return index


def _seed(seed: int, index: int, rounds: int, rank: int) -> int:
    """A 63-bit seed per (plugin seed, parameter, step, rank): splitmix64's finaliser over their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + rounds * 0x94D049BB133111EB + rank) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


def _fits_everywhere(params: list[Tensor], news: list[Tensor]) -> list[bool]:
    """Per parameter, whether every new fp32 value is finite and within its weight's format (so that no rounding can
    make it inf): one reduction each and one host read for the chunk, instead of a per-element check and select each
    (a seventh of the step's time on a CPU). On an accelerator that read would wait for the device at every chunk of
    every step, where the per-element check is a cheap memory-bound pass: there every parameter takes that path (the
    same values: it keeps what is out of range, and nothing else), and nothing is read."""
    if not params:
        return []
    if news[0].device.type != "cpu":
        return [False] * len(params)
    flags = []
    for p, new in zip(params, news, strict=True):
        if not new.numel():
            flags.append(torch.ones((), dtype=torch.bool, device=new.device))
            continue
        limit = torch.finfo(_local(p).dtype).max
        low, high = torch.aminmax(new)  # one pass; nan in either (and so False below)
        flags.append((high <= limit) & (low >= -limit))
    device = flags[0].device
    return [bool(f) for f in torch.stack([f.to(device) for f in flags]).tolist()]


def _is_moment(key: Any, value: Any, param: Tensor) -> bool:
    """A state the step converts: a floating tensor of the parameter's shape (not a step counter, not ours)."""
    return (isinstance(value, Tensor) and not is_own_key(key) and key != "step" and param.dim() > 0
            and value.shape == param.shape and (value.is_floating_point() or _is_low_bit(value)))


def _fits_8bit(p: Tensor, local: Tensor) -> bool:
    """Whether a state is stored in 8 bits: a whole number of torchao's blocks, not a small tensor; and, sharded, only
    when every rank's shard is of this one's size, so that one DTensor is 8-bit on every rank or on none (mixed, a
    full checkpoint or a load into another number of ranks would gather 8-bit codes with 16-bit values)."""
    if local.numel() < _MIN_8BIT or local.numel() % _BLOCK:
        return False
    if not _is_sharded(p):
        return True
    shards = 1
    for dim, placement in enumerate(p.placements):  # type: ignore[attr-defined]
        if placement.is_shard():
            shards *= p.device_mesh.size(dim)  # type: ignore[attr-defined]
    return local.numel() * shards == p.numel()


def _is_8bit(value: Any) -> bool:
    return type(value).__name__ == "OptimState8bit"


def _is_low_bit(value: Any) -> bool:
    """A state of one of torchao's low-bit optimizers (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) the user chose."""
    return type(value).__name__.startswith("OptimState")


def own_state_bytes(value: Any) -> int:
    """Bytes a state tensor holds on this rank (an 8-bit state's codes, block scales and map)."""
    if not isinstance(value, Tensor):
        return 0
    local = _local(value)
    if _is_low_bit(local):  # the tensors it is made of (an 8-bit state's codes, block scales and map)
        names, _ = local.__tensor_flatten__()  # type: ignore[attr-defined]
        parts = [getattr(local, name) for name in names]
        return sum(t.numel() * t.element_size() for t in parts)
    return local.numel() * local.element_size()


class TrueStep:
    """Steps an optimizer in fp32 on 16-bit parameters. ``dtype``: the weights' dtype; ``update``: how a new value lands
    (``_rounding``); ``states``: the optimizer states' storage (``OPTIMIZER_STATES``)."""

    def __init__(self, dtype: torch.dtype, update: str, states: str, seed: int, step_chunk: int) -> None:
        self.dtype, self.update, self.states = dtype, update, states
        self.seed, self.step_chunk = seed, step_chunk
        self._generators: dict[torch.device, torch.Generator] = {}
        self._8bit: Any = None
        self._qmaps: dict[tuple[bool, torch.device], Tensor] = {}
        # Set by a monitor on the steps it measures (GradientUnderflowMonitor); None: nothing counted, nothing spent.
        self.meter: RoundingMeter | None = None

    # --- the step -------------------------------------------------------------------------------------------------

    def step(self, optimizer: Optimizer, grad_factor: Tensor | None, clip: ClipRequest | None) -> None:
        """One step of ``optimizer`` (its gradients checked finite by the caller). ``grad_factor``: multiplies each
        gradient in fp32 (the inverse loss scale), before clipping."""
        self.check_written_by(optimizer)
        index = {p: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
        params = [p for p in index if p.grad is not None]
        factor = grad_factor
        if clip is not None and clip.max_norm is not None:
            factor = self._norm_factor(params, factor, clip)
        max_value = clip.max_value if clip is not None else None
        landed = 0
        _STEPPING.add(id(optimizer))
        try:
            with _interrupts_held(), _step_hooks_once(optimizer):
                for chunk in self._chunks(params):
                    self._step_chunk(optimizer, chunk, index, factor, max_value)
                    landed += len(chunk)
        except BaseException as error:
            if landed and hasattr(error, "add_note"):  # (Python 3.11+) say what the step left behind
                error.add_note(f"The true-precision step of `{type(optimizer).__name__}` had stepped {landed} of its"
                               f" {len(params)} parameters (`step_chunk` elements at a time) when this was raised; the"
                               " others are as they were.")
            raise
        finally:
            _STEPPING.discard(id(optimizer))

    def check_written_by(self, optimizer: Optimizer) -> None:
        """Raise if ``optimizer``'s states were written by a step of the other 16-bit dtype (a checkpoint of the other
        plugin); mark them as this dtype's."""
        name = str(self.dtype).removeprefix("torch.")
        for group in optimizer.param_groups:
            written = group.get(_WRITTEN_BY, name)
            if written != name:
                raise ValueError(
                    f"The states of `{type(optimizer).__name__}` were written by `{_PLUGIN_OF.get(written, written)}`"
                    f" ({written} weights: a checkpoint of it was loaded) and are stepped by"
                    f" `{_PLUGIN_OF.get(name, name)}` ({name} weights). Their 16-bit encodings (remainders, fp32"
                    f" states' halves, 8-bit codes, fp16 states stored at a power of two) cannot be read in {name}:"
                    " torch cast them on load. Resume with the plugin that wrote the checkpoint, or load the model's"
                    " weights alone (e.g. `LightningModule.load_from_checkpoint`) and start the optimizer afresh."
                )
        for group in optimizer.param_groups:
            group[_WRITTEN_BY] = name

    def _chunks(self, params: list[Tensor]) -> Iterator[list[Tensor]]:
        chunk: list[Tensor] = []
        size = 0
        for p in params:
            n = _local(p).numel()
            if chunk and size + n > self.step_chunk:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += n
        if chunk:
            yield chunk

    @staticmethod
    def _norm_factor(params: list[Tensor], factor: Tensor | None, clip: ClipRequest) -> Tensor | None:
        """``factor`` times the clipping coefficient of the total gradient norm, computed in fp32 (a 16-bit norm of
        fp16 gradients at a loss scale overflows). A DTensor's norm is reduced across its mesh."""
        if not params:
            return factor
        from torch.distributed.tensor import DTensor

        norms = []
        for p in params:
            grad = p.grad.coalesce().values() if p.grad.is_sparse else p.grad  # type: ignore[union-attr]
            norm = torch.linalg.vector_norm(grad, clip.norm_type, dtype=torch.float32)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        device = _local(params[0]).device
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), clip.norm_type)
        if factor is not None:
            total = total * factor
        coefficient = (clip.max_norm / (total + 1e-6)).clamp(max=1.0)
        return coefficient if factor is None else factor * coefficient

    def _step_chunk(self, optimizer: Optimizer, chunk: list[Tensor], index: dict[Tensor, int],
                    factor: Tensor | None, max_value: float | None) -> None:
        members = set(chunk)
        stand_ins: dict[Tensor, Tensor] = {}
        stored: dict[Tensor, dict[str, Any]] = {}
        groups = [group["params"] for group in optimizer.param_groups]
        state = optimizer.state
        try:
            with torch.no_grad():
                for p in chunk:
                    stored[p] = state.pop(p) if p in state else {}
                    stand_in = _like(p, self._widen(p, stored[p]))
                    stand_in.grad = _like(p, self._grad(p, factor, max_value))
                    stand_ins[p] = stand_in
                    state[stand_in] = self._decode(p, stored[p])
            for group, params in zip(optimizer.param_groups, groups, strict=True):
                group["params"] = [stand_ins[p] for p in params if p in members]
            optimizer.step()
        except BaseException:
            for p in chunk:  # nothing written: the parameters and their states as they were
                if p in stand_ins:
                    state.pop(stand_ins[p], None)
                if p in stored:
                    state[p] = stored[p]
            raise
        finally:
            for group, params in zip(optimizer.param_groups, groups, strict=True):
                group["params"] = params
        try:
            with torch.no_grad():
                fits = _fits_everywhere(chunk, [_local(stand_ins[p]) for p in chunk])
                for p, safe in zip(chunk, fits, strict=True):
                    new_state = state.pop(stand_ins[p])
                    state[p] = self._commit(p, stand_ins[p], new_state, stored[p], index[p], safe)
        except BaseException:  # (a second Ctrl-C): what has not landed keeps its state, no stand-in stays
            for p in chunk:
                state.pop(stand_ins[p], None)
                state.setdefault(p, stored[p])
            raise

    def _widen(self, p: Tensor, own: dict[str, Any]) -> Tensor:
        local = _local(p)
        if local.dtype == torch.float32:  # a layer kept in fp32 (the layer policy): stepped as it is
            return local.detach().clone()
        remainder = own.get(_REMAINDER)
        if self.update == "compensated" and remainder is not None:
            return join_remainder(local, _local(remainder).view(torch.int16))
        return local.float()

    @staticmethod
    def _grad(p: Tensor, factor: Tensor | None, max_value: float | None) -> Tensor:
        grad = _local(p.grad)  # type: ignore[arg-type]
        if grad.is_sparse:  # an embedding with sparse=True: its momentum would be sparse, not storable in 16 bits
            grad = grad.to_dense()
        grad = grad.float()
        if factor is not None:
            grad.mul_(factor.to(grad.device))
        if max_value is not None:
            grad.clamp_(-max_value, max_value)
        return grad

    def _decode(self, p: Tensor, stored: dict[str, Any]) -> dict[str, Any]:
        """The parameter's states as its optimizer keeps them, in fp32 where they are stored otherwise."""
        states: dict[str, Any] = {}
        for key, value in stored.items():
            if isinstance(key, str) and key.startswith(_HIGH):
                name = key[len(_HIGH):]
                high = _local(value).view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
                low = _local(stored[_LOW + name]).view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)
                states[name] = _like(p, high.bitwise_or_(low).view(torch.float32))
            elif isinstance(key, str) and key.startswith(_SCALED):
                name = key[len(_SCALED):]
                widened = torch.ldexp(_local(value).float(), -_local(stored[_EXP + name]).to(value.device, torch.int32))
                states[name] = _like(p, widened.square() if name in _SQUARED else widened)
            elif isinstance(key, str) and key.startswith(_CODES):
                states[key[len(_CODES):]] = _like(p, self._dequantize(p, key[len(_CODES):], _local(value), stored))
            elif is_own_key(key) or not _is_moment(key, value, p):
                if not is_own_key(key):
                    # A copy (a step counter is one): the optimizer updates it in place, and a step that fails or is
                    # interrupted gives the parameter back its state as it was.
                    states[key] = value.clone() if type(value) is Tensor else value
            elif _is_low_bit(_local(value)):
                # A torchao low-bit optimizer's state: already compact, and read and written by that optimizer itself
                # (in place: a step that fails inside it may leave it updated).
                states[key] = value
            else:
                widened = _local(value).to(torch.float32, copy=True)  # (fp32 already in a layer kept so: copied too)
                states[key] = _like(p, widened)
        return states

    def _commit(self, p: Tensor, stand_in: Tensor, new_state: dict[str, Any], own: dict[str, Any],
                index: int, safe: bool) -> dict[str, Any]:
        """Land the stepped fp32 weight and states in their storage, and return the parameter's new state. ``own``, its
        state from before the step (holding our keys), is left as it was, and the weight is written last: an error
        on the way leaves the parameter and its state as they were. ``safe``: every new value is finite and within
        the 16-bit format's range (``_fits_everywhere``), so that no element needs keeping its old value."""
        old = _local(p)
        new = _local(stand_in)
        # Every state is encoded anew: an encoding of another setting (a resume that changed `optimizer_states`, or
        # `update` away from "compensated") would stay in the state, and in every checkpoint, for good, and be read
        # again in place of the state.
        kept = (_ROUNDS, _REMAINDER) if self.update == "compensated" else (_ROUNDS,)
        fresh = {key: own[key] for key in kept if key in own}
        generator = None
        if old.dtype != torch.float32 and self.update != "nearest":
            rounds = int(own.get(_ROUNDS, 0))
            generator = self._generator(new.device)
            generator.manual_seed(_seed(self.seed, index, rounds, _shard_index(p)))
            fresh[_ROUNDS] = rounds + 1
        meter = self.meter if old.dtype != torch.float32 else None
        if safe and meter is None:  # the common case: no element to keep, nothing to count
            landed = self._land(p, old, new, fresh, generator)
        else:
            landed = self._land_checked(p, old, new, own, fresh, generator, meter)
        for key, value in new_state.items():
            encoded = self._encode(key, value, p, fresh, generator)
            if encoded is not None:
                fresh[key] = encoded
        old.copy_(landed)
        return fresh

    def _land(self, p: Tensor, old: Tensor, new: Tensor, fresh: dict[str, Any],
              generator: torch.Generator | None) -> Tensor:
        """The 16-bit weight ``new`` lands as (its remainder into ``fresh``), every value known to fit."""
        if old.dtype == torch.float32:
            return new
        if self.update == "compensated":
            weight, remainder = split_remainder(new, old.dtype)
            fresh[_REMAINDER] = _like(p, remainder.view(old.dtype))
            return weight
        return stochastic_round(new, old.dtype, generator) if generator is not None else new.to(old.dtype)

    def _land_checked(self, p: Tensor, old: Tensor, new: Tensor, own: dict[str, Any], fresh: dict[str, Any],
                      generator: torch.Generator | None, meter: RoundingMeter | None) -> Tensor:
        """``_land`` element by element: a value the optimizer left non-finite, or one the 16-bit format cannot hold,
        keeps the old one (nothing non-finite is written); and the meter, when a monitor measures, counts."""
        before = self._widen(p, own)
        new = torch.where(torch.isfinite(new), new, before)
        if old.dtype == torch.float32:
            return new
        if self.update == "compensated":
            weight, remainder = split_remainder(new, old.dtype)
            fits = torch.isfinite(weight)
            if _REMAINDER in own:
                remainder = torch.where(fits, remainder, _local(own[_REMAINDER]).view(torch.int16))
            else:
                remainder = torch.where(fits, remainder, 0)
            landed = torch.where(fits, weight, old)
            fresh[_REMAINDER] = _like(p, remainder.view(old.dtype))
        else:
            landed = stochastic_round(new, old.dtype, generator) if generator is not None else new.to(old.dtype)
            # A finite fp32 value beyond the 16-bit format's largest (fp16: 65504) rounds to inf: it keeps its value.
            landed = torch.where(torch.isfinite(landed), landed, old)
        if meter is not None:
            meter.add(old, before, new, landed)
        return landed

    def _encode(self, key: Any, value: Any, p: Tensor, own: dict[str, Any], generator: torch.Generator | None) -> Any:
        weight_dtype = _local(p).dtype
        if not _is_moment(key, value, p) or weight_dtype == torch.float32 or _is_low_bit(_local(value)):
            return value
        local = _local(value).float()
        if self.states == "float32":
            bits = local.contiguous().view(torch.int32)
            own[_HIGH + str(key)] = _like(p, bits.bitwise_right_shift(16).to(torch.int16).view(weight_dtype))
            own[_LOW + str(key)] = _like(p, bits.to(torch.int16).view(weight_dtype))
            return None
        if self.states == "8bit" and _fits_8bit(p, local):
            quantized = self._optim_state_8bit().zeros(local.shape, signed=key not in _NON_NEGATIVE,
                                                       block_size=_BLOCK, device=local.device)
            quantized.copy_(local)
            own[_CODES + str(key)] = _like_flat(p, quantized.codes.reshape(-1).view(torch.int16).view(weight_dtype))
            own[_SCALES + str(key)] = _like_flat(p, quantized.scale.view(torch.int16).view(weight_dtype))
            return None
        if weight_dtype == torch.float16 and value.numel() > 0:  # (an empty state has no largest element)
            # fp16 would flush a second moment of small gradients to zero (and the next update would divide by ~0):
            # stored at a power of two that puts its largest element near 2**14, one for the whole (sharded) tensor so
            # that a checkpoint holds one value for every rank; a sum of squares as its square root (_SQUARED).
            largest = value.abs().amax()
            largest = _local(largest.full_tensor() if _is_sharded(largest) else largest)
            if key in _SQUARED:
                local, largest = local.sqrt(), largest.sqrt()
            exponent = torch.where(largest > 0, _FP16_TOP - torch.frexp(largest).exponent, 0).to(torch.int32)
            local = torch.ldexp(local, exponent.to(local.device))
            own[_EXP + str(key)] = exponent.to(weight_dtype)  # a small integer: exact in fp16
        rounded = stochastic_round(local.contiguous(), weight_dtype, generator) if generator is not None \
            else local.to(weight_dtype)
        if _EXP + str(key) in own:
            own[_SCALED + str(key)] = _like(p, rounded)
            return None
        return _like(p, rounded)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator

    def _dequantize(self, p: Tensor, key: str, codes: Tensor, stored: dict[str, Any]) -> Tensor:
        """An 8-bit state (``lp.q8.<key>`` and ``lp.q8scale.<key>``) in fp32, through torchao's own dequantization."""
        local = _local(p)
        signed = key not in _NON_NEGATIVE
        qmap = self._qmaps.get((signed, local.device))
        if qmap is None:  # torchao's map of 256 values, the same for every state of a sign
            qmap = self._optim_state_8bit().zeros((_BLOCK,), signed=signed, block_size=_BLOCK, device=local.device).qmap
            self._qmaps[(signed, local.device)] = qmap
        scale = _local(stored[_SCALES + key]).view(torch.int16).view(torch.float32)
        quantized = self._optim_state_8bit()(codes.view(torch.int16).view(torch.uint8).reshape(local.shape), scale,
                                              qmap, signed)
        return quantized.dequantize()

    def _optim_state_8bit(self) -> Any:
        if self._8bit is None:
            self._8bit = _imports.import_quietly("torchao.optim.subclass_8bit").OptimState8bit
        return self._8bit
