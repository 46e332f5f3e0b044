"""The optimizer step of the true-precision plugins: the user's own optimizer, stepped in fp32 on 16-bit weights.

Weights and gradients live in bf16/fp16, optimizer states in the dtype asked for. Each step:

1. the weights are widened to fp32 (their remainders added back under ``update="compensated"``), the gradients too
   (unscaled and clipped in fp32), the states decoded to fp32;
2. those fp32 stand-ins replace the parameters in the optimizer's groups, and its own ``step()`` runs on them: any
   optimizer, with its hyperparameters, foreach/fused kernels and schedulers as configured;
3. the new fp32 weights land in the 16-bit weights by the chosen rounding, an element whose new value is not finite
   keeping its old one (nothing non-finite is ever written), and the states are encoded again.

**A constant number of ops.** Parameters of one weight dtype, device and shard go together (a *chunk*): they are
widened into flat fp32 buffers whose views (made once, ``_workspace``) are the stand-ins, and every conversion runs on
the whole buffer (``_true_flat``). What the step adds to the optimizer's own ops is then a fixed number per chunk, not
per parameter (on a GPU each op is a kernel launch), and it reads nothing from the device. Parameters it cannot take so
(a sparse gradient, an empty tensor) and states in another form (8-bit ones, torchao's low-bit ones, those of a new
parameter's first step) take the per-parameter path, the same values.

**Memory.** The fp32 copies exist during the step only, ``step_chunk`` elements at a time for optimizers that update
each parameter apart from the others (torch's and torchao's own: their step is called once per chunk); any other
optimizer (timm's Lamb keeps a group-level step count, others a global norm) is stepped once, on the whole model.

A step whose gradients hold inf/nan never gets here: the plugin skips it (and an fp16 plugin backs its scale off).

The optimizer's step hooks (``register_step_pre_hook``/``register_step_post_hook``, torch's global ones) run once a
step, around the whole step, and see the real parameters. A Ctrl-C during the step is raised when it has landed: a
second one raises at once while the optimizer steps, and is held too while the new values are written (a handful of
copies, so that no weight is written without its state). An error the optimizer raises leaves the chunk it was stepping
as it was; chunks landed before it stay stepped.

Stochastic rounding draws, per chunk, from a generator seeded with the plugin's seed, the chunk's first parameter's
index and how many times it was rounded (``lp.rounds``), and its shard: the weights first, then the states by name. A
resumed run draws what the uninterrupted one draws (with the same ``step_chunk``).

What the step keeps beside the user's states lives in the optimizer's own state (keys in ``_true_keys``), so that every
checkpoint (the Trainer's, ``fabric.save``, a sharded one) carries it: ``lp.remainder`` (the compensation),
``lp.rounds``, ``lp.f16.<state>`` and ``lp.exp.<state>`` (an fp16 state and the power of two it is stored at, so that
Adam's second moment does not flush to zero; a sum of squares is stored as its square root, whose range is the
gradients'), ``lp.hi.<state>``/``lp.lo.<state>`` (an fp32 value's two 16-bit halves), ``lp.q8.<state>``/
``lp.q8scale.<state>`` (an 8-bit state's codes, two to an element, and its fp32 block scales: torchao's
``OptimState8bit`` quantizes and dequantizes, but is not what is stored, because ``torch.load`` cannot rebuild a
tensor subclass under the callable ``map_location`` that Lightning's Trainer and ``fabric.load`` pass).
"""

from __future__ import annotations

import signal
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_precision import _imports
from lightning_precision._core.fsdp import local_shard
from lightning_precision._core.rounding import join_remainder, split_remainder, stochastic_round
from lightning_precision._core.rounding_meter import ROUNDING_COUNTS, RoundingMeter
from lightning_precision._core.true_flat import decode_state, encode_state, land_weights, widen_grads, widen_weights
from lightning_precision._core.true_keys import (
    BLOCK,
    CODES,
    EXP,
    FP16_TOP,
    HIGH,
    LOW,
    MIN_8BIT,
    NON_NEGATIVE,
    PLUGIN_OF,
    REMAINDER,
    ROUNDS,
    SCALED,
    SCALES,
    SQUARED,
    STATE_PREFIX,
    WRITTEN_BY,
    is_low_bit,
    is_moment,
    is_own_key,
    is_scalar_fp32,
)
from lightning_precision._core.workspace import Workspace
from lightning_precision._upstream.torch import foreach_copy_, foreach_mul, foreach_norm, optimizer_step_hooks

__all__ = ["OPTIMIZER_STATES", "ROUNDING_COUNTS", "STATE_PREFIX", "ClipRequest", "RoundingMeter", "TrueStep",
           "is_own_key", "is_stepping", "own_state_bytes", "steps_each_parameter_apart"]

