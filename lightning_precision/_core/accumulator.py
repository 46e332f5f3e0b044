"""Declared state for what the callbacks and the sensitivity probe measure, and the one cross-process reduction.

Each state is declared once with its reduction (torchmetrics' ``add_state(..., dist_reduce_fx=...)``, without the
dependency): ``update`` combines on the device, ``sync`` reduces every synced state across processes in one collective
per reduction and dtype, ``reset`` and ``state_dict``/``load_state_dict`` come with the declaration. Nothing here reads
a tensor on the host: an owner syncs on its logging steps only, so other steps cost no host-device synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["REDUCTIONS", "Accumulator", "Reduce", "ReduceOp", "all_reduce", "as_reduce_op"]

# "last": kept as it is, never combined across processes (a ring, a staged batch, totals already global).
REDUCTIONS = ("sum", "max", "min", "last")

Reduce = Callable[[Tensor], Tensor]  # one tensor reduced across processes, e.g. fabric.all_reduce(t, reduce_op="sum")
ReduceOp = Callable[[Tensor, str], Tensor]  # the same with the reduction named: all_reduce


def all_reduce(t: Tensor, op: str = "sum") -> Tensor:
    """``t`` reduced (``"sum"``, ``"max"`` or ``"min"``) across all processes of the default process group, as a new
    tensor; ``t`` itself when there is one process. Plain ``torch.distributed``: the Trainer's strategies and Fabric
    share that group, so every rank decides on the same numbers either way. Never in place: under ``ddp_spawn`` a
    callback's tensors reach the ranks through shared memory. NCCL reduces CUDA tensors only: a tensor elsewhere (a
    histogram nothing was added to since the last call is still on the CPU) goes to the current CUDA device."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce(op={op!r}): use one of {tuple(ops)}.")
    if dist.get_backend() == "nccl" and t.device.type != "cuda":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        t = t.clone()
    dist.all_reduce(t, op=ops[op])
    return t


def as_reduce_op(reduce: Reduce | None) -> ReduceOp | None:
    """A user's one-reduction ``reduce`` (``lambda t: fabric.all_reduce(t, reduce_op="sum")``) as ``sync`` calls it,
    for an owner whose synced states all share that reduction."""
    if reduce is None:
        return None
    return lambda t, op: reduce(t)


def _combine(reduction: str, old: Tensor, new: Tensor) -> Tensor:
    old = old.to(new.device)
    if reduction == "sum":
        return old + new
    if reduction == "max":
        return torch.maximum(old, new)
    if reduction == "min":
        return torch.minimum(old, new)
    return new.to(old.dtype)


class Accumulator:
    """Named tensor states, each with its reduction (one of ``REDUCTIONS``).

    ``update`` never writes in place (a new tensor replaces the old one): under ``ddp_spawn`` a state allocated before
    the ranks start is shared memory, and an in-place write would reach every rank.

    Example:
        >>> acc = Accumulator()
        >>> acc.add_state("count", torch.zeros((), dtype=torch.int64), "sum")
        >>> acc.add_state("peak", torch.zeros(()), "max")
        >>> acc.update("count", torch.tensor(3)); acc.update("count", torch.tensor(4))
        >>> acc.update("peak", torch.tensor(2.0)); acc.update("peak", torch.tensor(1.0))
        >>> {k: v.item() for k, v in acc.sync(None).items()}
        {'count': 7, 'peak': 2.0}
        >>> acc.reset(); acc["count"].item()
        0
    """

    def __init__(self) -> None:
        self._reductions: dict[str, str] = {}
        self._defaults: dict[str, Tensor] = {}
        self._values: dict[str, Tensor] = {}

    def add_state(self, name: str, default: Tensor, reduction: str) -> None:
        """Declare ``name``, starting at (and reset to) ``default``."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"Accumulator.add_state({name!r}, reduction={reduction!r}): use one of {REDUCTIONS}.")
        if not isinstance(default, Tensor):
            raise TypeError(f"Accumulator.add_state({name!r}, default={default!r}): a tensor, e.g. torch.zeros(()).")
        self._reductions[name] = reduction
        self._defaults[name] = default.detach()
        self._values[name] = default.detach().clone()  # an owner may write a "last" state in place

    def remove_state(self, *names: str) -> None:
        """Forget states declared for a window only (per-key counts whose keys change)."""
        for name in names:
            for d in (self._reductions, self._defaults, self._values):
                d.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __getitem__(self, name: str) -> Tensor:
        return self._values[name]

    def names(self, prefix: str = "") -> list[str]:
        """The declared states, in declaration order (the order they sync in), those starting with ``prefix``."""
        return [n for n in self._values if n.startswith(prefix)]

    def reduction(self, name: str) -> str:
        return self._reductions[name]

    def update(self, name: str, value: Tensor) -> None:
        """Combine ``value`` into ``name`` by its reduction (``"last"``: replace), on ``value``'s device."""
        self._values[name] = _combine(self._reductions[name], self._values[name], value)

    def set(self, name: str, value: Tensor) -> None:
        """Replace the value of ``name`` whatever its reduction (a state the owner combined itself)."""
        if name not in self._reductions:
            raise KeyError(f"Accumulator.set({name!r}): declare it first with add_state.")
        self._values[name] = value

    def reset(self, *names: str) -> None:
        """Back to the declared defaults: ``names``, or every state."""
        for name in names or tuple(self._values):
            self._values[name] = self._defaults[name].clone()

    def sync(self, reduce: ReduceOp | None, names: Iterable[str] | None = None) -> dict[str, Tensor]:
        """``names`` (default: every state), each reduced across processes by its reduction with ``reduce(tensor,
        op)`` (``all_reduce``; None: this process's values). States of one reduction and dtype travel as one
        flattened tensor, so each such group costs one collective (a lone state keeps its shape). The states are left
        as they are; ``"last"`` states are returned unreduced."""
        chosen = list(self._values) if names is None else list(names)
        out = {name: self._values[name] for name in chosen}
        if reduce is None:
            return out
        groups: dict[tuple[str, torch.dtype], list[str]] = {}
        for name in chosen:
            if self._reductions[name] != "last":
                groups.setdefault((self._reductions[name], self._values[name].dtype), []).append(name)
        for (op, _), members in groups.items():
            if len(members) == 1:
                out[members[0]] = reduce(self._values[members[0]], op)
                continue
            tensors = [self._values[n] for n in members]
            device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
            flat = reduce(torch.cat([t.reshape(-1).to(device) for t in tensors]), op)
            for name, part in zip(members, flat.split([t.numel() for t in tensors]), strict=True):
                out[name] = part.view(self._values[name].shape)
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """Every state's value, on the CPU."""
        return {name: value.cpu() for name, value in self._values.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore declared states from ``state_dict`` (on each state's default device); an undeclared name is a
        ``KeyError`` naming it."""
        unknown = [name for name in state_dict if name not in self._reductions]
        if unknown:
            raise KeyError(f"Accumulator.load_state_dict: undeclared state(s) {unknown}; declared:"
                           f" {list(self._values)}.")
        for name, value in state_dict.items():
            self._values[name] = torch.as_tensor(value).to(self._defaults[name].device)
