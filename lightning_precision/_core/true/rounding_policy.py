"""How the true-precision step lands its new fp32 weights in 16 bits (``update``, the functions of ``rounding``), and
what it keeps for that beside the user's states: a weight's remainder (``"compensated"``) and how many times it was
rounded.

Stochastic rounding draws, per chunk, from a generator seeded with the plugin's seed, the chunk's first parameter's
index, how many times it was rounded (``lp.rounds``) and its shard: a resumed run draws what the uninterrupted one
draws (with the same ``step_chunk``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_precision._core.true.keys import REMAINDER, ROUNDS
from lightning_precision._core.true.rounding import join_remainder, split_remainder, stochastic_round
from lightning_precision._core.true.rounding_meter import RoundingMeter
from lightning_precision._core.true.shards import like, local_part, shard_index

__all__ = ["RoundingPolicy", "seed_of"]


def seed_of(seed: int, index: int, rounds: int, rank: int) -> int:
    """A 63-bit seed per (plugin seed, parameter, step, rank): splitmix64's finaliser over their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + rounds * 0x94D049BB133111EB + rank) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


class RoundingPolicy:
    """``update`` (``rounding.UPDATES``) and ``seed`` of a ``TrueStep``, with a generator per device."""

    def __init__(self, update: str, seed: int) -> None:
        self.update, self.seed = update, seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_generators"] = {}  # seeded again at every chunk
        return state

    def begin(self, params: list[Tensor], owns: list[dict[str, Any]], index: int, dtype: torch.dtype,
              device: torch.device) -> tuple[list[dict[str, Any]], torch.Generator | None]:
        """The new own states of a chunk's parameters (``owns``: theirs from before the step; ``index``: the first
        one's), holding what is kept across steps (their rounds counted one more where rounding draws), and the
        generator seeded for the chunk (None: nothing drawn). Every other key is encoded anew: an encoding of another
        setting (a resume that changed ``optimizer_states``, or ``update`` away from "compensated") would stay in the
        state, and in every checkpoint, for good, and be read again in place of the state."""
        kept = (ROUNDS, REMAINDER) if self.update == "compensated" else (ROUNDS,)
        fresh = [{key: own[key] for key in kept if key in own} for own in owns]
        if dtype == torch.float32 or self.update == "nearest":
            return fresh, None
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        generator.manual_seed(seed_of(self.seed, index, int(owns[0].get(ROUNDS, 0)), shard_index(params[0])))
        for own, new in zip(owns, fresh, strict=True):
            new[ROUNDS] = int(own.get(ROUNDS, 0)) + 1
        return fresh, generator

    def widen(self, p: Tensor, own: dict[str, Any]) -> Tensor:
        """The fp32 value a 16-bit weight stands for (with its remainder); a weight kept in fp32 copied."""
        local = local_part(p)
        if local.dtype == torch.float32:  # a layer kept in fp32 (the layer policy): stepped as it is
            return local.detach().clone()
        remainder = own.get(REMAINDER)
        if self.update == "compensated" and remainder is not None:
            return join_remainder(local, local_part(remainder).view(torch.int16))
        return local.float()

    def land(self, p: Tensor, old: Tensor, new: Tensor, own: dict[str, Any], fresh: dict[str, Any],
             generator: torch.Generator | None, meter: RoundingMeter | None) -> Tensor:
        """The 16-bit weight (``old``: ``p``'s local part) the stepped fp32 ``new`` lands as (its remainder into
        ``fresh``): a value the optimizer left non-finite, or one the 16-bit format cannot hold, keeps the old one
        (nothing non-finite is written); and the meter, when a monitor measures, counts. ``own``: the parameter's state
        from before the step."""
        before = self.widen(p, own)
        new = torch.where(torch.isfinite(new), new, before)
        if old.dtype == torch.float32:
            return new
        if self.update == "compensated":
            weight, remainder = split_remainder(new, old.dtype)
            fits = torch.isfinite(weight)
            if REMAINDER in own:
                remainder = torch.where(fits, remainder, local_part(own[REMAINDER]).view(torch.int16))
            else:
                remainder = torch.where(fits, remainder, 0)
            landed = torch.where(fits, weight, old)
            fresh[REMAINDER] = like(p, remainder.view(old.dtype))
        else:
            landed = stochastic_round(new, old.dtype, generator) if generator is not None else new.to(old.dtype)
            # A finite fp32 value beyond the 16-bit format's largest (fp16: 65504) rounds to inf: it keeps its value.
            landed = torch.where(torch.isfinite(landed), landed, old)
        if meter is not None:
            meter.add(old, before, new, landed)
        return landed