OPTIMIZER_STATES = ("weight", "float32", "8bit")
# Optimizers whose step updates each parameter from its own gradient and state alone: stepped a chunk at a time.
_SEPARABLE_MODULES = ("torch.optim.", "torchao.optim.")
_MAX_WORKSPACES = 64  # chunk layouts kept (views only: their memory is freed between steps), the least recent dropped


def steps_each_parameter_apart(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s step updates each parameter apart from the others (torch's and torchao's optimizers, not
    a subclass that overrides ``step``), so that stepping it a chunk at a time is stepping it once."""
    module = getattr(type(optimizer).step, "__module__", None) or ""
    return module.startswith(_SEPARABLE_MODULES)


_STEPPING: set[int] = set()  # ids of the optimizers a TrueStep is stepping now


def is_stepping(optimizer: Optimizer) -> bool:
    """Whether a ``TrueStep`` is inside a step of ``optimizer`` (its step hooks see the real parameters then)."""
    return id(optimizer) in _STEPPING


@contextmanager
def _step_hooks_once(optimizer: Optimizer) -> Generator[None, None, None]:
    """The optimizer's step hooks (its own and torch's global ones) run once around the whole step, on the real
    parameters, and are held while the optimizer steps on stand-ins: run per chunk, a hook that counts steps, or
    averages the model's weights (an EMA), would run several times a step and see it half taken. The post-hooks run
    only when the step completes. What a pre-hook returns is ignored (the step takes no arguments)."""
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


class _Interrupts:
    """What ``_interrupts_held`` received, and whether a second Ctrl-C is held too (while the step writes)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.writing = False

    @contextmanager
    def held_entirely(self) -> Generator[None, None, None]:
        self.writing = True
        try:
            yield
        finally:
            self.writing = False


@contextmanager
def _interrupts_held() -> Generator[_Interrupts, None, None]:
    """A Ctrl-C during the step is held until the step ends and raised then: raised between two chunks, it would leave
    some parameters stepped and others not. A second Ctrl-C raises at once while the optimizer steps (a step that hangs
    can still be stopped), and is held while the new values are written. Only in the main thread and where SIGINT has
    Python's default handler."""
    interrupts = _Interrupts()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield interrupts
        return

    def hold(signum: int, _: Any) -> None:
        if interrupts.received and not interrupts.writing:
            raise KeyboardInterrupt
        interrupts.received.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupts.received:
        raise KeyboardInterrupt


@dataclass(frozen=True)
class ClipRequest:
    """Gradient clipping asked for this step, done in fp32 inside it: ``max_norm`` (total norm of ``norm_type``) or
    ``max_value`` (each element)."""

    max_norm: float | None = None
    norm_type: float = 2.0
    max_value: float | None = None


@dataclass
class _Chunk:
    """Parameters stepped together: on flat buffers (``work``), or one by one (``flat=False``)."""

    params: list[Tensor]
    flat: bool
    work: Workspace | None = None
    # name -> (form, fp32 buffer) of the states decoded on the flat buffers
    states: dict[str, tuple[str, Any]] = field(default_factory=dict)


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


def _fits_8bit(p: Tensor, local: Tensor) -> bool:
    """Whether a state is stored in 8 bits: a whole number of torchao's blocks, not a small tensor; and, sharded, only
    when every rank's shard is of this one's size, so that one DTensor is 8-bit on every rank or on none (mixed, a
    full checkpoint or a load into another number of ranks would gather 8-bit codes with 16-bit values)."""
    if local.numel() < MIN_8BIT or local.numel() % BLOCK:
        return False
    if not _is_sharded(p):
        return True
    shards = 1
    for dim, placement in enumerate(p.placements):  # type: ignore[attr-defined]
        if placement.is_shard():
            shards *= p.device_mesh.size(dim)  # type: ignore[attr-defined]
    return local.numel() * shards == p.numel()


def own_state_bytes(value: Any) -> int:
    """Bytes a state tensor holds on this rank (an 8-bit state's codes, block scales and map)."""
    if not isinstance(value, Tensor):
        return 0
    local = _local(value)
    if is_low_bit(local):  # the tensors it is made of (an 8-bit state's codes, block scales and map)
        names, _ = local.__tensor_flatten__()  # type: ignore[attr-defined]
        parts = [getattr(local, name) for name in names]
        return sum(t.numel() * t.element_size() for t in parts)
    return local.numel() * local.element_size()


