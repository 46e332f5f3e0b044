"""The optimizer step of the true-precision plugins: the user's own optimizer, stepped in fp32 on 16-bit weights.

Weights and gradients live in bf16/fp16, optimizer states in the dtype asked for. Each step:

1. the weights are widened to fp32 (their remainders added back under ``update="compensated"``), the gradients too
   (unscaled and clipped in fp32), the states decoded to fp32;
2. those fp32 stand-ins replace the parameters in the optimizer's groups, and its own ``step()`` runs on them: any
   optimizer, with its hyperparameters, foreach/fused kernels and schedulers as configured;
3. the new fp32 weights land in the 16-bit weights by the chosen rounding, an element whose new value is not finite
   keeping its old one (nothing non-finite is ever written), and the states are encoded again.

**A constant number of ops.** Parameters of one weight dtype, device and shard go together (a *chunk*): they are
widened into flat fp32 buffers whose views (made once, ``workspace``) are the stand-ins, and every conversion runs on
the whole buffer (``flat``, kept by ``chunks``). What the step adds to the optimizer's own ops is then a fixed
number per chunk, not per parameter (on a GPU each op is a kernel launch), and it reads nothing from the device.
Parameters it cannot take so (a sparse gradient, an empty tensor) and states in another form (8-bit ones, torchao's
low-bit ones, those of a new parameter's first step) take the per-parameter path, the same values.

**Memory.** The fp32 copies exist during the step only, ``step_chunk`` elements at a time for optimizers that update
each parameter apart from the others (torch's and torchao's own: their step is called once per chunk); any other
optimizer (timm's Lamb keeps a group-level step count, others a global norm) is stepped once, on the whole model.

A step whose gradients hold inf/nan never gets here: the plugin skips it (and an fp16 plugin backs its scale off).

The optimizer's step hooks (``register_step_pre_hook``/``register_step_post_hook``, torch's global ones) run once a
step, around the whole step, and see the real parameters. A Ctrl-C during the step is raised when it has landed: a
second one raises at once while the optimizer steps, and is held too while the new values are written (a handful of
copies, so that no weight is written without its state): ``hooks``. An error the optimizer raises leaves the chunk
it was stepping as it was; chunks landed before it stay stepped.

What the step keeps beside the user's states lives in the optimizer's own state (keys in ``keys``), so that every
checkpoint (the Trainer's, ``fabric.save``, a sharded one) carries it: a weight's remainder and how many times it was
rounded (``rounding_policy``, which also seeds the stochastic rounding so that a resumed run draws what the
uninterrupted one draws), and the states in the form ``optimizer_states`` asks (``states``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_precision._core.true.chunks import Chunk, FlatPath
from lightning_precision._core.true.grads import ClipRequest, norm_factor, widen_grad
from lightning_precision._core.true.hooks import Interrupts, interrupts_held, is_stepping, step_hooks_once, stepping
from lightning_precision._core.true.keys import PLUGIN_OF, STATE_PREFIX, WRITTEN_BY, is_own_key
from lightning_precision._core.true.rounding_meter import ROUNDING_COUNTS, RoundingMeter
from lightning_precision._core.true.rounding_policy import RoundingPolicy
from lightning_precision._core.true.shards import like, local_part, shard_index
from lightning_precision._core.true.states import StateCodec, own_state_bytes
from lightning_precision._core.true.workspace import Workspace

# Beside TrueStep, what the plugins, the callbacks and `_bytes` take from here (defined in the modules above).
__all__ = ["OPTIMIZER_STATES", "ROUNDING_COUNTS", "STATE_PREFIX", "ClipRequest", "RoundingMeter", "TrueStep",
           "is_own_key", "is_stepping", "own_state_bytes", "steps_each_parameter_apart"]

OPTIMIZER_STATES = ("weight", "float32", "8bit")
# Optimizers whose step updates each parameter from its own gradient and state alone: stepped a chunk at a time.
_SEPARABLE_MODULES = ("torch.optim.", "torchao.optim.")


def steps_each_parameter_apart(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s step updates each parameter apart from the others (torch's and torchao's optimizers, not
    a subclass that overrides ``step``), so that stepping it a chunk at a time is stepping it once."""
    module = getattr(type(optimizer).step, "__module__", None) or ""
    return module.startswith(_SEPARABLE_MODULES)


