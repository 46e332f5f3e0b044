"""The chunks of the true-precision step, and the bookkeeping of its flat path: a chunk's workspace (kept per layout),
what the optimizer steps in the parameters' place (views of its fp32 buffers) and how each state and weight comes back
out of them. The conversions on the buffers themselves are ``flat``'s.

In a chunk on the flat path, a state stored in another form than the step writes now (a resume that changed a setting),
or one the optimizer replaced by another tensor, is read and written one parameter at a time (``StateCodec``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_precision._core.true.flat import decode_state, encode_state, land_weights, widen_grads, widen_weights
from lightning_precision._core.true.keys import REMAINDER
from lightning_precision._core.true.rounding_meter import RoundingMeter
from lightning_precision._core.true.shards import is_sharded, like, local_part
from lightning_precision._core.true.states import StateCodec, clone_all, stored_form, stored_keys
from lightning_precision._core.true.workspace import Workspace
from lightning_precision._upstream.torch import foreach_copy_

if TYPE_CHECKING:  # (an import here would make the plugins' imports one level deeper)
    from lightning_precision._core.true.rounding_policy import RoundingPolicy

__all__ = ["MAX_WORKSPACES", "Chunk", "FlatPath"]

MAX_WORKSPACES = 64  # chunk layouts kept (views only: their memory is freed between steps), the least recent dropped


@dataclass
class Chunk:
    """Parameters stepped together: on flat buffers (``work``), or one by one (``flat=False``)."""

    params: list[Tensor]
    flat: bool
    work: Workspace | None = None
    # name -> (form, fp32 buffer) of the states decoded on the flat buffers
    states: dict[str, tuple[str, Any]] = field(default_factory=dict)


def _alias(work: Workspace, name: str, buffer: Any, p: Tensor, i: int) -> Tensor:
    """What the optimizer updates as state ``name`` of the chunk's ``i``-th parameter: an alias of the buffer's view,
    made once (again where the optimizer rebound it)."""
    aliases = work.aliases.setdefault(name, [None] * len(work.shapes))  # type: ignore[list-item]
    alias = aliases[i]
    if alias is None or local_part(alias).data_ptr() != buffer.views[i].data_ptr():
        alias = aliases[i] = like(p, buffer.views[i].detach())
    return alias


class FlatPath:
    """The flat path of a ``TrueStep``: its workspaces by layout (``works``), a chunk prepared on them for the
    optimizer (``prepare``) and landed from them (``land``)."""

    def __init__(self, codec: StateCodec, rounding: RoundingPolicy) -> None:
        self.codec, self.rounding = codec, rounding
        self.works: OrderedDict[tuple[Any, ...], Workspace] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["works"] = OrderedDict()  # views of buffers: made again where the copy steps
        return state

    def workspace(self, params: list[Tensor], locals_: list[Tensor], taken: set[int]) -> Workspace:
        """Buffers and stand-ins for the chunk's layout (local shapes, dtype, device; a DTensor's mesh and placements),
        made at the first step that meets it and kept (their memory freed between steps): chunks of one layout share
        them, a round's chunks apart (``taken``: the workspaces already in use in this round)."""
        layout: tuple[Any, ...] = (locals_[0].device, locals_[0].dtype, *(
            (local.shape, id(p.device_mesh), tuple(p.placements), p.shape, p.stride()) if is_sharded(p)  # type: ignore[attr-defined]
            else local.shape for p, local in zip(params, locals_, strict=True)))
        occurrence = 0
        while (work := self.works.get((layout, occurrence))) is not None and id(work) in taken:
            occurrence += 1
        if work is not None:
            self.works.move_to_end((layout, occurrence))
        else:
            work = self.works[(layout, occurrence)] = Workspace([local.shape for local in locals_],
                                                                locals_[0].device, locals_[0].dtype)
            while len(self.works) > MAX_WORKSPACES:  # the least recently used
                self.works.popitem(last=False)
            weights, grads = work.buffer("weight", torch.float32), work.buffer("grad", torch.float32)
            for p, weight, grad in zip(params, weights.views, grads.views, strict=True):
                # Aliases of the views, not the views: an optimizer that rebinds `p.data` rebinds its stand-in only.
                work.stand_ins.append(like(p, weight.detach()))
                work.stand_in_grads.append(like(p, grad.detach()))
        taken.add(id(work))
        weights = work.buffer("weight", torch.float32)
        for i, (p, stand_in) in enumerate(zip(params, work.stand_ins, strict=True)):
            if local_part(stand_in).data_ptr() != weights.views[i].data_ptr():  # rebound by the optimizer: made again
                stand_in = work.stand_ins[i] = like(p, weights.views[i].detach())
            if stand_in.grad is not work.stand_in_grads[i]:  # (an optimizer that drops its gradients)
                stand_in.grad = work.stand_in_grads[i]
        return work

    def prepare(self, chunk: Chunk, stored: dict[Tensor, dict[str, Any]], grad_of: Callable[[Tensor], Tensor],
                factor: Tensor | None, max_value: float | None, stand_ins: dict[Tensor, Tensor], state: Any,
                taken: set[int]) -> None:
        """The chunk's weights, gradients and states widened into its workspace, and its stand-ins with their states
        put in the optimizer's ``state`` (``stand_ins``: each parameter's)."""
        params = chunk.params
        locals_ = [local_part(p) for p in params]
        work = chunk.work = self.workspace(params, locals_, taken)
        remainders = None
        if self.rounding.update == "compensated" and work.weight_dtype != torch.float32:
            remainders = [local_part(stored[p][REMAINDER]) if REMAINDER in stored[p] else None for p in params]
        widen_weights(work, locals_, remainders)
        widen_grads(work, [local_part(grad_of(p)) for p in params], factor, max_value)
        self._decode_flat(chunk, stored, locals_)
        clones: dict[tuple[int, Any], Tensor] = {}
        decoded = []
        flat_keys = {key for name, (form, _) in chunk.states.items() for key in stored_keys(name, form)}
        for i, p in enumerate(params):
            rest = {key: value for key, value in stored[p].items() if key not in flat_keys}
            states = self.codec.decode(p, rest, clones, i)
            for name, (_, buffer) in chunk.states.items():
                states[name] = _alias(work, name, buffer, p, i)
            decoded.append(states)
        if clones:
            for (i, key), copy in zip(clones, clone_all(list(clones.values())), strict=True):
                decoded[i][key] = copy
        for p, stand_in, states in zip(params, work.stand_ins, decoded, strict=True):
            stand_ins[p] = stand_in
            state[stand_in] = states

    def _decode_flat(self, chunk: Chunk, stored: dict[Tensor, dict[str, Any]], locals_: list[Tensor]) -> None:
        """The states every parameter of the chunk stores in the form the step writes now: decoded on flat buffers
        (``chunk.states``)."""
        params, work = chunk.params, chunk.work
        assert work is not None
        forms = [{found[0]: found[1] for key, value in stored[p].items() if (found := stored_form(key, value, p))}
                 for p in params]
        targets = [self.codec.target_form(p, local) for p, local in zip(params, locals_, strict=True)]
        for name, form in forms[0].items():
            if all(f.get(name) == form == target for f, target in zip(forms, targets, strict=True)):
                values_key, parts_key = stored_keys(name, form)
                values = [local_part(stored[p][values_key]) for p in params]
                parts = None if parts_key is None else [local_part(stored[p][parts_key]) for p in params]
                chunk.states[name] = (form, decode_state(work, name, form, values, parts))

    def land(self, chunk: Chunk, stored: dict[Tensor, dict[str, Any]], stand_ins: dict[Tensor, Tensor], state: Any,
             index: dict[Tensor, int], meter: RoundingMeter | None) -> None:
        """The chunk's stepped weights and states written from its workspace, each parameter's new state put back in
        the optimizer's ``state``; the copies into the parameters and their stored states come last, together."""
        params, work = chunk.params, chunk.work
        assert work is not None
        dtype = work.weight_dtype
        new_states = [state.pop(stand_ins[p]) for p in params]
        fresh, generator = self.rounding.begin(params, [stored[p] for p in params], index[params[0]], dtype,
                                               work.device)
        wide = work.buffer("weight", torch.float32)
        for i, stand_in in enumerate(work.stand_ins):
            local = local_part(stand_in)
            if local.data_ptr() != wide.views[i].data_ptr():  # the optimizer rebound it (`p.data = ...`): its values
                wide.views[i].copy_(local)
        weights = land_weights(work, [local_part(p) for p in params], self.rounding.update, generator,
                               meter if dtype != torch.float32 else None)
        copies: list[tuple[list[Tensor], list[Tensor]]] = [([local_part(p) for p in params], weights.views)]
        if self.rounding.update == "compensated" and dtype != torch.float32:
            targets = []
            for p, own in zip(params, fresh, strict=True):
                if REMAINDER not in own:  # a parameter's first step
                    own[REMAINDER] = like(p, torch.empty_like(local_part(p)))
                targets.append(local_part(own[REMAINDER]))
            copies.append((targets, work.buffer("remainder", dtype).views))
        copies += self._encode_flat(chunk, stored, fresh, new_states, generator)
        for p, own, new in zip(params, fresh, new_states, strict=True):
            self.codec.encode_all(new, p, own, generator)
        for targets, sources in copies:
            foreach_copy_(targets, sources)
        for p, own in zip(params, fresh, strict=True):
            state[p] = own

    def _encode_flat(self, chunk: Chunk, stored: dict[Tensor, dict[str, Any]], fresh: list[dict[str, Any]],
                     new_states: list[dict[str, Any]],
                     generator: torch.Generator | None) -> list[tuple[list[Tensor], list[Tensor]]]:
        """The states decoded on flat buffers encoded there, as the copies into their stored tensors (kept in
        ``fresh``); taken out of ``new_states``. A state the optimizer replaced by another tensor stays there: encoded
        on the per-parameter path."""
        params, work = chunk.params, chunk.work
        assert work is not None
        copies: list[tuple[list[Tensor], list[Tensor]]] = []
        for name, (form, buffer) in sorted(chunk.states.items()):
            aliases = work.aliases[name]
            if not all(new.get(name) is alias and local_part(alias).data_ptr() == view.data_ptr()
                       for new, alias, view in zip(new_states, aliases, buffer.views, strict=True)):
                continue
            values, parts = encode_state(work, name, form, work.weight_dtype, generator)
            values_key, parts_key = stored_keys(name, form)
            copies.append(([local_part(stored[p][values_key]) for p in params], values))
            if parts_key is not None and parts is not None:
                copies.append(([local_part(stored[p][parts_key]) for p in params], parts))
            for p, own, new in zip(params, fresh, new_states, strict=True):
                own[values_key] = stored[p][values_key]
                if parts_key is not None:
                    own[parts_key] = stored[p][parts_key]
                del new[name]
        return copies