def _stored_form(key: Any, value: Any, p: Tensor) -> tuple[str, str] | None:
    """(state name, form) of a stored entry the flat path can read: a moment under its own name ("plain"), at a power
    of two ("f16"), or as its two halves ("float32"); ``None`` for any other entry."""
    if not isinstance(key, str):
        return None
    if key.startswith(SCALED):
        return key[len(SCALED):], "f16"
    if key.startswith(HIGH):
        return (key[len(HIGH):], "float32") if value.shape == p.shape and p.dim() > 0 else None
    if is_moment(key, value, p) and not is_low_bit(_local(value)) and _local(value).dtype == _local(p).dtype:
        return key, "plain"  # (a state of another dtype, such as Adagrad's fp32 sum made before the model was cast,
    return None  # goes the per-parameter way, which stores it in the weight's dtype)


def _stored_keys(name: str, form: str) -> tuple[str, str | None]:
    """The state keys a state of ``form`` is stored under: its values, and its parts (powers of two, low halves)."""
    if form == "f16":
        return SCALED + name, EXP + name
    if form == "float32":
        return HIGH + name, LOW + name
    return name, None


def _clone_all(tensors: list[Tensor]) -> list[Tensor]:
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


class TrueStep:
    """Steps an optimizer in fp32 on 16-bit parameters. ``dtype``: the weights' dtype; ``update``: how a new value lands
    (``_rounding``); ``states``: the optimizer states' storage (``OPTIMIZER_STATES``)."""

    def __init__(self, dtype: torch.dtype, update: str, states: str, seed: int, step_chunk: int) -> None:
        self.dtype, self.update, self.states = dtype, update, states
        self.seed, self.step_chunk = seed, step_chunk
        self._generators: dict[torch.device, torch.Generator] = {}
        self._8bit: Any = None
        self._qmaps: dict[tuple[bool, torch.device], Tensor] = {}
        self._works: OrderedDict[tuple[Any, ...], Workspace] = OrderedDict()
        # Set by a monitor on the steps it measures (GradientUnderflowMonitor); None: nothing counted, nothing spent.
        self.meter: RoundingMeter | None = None
        # Off in tests only: every parameter on the per-parameter path (the reference the flat path must equal).
        self.flat = True

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_works"] = OrderedDict()  # views of buffers: made again where the copy steps
        state["_generators"] = {}
        return state

    # --- the step -------------------------------------------------------------------------------------------------

    def step(self, optimizer: Optimizer, grad_factor: Tensor | None, clip: ClipRequest | None,
             grads: dict[Tensor, Tensor] | None = None) -> None:
        """One step of ``optimizer`` (its gradients checked finite by the caller). ``grad_factor``: multiplies each
        gradient in fp32 (the inverse loss scale), before clipping. ``grads``: the gradients to step with in place of
        the parameters' own (``.grad``), where given."""
        self.check_written_by(optimizer)
        index = {p: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
        replaced = grads or {}

        def grad_of(p: Tensor) -> Tensor:
            grad = replaced.get(p)
            return grad if grad is not None else p.grad  # type: ignore[return-value]

        params = [p for p in index if p.grad is not None]
        factor = grad_factor
        if clip is not None and clip.max_norm is not None:
            factor = self._norm_factor(params, grad_of, factor, clip)
        max_value = clip.max_value if clip is not None else None
        landed = 0
        _STEPPING.add(id(optimizer))
        try:
            with _interrupts_held() as interrupts, _step_hooks_once(optimizer):
                for chunks in self._rounds(optimizer, params, index, grad_of):
                    self._step_round(optimizer, chunks, index, grad_of, factor, max_value, interrupts)
                    landed += sum(len(chunk.params) for chunk in chunks)
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
            written = group.get(WRITTEN_BY, name)
            if written != name:
                raise ValueError(
                    f"The states of `{type(optimizer).__name__}` were written by `{PLUGIN_OF.get(written, written)}`"
                    f" ({written} weights: a checkpoint of it was loaded) and are stepped by"
                    f" `{PLUGIN_OF.get(name, name)}` ({name} weights). Their 16-bit encodings (remainders, fp32"
                    f" states' halves, 8-bit codes, fp16 states stored at a power of two) cannot be read in {name}:"
                    " torch cast them on load. Resume with the plugin that wrote the checkpoint, or load the model's"
                    " weights alone (e.g. `LightningModule.load_from_checkpoint`) and start the optimizer afresh."
                )
        for group in optimizer.param_groups:
            group[WRITTEN_BY] = name

    def _rounds(self, optimizer: Optimizer, params: list[Tensor], index: dict[Tensor, int],
                grad_of: Callable[[Tensor], Tensor]) -> list[list[_Chunk]]:
        """The chunks, and which of them each call of the optimizer's step takes: one chunk a call for an optimizer
        that steps each parameter apart, all of them in one call for any other."""
        kinds: dict[tuple[Any, ...], list[Tensor]] = {}
        for p in params:
            local, grad = _local(p), grad_of(p)
            flat = self.flat and local.numel() > 0 and grad.layout == torch.strided
            kinds.setdefault((flat, local.dtype, local.device, _shard_index(p)), []).append(p)
        chunks = [_Chunk(part, kind[0]) for kind, members in kinds.items() for part in self._split(members)]
        chunks.sort(key=lambda chunk: index[chunk.params[0]])
        if steps_each_parameter_apart(optimizer):
            return [[chunk] for chunk in chunks]
        return [chunks] if chunks else []

    def _split(self, params: list[Tensor]) -> Iterator[list[Tensor]]:
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
    def _norm_factor(params: list[Tensor], grad_of: Callable[[Tensor], Tensor], factor: Tensor | None,
                     clip: ClipRequest) -> Tensor | None:
        """``factor`` times the clipping coefficient of the total gradient norm, computed in fp32 (a 16-bit norm of
        fp16 gradients at a loss scale overflows): one ``torch._foreach_norm`` per device and dtype. A DTensor's norm
        is reduced across its mesh."""
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
        device = _local(params[0]).device
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), clip.norm_type)
        if factor is not None:
            total = total * factor
        coefficient = (clip.max_norm / (total + 1e-6)).clamp(max=1.0)
        return coefficient if factor is None else factor * coefficient

    def _step_round(self, optimizer: Optimizer, chunks: list[_Chunk], index: dict[Tensor, int],
                    grad_of: Callable[[Tensor], Tensor], factor: Tensor | None, max_value: float | None,
                    interrupts: _Interrupts) -> None:
        stand_ins: dict[Tensor, Tensor] = {}
        stored: dict[Tensor, dict[str, Any]] = {}
        had = set()  # the parameters that had a state (a first step that fails leaves none, not an empty one)
        groups = [group["params"] for group in optimizer.param_groups]
        state = optimizer.state
        try:
            try:
                taken: set[int] = set()  # the workspaces this round's chunks use
                with torch.no_grad():
                    for chunk in chunks:
                        for p in chunk.params:
                            if p in state:
                                had.add(p)
                            stored[p] = state.pop(p) if p in state else {}
                        if chunk.flat:
                            self._prepare_flat(chunk, stored, grad_of, factor, max_value, stand_ins, state, taken)
                        else:
                            sparse = isinstance(optimizer, torch.optim.SparseAdam)
                            for p in chunk.params:
                                stand_in = _like(p, self._widen(p, stored[p]))
                                stand_in.grad = _like(p, self._grad(grad_of(p), factor, max_value, sparse))
                                stand_ins[p] = stand_in
                                state[stand_in] = self._decode(p, stored[p])
                members = set(stand_ins)
                for group, params in zip(optimizer.param_groups, groups, strict=True):
                    group["params"] = [stand_ins[p] for p in params if p in members]
                optimizer.step()
            except BaseException:
                for p in stored:  # nothing written: the parameters and their states as they were
                    if p in stand_ins:
                        state.pop(stand_ins[p], None)
                    if p in had:
                        state[p] = stored[p]
                raise
            finally:
                for group, params in zip(optimizer.param_groups, groups, strict=True):
                    group["params"] = params
            try:
                with interrupts.held_entirely(), torch.no_grad():
                    for chunk in chunks:
                        if chunk.flat:
                            self._land_flat(chunk, stored, stand_ins, state, index)
                        else:
                            sparse = isinstance(optimizer, torch.optim.SparseAdam)
                            for p in chunk.params:
                                new_state = state.pop(stand_ins[p])
                                state[p] = self._commit(p, stand_ins[p], new_state, stored[p], index[p])
            except BaseException:  # what has not landed keeps its state, no stand-in stays
                for p in stored:
                    if p in stand_ins:
                        state.pop(stand_ins[p], None)
                    if p in had:
                        state.setdefault(p, stored[p])
                raise
        finally:
            for chunk in chunks:
                if chunk.work is not None:
                    chunk.work.free()

    # --- the flat path --------------------------------------------------------------------------------------------

    def _workspace(self, params: list[Tensor], locals_: list[Tensor], taken: set[int]) -> Workspace:
        """Buffers and stand-ins for the chunk's layout (local shapes, dtype, device; a DTensor's mesh and placements),
        made at the first step that meets it and kept (their memory freed between steps): chunks of one layout share
        them, a round's chunks apart (``taken``: the workspaces already in use in this round)."""
        layout: tuple[Any, ...] = (locals_[0].device, locals_[0].dtype, *(
            (local.shape, id(p.device_mesh), tuple(p.placements), p.shape, p.stride()) if _is_sharded(p)  # type: ignore[attr-defined]
            else local.shape for p, local in zip(params, locals_, strict=True)))
        occurrence = 0
        while (work := self._works.get((layout, occurrence))) is not None and id(work) in taken:
            occurrence += 1
        if work is not None:
            self._works.move_to_end((layout, occurrence))
        else:
            work = self._works[(layout, occurrence)] = Workspace([local.shape for local in locals_],
                                                                 locals_[0].device, locals_[0].dtype)
            while len(self._works) > _MAX_WORKSPACES:  # the least recently used
                self._works.popitem(last=False)
            weights, grads = work.buffer("weight", torch.float32), work.buffer("grad", torch.float32)
            for p, weight, grad in zip(params, weights.views, grads.views, strict=True):
                # Aliases of the views, not the views: an optimizer that rebinds `p.data` rebinds its stand-in only.
                work.stand_ins.append(_like(p, weight.detach()))
                work.stand_in_grads.append(_like(p, grad.detach()))
        taken.add(id(work))
        weights = work.buffer("weight", torch.float32)
        for i, (p, stand_in) in enumerate(zip(params, work.stand_ins, strict=True)):
            if _local(stand_in).data_ptr() != weights.views[i].data_ptr():  # rebound by the optimizer: made again
                stand_in = work.stand_ins[i] = _like(p, weights.views[i].detach())
            if stand_in.grad is not work.stand_in_grads[i]:  # (an optimizer that drops its gradients)
                stand_in.grad = work.stand_in_grads[i]
        return work

    def _target_form(self, p: Tensor, local: Tensor) -> str:
        """How the step stores a moment of ``p`` now: a form of ``_true_flat.FLAT_FORMS``, or ``"other"`` (8-bit)."""
        if local.dtype == torch.float32:
            return "plain"
        if self.states == "float32":
            return "float32"
        if self.states == "8bit" and _fits_8bit(p, local):
            return "other"
        if local.dtype == torch.float16:  # at a power of two, one for the whole tensor: sharded, its largest is global
            return "other" if _is_sharded(p) else "f16"
        return "plain"

    def _prepare_flat(self, chunk: _Chunk, stored: dict[Tensor, dict[str, Any]],
                      grad_of: Callable[[Tensor], Tensor], factor: Tensor | None, max_value: float | None,
                      stand_ins: dict[Tensor, Tensor], state: Any, taken: set[int]) -> None:
        params = chunk.params
        locals_ = [_local(p) for p in params]
        work = chunk.work = self._workspace(params, locals_, taken)
        remainders = None
        if self.update == "compensated" and work.weight_dtype != torch.float32:
            remainders = [_local(stored[p][REMAINDER]) if REMAINDER in stored[p] else None for p in params]
        widen_weights(work, locals_, remainders)
        widen_grads(work, [_local(grad_of(p)) for p in params], factor, max_value)
        # The states every parameter of the chunk stores in the form the step writes now: decoded on flat buffers.
        forms = [{found[0]: found[1] for key, value in stored[p].items() if (found := _stored_form(key, value, p))}
                 for p in params]
        targets = [self._target_form(p, local) for p, local in zip(params, locals_, strict=True)]
        for name, form in forms[0].items():
            if all(f.get(name) == form == target for f, target in zip(forms, targets, strict=True)):
                values_key, parts_key = _stored_keys(name, form)
                values = [_local(stored[p][values_key]) for p in params]
                parts = None if parts_key is None else [_local(stored[p][parts_key]) for p in params]
                chunk.states[name] = (form, decode_state(work, name, form, values, parts))
        clones: dict[tuple[int, Any], Tensor] = {}
        decoded = []
        flat_keys = {key for name, (form, _) in chunk.states.items() for key in _stored_keys(name, form)}
        for i, p in enumerate(params):
            rest = {key: value for key, value in stored[p].items() if key not in flat_keys}
            states = self._decode(p, rest, clones, i)
            for name, (_, buffer) in chunk.states.items():
                states[name] = self._alias(work, name, buffer, p, i)
            decoded.append(states)
        if clones:
            for (i, key), copy in zip(clones, _clone_all(list(clones.values())), strict=True):
                decoded[i][key] = copy
        for p, stand_in, states in zip(params, work.stand_ins, decoded, strict=True):
            stand_ins[p] = stand_in
            state[stand_in] = states

    @staticmethod
    def _alias(work: Workspace, name: str, buffer: Any, p: Tensor, i: int) -> Tensor:
        """What the optimizer updates as state ``name`` of the chunk's ``i``-th parameter: an alias of the buffer's
        view, made once (again where the optimizer rebound it)."""
        aliases = work.aliases.setdefault(name, [None] * len(work.shapes))  # type: ignore[list-item]
        alias = aliases[i]
        if alias is None or _local(alias).data_ptr() != buffer.views[i].data_ptr():
            alias = aliases[i] = _like(p, buffer.views[i].detach())
        return alias

    def _land_flat(self, chunk: _Chunk, stored: dict[Tensor, dict[str, Any]], stand_ins: dict[Tensor, Tensor],
                   state: Any, index: dict[Tensor, int]) -> None:
        params, work = chunk.params, chunk.work
        assert work is not None
        dtype = work.weight_dtype
        new_states = [state.pop(stand_ins[p]) for p in params]
        generator = None
        kept = (ROUNDS, REMAINDER) if self.update == "compensated" else (ROUNDS,)
        fresh = [{key: stored[p][key] for key in kept if key in stored[p]} for p in params]
        if dtype != torch.float32 and self.update != "nearest":
            first = params[0]
            generator = self._generator(work.device)
            rounds = int(stored[first].get(ROUNDS, 0))
            generator.manual_seed(_seed(self.seed, index[first], rounds, _shard_index(first)))
            for p, own in zip(params, fresh, strict=True):
                own[ROUNDS] = int(stored[p].get(ROUNDS, 0)) + 1
        wide = work.buffer("weight", torch.float32)
        for i, stand_in in enumerate(work.stand_ins):
            local = _local(stand_in)
            if local.data_ptr() != wide.views[i].data_ptr():  # the optimizer rebound it (`p.data = ...`): its values
                wide.views[i].copy_(local)
        weights = land_weights(work, [_local(p) for p in params], self.update, generator,
                               self.meter if dtype != torch.float32 else None)
        copies: list[tuple[list[Tensor], list[Tensor]]] = [([_local(p) for p in params], weights.views)]
        if self.update == "compensated" and dtype != torch.float32:
            targets = []
            for p, own in zip(params, fresh, strict=True):
                if REMAINDER not in own:  # a parameter's first step
                    own[REMAINDER] = _like(p, torch.empty_like(_local(p)))
                targets.append(_local(own[REMAINDER]))
            copies.append((targets, work.buffer("remainder", dtype).views))
        for name, (form, buffer) in sorted(chunk.states.items()):
            aliases = work.aliases[name]
            if not all(new.get(name) is alias and _local(alias).data_ptr() == view.data_ptr()
                       for new, alias, view in zip(new_states, aliases, buffer.views, strict=True)):
                continue  # the optimizer put another tensor there: encoded on the per-parameter path below
            values, parts = encode_state(work, name, form, dtype, generator)
            values_key, parts_key = _stored_keys(name, form)
            copies.append(([_local(stored[p][values_key]) for p in params], values))
            if parts_key is not None and parts is not None:
                copies.append(([_local(stored[p][parts_key]) for p in params], parts))
            for p, own, new in zip(params, fresh, new_states, strict=True):
                own[values_key] = stored[p][values_key]
                if parts_key is not None:
                    own[parts_key] = stored[p][parts_key]
                del new[name]
        for p, own, new in zip(params, fresh, new_states, strict=True):
            for key, value in new.items():
                encoded = self._encode(key, value, p, own, generator)
                if encoded is not None:
                    own[key] = encoded
        for targets, sources in copies:
            foreach_copy_(targets, sources)
        for p, own in zip(params, fresh, strict=True):
            state[p] = own

    # --- the per-parameter path -----------------------------------------------------------------------------------

    def _widen(self, p: Tensor, own: dict[str, Any]) -> Tensor:
        local = _local(p)
        if local.dtype == torch.float32:  # a layer kept in fp32 (the layer policy): stepped as it is
            return local.detach().clone()
        remainder = own.get(REMAINDER)
        if self.update == "compensated" and remainder is not None:
            return join_remainder(local, _local(remainder).view(torch.int16))
        return local.float()

    @staticmethod
    def _grad(grad: Tensor, factor: Tensor | None, max_value: float | None, sparse: bool) -> Tensor:
        """The gradient in fp32, unscaled and clipped. A sparse one (an embedding with ``sparse=True``) is made dense
        (its optimizer's momentum would be sparse, not storable in 16 bits), except for an optimizer that takes sparse
        gradients only (``sparse``: SparseAdam, whose states are dense): its values widened."""
        grad = _local(grad)
        if grad.is_sparse and sparse:
            grad = grad.coalesce()
            values = grad.values().float()
            if factor is not None:
                values.mul_(factor.to(values.device))
            if max_value is not None:
                values.clamp_(-max_value, max_value)
            return torch.sparse_coo_tensor(grad.indices(), values, grad.shape, is_coalesced=True)
        if grad.is_sparse:
            grad = grad.to_dense()
        grad = grad.float()
        if factor is not None:
            grad.mul_(factor.to(grad.device))
        if max_value is not None:
            grad.clamp_(-max_value, max_value)
        return grad

    def _decode(self, p: Tensor, stored: dict[str, Any], clones: dict[tuple[int, Any], Tensor] | None = None,
                position: int = 0) -> dict[str, Any]:
        """The parameter's states as its optimizer keeps them, in fp32 where they are stored otherwise. A plain tensor
        that is not a moment (a step counter) is copied: the optimizer updates it in place, and a step that fails or is
        interrupted gives the parameter back its state as it was (copied here, or by the caller, together, when
        ``clones`` collects them)."""
        states: dict[str, Any] = {}
        for key, value in stored.items():
            if isinstance(key, str) and key.startswith(HIGH):
                name = key[len(HIGH):]
                high = _local(value).view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
                low = _local(stored[LOW + name]).view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)
                states[name] = _like_value(value, high.bitwise_or_(low).view(torch.float32))
            elif isinstance(key, str) and key.startswith(SCALED):
                name = key[len(SCALED):]
                widened = torch.ldexp(_local(value).float(), -_local(stored[EXP + name]).to(value.device, torch.int32))
                states[name] = _like(p, widened.square() if name in SQUARED else widened)
            elif isinstance(key, str) and key.startswith(CODES):
                states[key[len(CODES):]] = _like(p, self._dequantize(p, key[len(CODES):], _local(value), stored))
            elif is_own_key(key) or (isinstance(key, str) and HIGH + key in stored):
                continue  # (a value also kept as its halves: read from them, exact)
            elif not is_moment(key, value, p):
                if type(value) is Tensor and clones is not None:
                    clones[(position, key)] = value
                    states[key] = value
                else:
                    states[key] = value.clone() if isinstance(value, Tensor) else value
            elif is_low_bit(_local(value)):
                # A torchao low-bit optimizer's state: already compact, and read and written by that optimizer itself
                # (in place: a step that fails inside it may leave it updated).
                states[key] = value
            else:
                widened = _local(value).to(torch.float32, copy=True)  # (fp32 already in a layer kept so: copied too)
                states[key] = _like(p, widened)
        return states

    def _commit(self, p: Tensor, stand_in: Tensor, new_state: dict[str, Any], own: dict[str, Any],
                index: int) -> dict[str, Any]:
        """Land the stepped fp32 weight and states in their storage, and return the parameter's new state. ``own``, its
        state from before the step (holding our keys), is left as it was, and the weight is written last: an error
        on the way leaves the parameter and its state as they were."""
        old = _local(p)
        new = _local(stand_in)
        # Every state is encoded anew: an encoding of another setting (a resume that changed `optimizer_states`, or
        # `update` away from "compensated") would stay in the state, and in every checkpoint, for good, and be read
        # again in place of the state.
        kept = (ROUNDS, REMAINDER) if self.update == "compensated" else (ROUNDS,)
        fresh = {key: own[key] for key in kept if key in own}
        generator = None
        if old.dtype != torch.float32 and self.update != "nearest":
            rounds = int(own.get(ROUNDS, 0))
            generator = self._generator(new.device)
            generator.manual_seed(_seed(self.seed, index, rounds, _shard_index(p)))
            fresh[ROUNDS] = rounds + 1
        meter = self.meter if old.dtype != torch.float32 else None
        landed = self._land_checked(p, old, new, own, fresh, generator, meter)
        for key, value in new_state.items():
            encoded = self._encode(key, value, p, fresh, generator)
            if encoded is not None:
                fresh[key] = encoded
        old.copy_(landed)
        return fresh

    def _land_checked(self, p: Tensor, old: Tensor, new: Tensor, own: dict[str, Any], fresh: dict[str, Any],
                      generator: torch.Generator | None, meter: RoundingMeter | None) -> Tensor:
        """The 16-bit weight ``new`` lands as (its remainder into ``fresh``): a value the optimizer left non-finite, or
        one the 16-bit format cannot hold, keeps the old one (nothing non-finite is written); and the meter, when a
        monitor measures, counts."""
        before = self._widen(p, own)
        new = torch.where(torch.isfinite(new), new, before)
        if old.dtype == torch.float32:
            return new
        if self.update == "compensated":
            weight, remainder = split_remainder(new, old.dtype)
            fits = torch.isfinite(weight)
            if REMAINDER in own:
                remainder = torch.where(fits, remainder, _local(own[REMAINDER]).view(torch.int16))
            else:
                remainder = torch.where(fits, remainder, 0)
            landed = torch.where(fits, weight, old)
            fresh[REMAINDER] = _like(p, remainder.view(old.dtype))
        else:
            landed = stochastic_round(new, old.dtype, generator) if generator is not None else new.to(old.dtype)
            # A finite fp32 value beyond the 16-bit format's largest (fp16: 65504) rounds to inf: it keeps its value.
            landed = torch.where(torch.isfinite(landed), landed, old)
        if meter is not None:
            meter.add(old, before, new, landed)
        return landed

    def _encode(self, key: Any, value: Any, p: Tensor, own: dict[str, Any], generator: torch.Generator | None) -> Any:
        weight_dtype = _local(p).dtype
        if weight_dtype != torch.float32 and is_scalar_fp32(key, value, p):
            # Also as its two halves, which the step reads: torch's load casts it to the weight dtype (a resumed run
            # would differ). Kept under its name too: the optimizer's own load requires it there (ASGD's `eta`).
            bits = _local(value).contiguous().view(torch.int32)
            own[HIGH + str(key)] = _like_value(value, bits.bitwise_right_shift(16).to(torch.int16).view(weight_dtype))
            own[LOW + str(key)] = _like_value(value, bits.to(torch.int16).view(weight_dtype))
            return value
        if not is_moment(key, value, p) or weight_dtype == torch.float32 or is_low_bit(_local(value)):
            return value
        local = _local(value).float()
        if self.states == "float32":
            bits = local.contiguous().view(torch.int32)
            own[HIGH + str(key)] = _like(p, bits.bitwise_right_shift(16).to(torch.int16).view(weight_dtype))
            own[LOW + str(key)] = _like(p, bits.to(torch.int16).view(weight_dtype))
            return None
        if self.states == "8bit" and _fits_8bit(p, local):
            quantized = self._optim_state_8bit().zeros(local.shape, signed=key not in NON_NEGATIVE,
                                                       block_size=BLOCK, device=local.device)
            quantized.copy_(local)
            own[CODES + str(key)] = _like_flat(p, quantized.codes.reshape(-1).view(torch.int16).view(weight_dtype))
            own[SCALES + str(key)] = _like_flat(p, quantized.scale.view(torch.int16).view(weight_dtype))
            return None
        if weight_dtype == torch.float16 and value.numel() > 0:  # (an empty state has no largest element)
            # fp16 would flush a second moment of small gradients to zero (and the next update would divide by ~0):
            # stored at a power of two that puts its largest element near 2**14, one for the whole (sharded) tensor so
            # that a checkpoint holds one value for every rank; a sum of squares as its square root (SQUARED).
            largest = value.abs().amax()
            largest = _local(largest.full_tensor() if _is_sharded(largest) else largest)
            if key in SQUARED:
                local, largest = local.sqrt(), largest.sqrt()
            exponent = torch.where(largest > 0, FP16_TOP - torch.frexp(largest).exponent, 0).to(torch.int32)
            local = torch.ldexp(local, exponent.to(local.device))
            own[EXP + str(key)] = exponent.to(weight_dtype)  # a small integer: exact in fp16
        rounded = stochastic_round(local.contiguous(), weight_dtype, generator) if generator is not None \
            else local.to(weight_dtype)
        if EXP + str(key) in own:
            own[SCALED + str(key)] = _like(p, rounded)
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
        signed = key not in NON_NEGATIVE
        qmap = self._qmaps.get((signed, local.device))
        if qmap is None:  # torchao's map of 256 values, the same for every state of a sign
            qmap = self._optim_state_8bit().zeros((BLOCK,), signed=signed, block_size=BLOCK, device=local.device).qmap
            self._qmaps[(signed, local.device)] = qmap
        scale = _local(stored[SCALES + key]).view(torch.int16).view(torch.float32)
        quantized = self._optim_state_8bit()(codes.view(torch.int16).view(torch.uint8).reshape(local.shape), scale,
                                              qmap, signed)
        return quantized.dequantize()

    def _optim_state_8bit(self) -> Any:
        if self._8bit is None:
            self._8bit = _imports.import_quietly("torchao.optim.subclass_8bit").OptimState8bit
        return self._8bit


def _like_value(value: Tensor, local: Tensor) -> Tensor:
    """``local`` as ``value`` is (a state of its own shape, not the parameter's): a DTensor with its mesh and
    placements when it is one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return local
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                              stride=value.stride())
