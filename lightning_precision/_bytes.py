"""What training holds per parameter: weights, their gradients, the optimizer's states and what a plugin keeps beside
them, in bytes on this rank (a sharded tensor's local part), counted from the tensors themselves."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn
from torch.optim import Optimizer

from lightning_precision._core.fsdp import local_shard
from lightning_precision._core.true.step import own_state_bytes

__all__ = ["TrainingBytes", "training_bytes"]


@dataclass(frozen=True)
class TrainingBytes:
    parameters: int  # elements
    weights: int  # bytes
    gradients: int  # bytes: a gradient has its parameter's dtype (allocated from the first backward on)
    optimizer_states: int  # bytes, the optimizer's own and any a plugin keeps in its state (remainders, 16-bit halves)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states

    @property
    def per_parameter(self) -> float:
        return self.total / self.parameters if self.parameters else 0.0


def training_bytes(module: nn.Module, optimizers: Iterable[Optimizer]) -> TrainingBytes:
    """Count once per tensor (tied weights once). Call after an optimizer step: the states exist from the first one."""
    seen: set[int] = set()
    elements = weights = 0
    for p in module.parameters():
        local = local_shard(p)
        assert local is not None
        if local.data_ptr() in seen or not p.requires_grad:
            continue
        seen.add(local.data_ptr())
        elements += local.numel()
        weights += local.numel() * local.element_size()
    states = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            states += sum(own_state_bytes(value) for value in state.values())
    return TrainingBytes(parameters=elements, weights=weights, gradients=weights, optimizer_states=states)