def _restore(state: Any, stored: dict[Tensor, dict[str, Any]], stand_ins: dict[Tensor, Tensor], had: set[Tensor],
             keep_landed: bool) -> None:
    """After an error: no stand-in stays in the optimizer's ``state``, and each parameter that had a state has it as it
    was (``keep_landed``: except one whose new state has landed)."""
    for p in stored:
        if p in stand_ins:
            state.pop(stand_ins[p], None)
        if p in had:
            if keep_landed:
                state.setdefault(p, stored[p])
            else:
                state[p] = stored[p]


class TrueStep:
    """Steps an optimizer in fp32 on 16-bit parameters. ``dtype``: the weights' dtype; ``update``: how a new value lands
    (``rounding.UPDATES``); ``states``: the optimizer states' storage (``OPTIMIZER_STATES``)."""

    def __init__(self, dtype: torch.dtype, update: str, states: str, seed: int, step_chunk: int) -> None:
        self.dtype, self.step_chunk = dtype, step_chunk
        self.rounding = RoundingPolicy(update, seed)
        self.codec = StateCodec(states)
        self.flat_path = FlatPath(self.codec, self.rounding)
        # Set by a monitor on the steps it measures (GradientUnderflowMonitor); None: nothing counted, nothing spent.
        self.meter: RoundingMeter | None = None
        # Off in tests only: every parameter on the per-parameter path (the reference the flat path must equal).
        self.flat = True

    @property
    def update(self) -> str:
        return self.rounding.update

    @property
    def seed(self) -> int:
        return self.rounding.seed

    @property
    def states(self) -> str:
        return self.codec.states

    @property
    def _works(self) -> OrderedDict[tuple[Any, ...], Workspace]:
        """The flat path's workspaces, by layout."""
        return self.flat_path.works

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
            factor = norm_factor(params, grad_of, factor, clip)
        max_value = clip.max_value if clip is not None else None
        landed = 0
        with stepping(optimizer):
            try:
                with interrupts_held() as interrupts, step_hooks_once(optimizer):
                    for chunks in self._rounds(optimizer, params, index, grad_of):
                        self._step_round(optimizer, chunks, index, grad_of, factor, max_value, interrupts)
                        landed += sum(len(chunk.params) for chunk in chunks)
            except BaseException as error:
                if landed and hasattr(error, "add_note"):  # (Python 3.11+) say what the step left behind
                    error.add_note(f"The true-precision step of `{type(optimizer).__name__}` had stepped {landed} of"
                                   f" its {len(params)} parameters (`step_chunk` elements at a time) when this was"
                                   " raised; the others are as they were.")
                raise

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
                grad_of: Callable[[Tensor], Tensor]) -> list[list[Chunk]]:
        """The chunks, and which of them each call of the optimizer's step takes: one chunk a call for an optimizer
        that steps each parameter apart, all of them in one call for any other."""
        kinds: dict[tuple[Any, ...], list[Tensor]] = {}
        for p in params:
            local, grad = local_part(p), grad_of(p)
            flat = self.flat and local.numel() > 0 and grad.layout == torch.strided
            kinds.setdefault((flat, local.dtype, local.device, shard_index(p)), []).append(p)
        chunks = [Chunk(part, kind[0]) for kind, members in kinds.items() for part in self._split(members)]
        chunks.sort(key=lambda chunk: index[chunk.params[0]])
        if steps_each_parameter_apart(optimizer):
            return [[chunk] for chunk in chunks]
        return [chunks] if chunks else []

    def _split(self, params: list[Tensor]) -> Iterator[list[Tensor]]:
        chunk: list[Tensor] = []
        size = 0
        for p in params:
            n = local_part(p).numel()
            if chunk and size + n > self.step_chunk:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += n
        if chunk:
            yield chunk

    def _step_round(self, optimizer: Optimizer, chunks: list[Chunk], index: dict[Tensor, int],
                    grad_of: Callable[[Tensor], Tensor], factor: Tensor | None, max_value: float | None,
                    interrupts: Interrupts) -> None:
        """One call of the optimizer's step, on the stand-ins of ``chunks``, landed. An error before the landing leaves
        every parameter and its state as they were; one while landing, each chunk landed before it stepped."""
        stand_ins: dict[Tensor, Tensor] = {}
        stored: dict[Tensor, dict[str, Any]] = {}
        had: set[Tensor] = set()  # those that had a state (a first step that fails leaves none, not an empty one)
        groups = [group["params"] for group in optimizer.param_groups]
        state = optimizer.state
        try:
            try:
                with torch.no_grad():
                    self._prepare(optimizer, chunks, grad_of, factor, max_value, stored, had, stand_ins)
                members = set(stand_ins)
                for group, params in zip(optimizer.param_groups, groups, strict=True):
                    group["params"] = [stand_ins[p] for p in params if p in members]
                optimizer.step()
            except BaseException:  # nothing written: the parameters and their states as they were
                _restore(state, stored, stand_ins, had, keep_landed=False)
                raise
            finally:
                for group, params in zip(optimizer.param_groups, groups, strict=True):
                    group["params"] = params
            try:
                with interrupts.held_entirely(), torch.no_grad():
                    for chunk in chunks:
                        self._land(chunk, stored, stand_ins, state, index)
            except BaseException:  # what has not landed keeps its state, no stand-in stays
                _restore(state, stored, stand_ins, had, keep_landed=True)
                raise
        finally:
            for chunk in chunks:
                if chunk.work is not None:
                    chunk.work.free()

    def _prepare(self, optimizer: Optimizer, chunks: list[Chunk], grad_of: Callable[[Tensor], Tensor],
                 factor: Tensor | None, max_value: float | None, stored: dict[Tensor, dict[str, Any]],
                 had: set[Tensor], stand_ins: dict[Tensor, Tensor]) -> None:
        """Each parameter's state taken out of the optimizer (into ``stored``; ``had``: those that had one), and its
        fp32 stand-in (into ``stand_ins``) put in with the state decoded."""
        state = optimizer.state
        taken: set[int] = set()  # the workspaces this round's chunks use
        sparse = isinstance(optimizer, torch.optim.SparseAdam)
        for chunk in chunks:
            for p in chunk.params:
                if p in state:
                    had.add(p)
                stored[p] = state.pop(p) if p in state else {}
            if chunk.flat:
                self.flat_path.prepare(chunk, stored, grad_of, factor, max_value, stand_ins, state, taken)
                continue
            for p in chunk.params:
                stand_in = like(p, self.rounding.widen(p, stored[p]))
                stand_in.grad = like(p, widen_grad(grad_of(p), factor, max_value, sparse))
                stand_ins[p] = stand_in
                state[stand_in] = self.codec.decode(p, stored[p])

    def _land(self, chunk: Chunk, stored: dict[Tensor, dict[str, Any]], stand_ins: dict[Tensor, Tensor], state: Any,
              index: dict[Tensor, int]) -> None:
        if chunk.flat:
            self.flat_path.land(chunk, stored, stand_ins, state, index, self.meter)
            return
        for p in chunk.params:
            new_state = state.pop(stand_ins[p])
            state[p] = self._commit(p, stand_ins[p], new_state, stored[p], index[p])

    def _commit(self, p: Tensor, stand_in: Tensor, new_state: dict[str, Any], own: dict[str, Any],
                index: int) -> dict[str, Any]:
        """Land the stepped fp32 weight and states in their storage, and return the parameter's new state. ``own``, its
        state from before the step (holding our keys), is left as it was, and the weight is written last: an error
        on the way leaves the parameter and its state as they were."""
        old = local_part(p)
        new = local_part(stand_in)
        (fresh,), generator = self.rounding.begin([p], [own], index, old.dtype, new.device)
        meter = self.meter if old.dtype != torch.float32 else None
        landed = self.rounding.land(p, old, new, own, fresh, generator, meter)
        self.codec.encode_all(new_state, p, fresh, generator)
        old.copy_(landed)
        return fresh
