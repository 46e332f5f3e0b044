"""The true-precision step's tensors as this rank holds them: a parameter's (or state's) local part, tensors made as it
is (a DTensor of its mesh and placements, without communication), and which shard of it this rank holds.

Torch alone: the step's modules sit deep in the plugins' imports.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["is_sharded", "like", "like_flat", "local_part", "shard_count", "shard_index"]


def local_part(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor`` (a DTensor's local tensor; any other tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(tensor: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def like(reference: Tensor, local: Tensor) -> Tensor:
    """``local`` as ``reference`` is (a parameter, or a state of its own shape): a DTensor with its mesh, placements,
    shape and stride when it is one (no communication)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(reference, DTensor):
        return local
    return DTensor.from_local(local, reference.device_mesh, reference.placements, run_check=False,
                              shape=reference.shape, stride=reference.stride())


def shard_count(param: Tensor) -> int:
    """How many shards a parameter is cut into: the product of the mesh sizes along the dimensions it is sharded over
    (1 for one not sharded)."""
    if not is_sharded(param):
        return 1
    shards = 1
    for dim, placement in enumerate(param.placements):  # type: ignore[attr-defined]
        if placement.is_shard():
            shards *= param.device_mesh.size(dim)  # type: ignore[attr-defined]
    return shards


def like_flat(param: Tensor, flat: Tensor) -> Tensor:
    """A flat per-element companion of a sharded parameter (8-bit codes, block scales) as a 1-D DTensor sharded as it
    is (every shard of one size: ``true_states.fits_8bit``), so that a distributed checkpoint saves each rank's part; a
    plain tensor as it is."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return flat
    placements = [Shard(0) if placement.is_shard() else placement for placement in param.placements]
    return DTensor.from_local(flat, param.device_mesh, placements, run_check=False,
                              shape=torch.Size((flat.numel() * shard_count(param),)), stride=(1,))


def shard_index(param: Tensor) -> int:
    """Which shard of a parameter this rank holds (0 for one not sharded): its coordinate along the mesh dimensions
    the parameter is sharded over. Ranks that hold the same shard (DDP's replicas, HSDP's replicated dimension) draw
    the same rounding numbers and stay identical; under plain FSDP2 it is the rank."""
    if not is_sharded(param):
        return 0
    mesh, index = param.device_mesh, 0  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(param.placements):  # type: ignore[attr-defined]
        if placement.is_shard():
            index = index * mesh.size(dim) + coordinate[dim]
    return index
