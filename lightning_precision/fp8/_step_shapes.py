"""What the first training batch shows of how the model runs, for timing its layers the way they will run: the rows
each linear layer takes per call (its GEMM's M: ``RowProbe``, a probe of ``Calibration``'s kind) and whether the model
runs under ``torch.compile`` (``CompileWatch``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_precision._upstream.torch import inside_compiled_call

__all__ = ["CompileWatch", "RowProbe"]

class CompileWatch:
    """Whether the model's first forward through any of ``layers`` (its eligible linear layers: the first of them in
    module order may not run in the first batch, a branch taken later) ran under ``torch.compile`` (``compiled``: None
    until one ran). Its pre-hooks go once an eager forward was seen. A compiled model keeps them: dynamo guards on a
    module's hooks, so removing them would make it recompile the whole model; each is a store of a constant there."""

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        self.compiled: bool | None = None
        self._handles: list[Any] = [layer.register_forward_pre_hook(self._hook) for layer in dict.fromkeys(layers)]

    def _hook(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            self.compiled = True
        elif not self.compiled:
            self.compiled = inside_compiled_call()

    def settle(self) -> bool | None:
        """What was seen (None: no watched layer has run yet); the hooks go after an eager forward."""
        if self.compiled is False:
            self.close()
        return self.compiled

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class RowProbe:
    """The input rows of each layer's calls during the measured batches: what ``Calibration`` asks of a probe, for
    timing the layers' shapes. Training forwards only (the layer in training mode, with gradients on): a Fabric loop's
    evaluation forward without ``torch.no_grad`` runs other rows than the training step timed."""

    def __init__(self, layers: Mapping[str, nn.Linear]) -> None:
        self.layers = dict(layers)
        self.rows = dict.fromkeys(self.layers, 0)
        self.calls = dict.fromkeys(self.layers, 0)
        self.batches = self.dropped = 0
        self._handles: list[Any] = []
        self.reopen()

    def _hook(self, fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            x = args[0] if args else None
            if module.training and torch.is_grad_enabled() and isinstance(x, Tensor) and x.dim() > 0 and x.shape[-1]:
                self.rows[fqn] += x.numel() // x.shape[-1]
                self.calls[fqn] += 1
        return hook

    def reopen(self) -> None:
        if not self._handles:
            self._handles = [layer.register_forward_hook(self._hook(fqn)) for fqn, layer in self.layers.items()]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def commit(self) -> None:
        self.batches += 1

    def mark_loss(self, loss: Tensor) -> None:
        """A non-finite loss says nothing about a layer's shape: its batch counts."""

    def result(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
        """Rows per call of each layer that ran (the most over the processes, so every rank times the same shapes)."""
        per_call = torch.tensor([self.rows[f] / self.calls[f] if self.calls[f] else 0.0 for f in self.layers],
                                dtype=torch.float64)
        if reduce is not None:
            per_call = reduce(per_call)
        return {fqn: float(v) for fqn, v in zip(self.layers, per_call.tolist(), strict=True) if v > 0}
