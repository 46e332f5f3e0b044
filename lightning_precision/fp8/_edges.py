"""Which linear layers sit at the model's edges, seen in a forward: those that read the model's input (or its
embedding) and those that write its logits. Registration order only guesses this: on DistilBERT the first linear
layer registered is layer 0's ``q_lin``, while ``k_lin`` and ``v_lin`` read the same embedding output.

:class:`EdgeRecorder` hooks the layers and records, in the first forward, each call's input tensor and the call
order. :func:`edges_of` runs one forward under it. ``select_fp8_layers(..., edges=...)`` keeps the edges in high
precision.

What it cannot see (documented, not guessed):

- a linear layer whose weight is used functionally (``F.linear(x, self.weight)``, ``nn.MultiheadAttention``'s
  projections): its module's forward never runs, so it has no call to record;
- the model's logits themselves: the "last" layer is the last linear layer that runs in the first forward. A model
  whose loss reads an earlier layer and which runs another linear layer after it (an auxiliary branch) gets that
  layer instead;
- the embedding's meaning: "the model's input" is the tensor the first linear layer that runs reads, whatever made it
  (an embedding, a normalisation, the batch itself in an MLP);
- a compiled forward: hooks traced by ``torch.compile`` do not record; record on the eager model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

__all__ = ["FIRST_REASON", "LAST_REASON", "EdgeRecorder", "edges_of"]

# The reasons `edges()` gives: the first layer that runs and those that read the same tensor; the last layer that runs
# and those that read the same tensor as its last call (parallel heads).
FIRST_REASON = ("reads the first linear layer's input (the model's input or embedding, unless a functional linear"
                " runs first)")
LAST_REASON = "writes the logits"


@dataclass(frozen=True)
class _Call:
    fqn: str
    tensor: int  # which tensor it read: equal numbers are the same memory with the same layout; -1: not a tensor


class EdgeRecorder:
    """Forward pre-hooks on ``layers`` (``{fqn: module}``, usually every ``nn.Linear`` of a model) that record, in the
    first forward, which tensor each layer reads and in which order the layers run. Then :meth:`edges` says which
    layers are at the model's edges: ``{fqn: reason}``.

    - The first edge: every layer that reads the same tensor as the first layer that runs (DistilBERT: layer 0's
      ``q_lin``, ``k_lin`` and ``v_lin``, which read the embedding output; not ``out_lin``). In an MLP it is the first
      layer, which reads the batch.
    - The last edge: the last layer that runs (the classifier) and every layer that reads the same tensor as its last
      call (parallel heads).

    "The same tensor" is the same storage (held by a weak reference, so its memory cannot be reused under another
    tensor while it counts), offset, shape, stride and dtype: a view with the same layout is the same tensor, a copy
    is not. A tensor changed in place between two reads still counts as one. Nothing is held: no activation stays
    alive because of the recorder.

    The first forward ends at whichever comes first: the end of ``model``'s forward (when ``model`` is given and its
    forward ran the layers), the first backward through a recorded layer's output (a forward ends before its loss's
    backward), or :meth:`stop`. Then the hooks go, and later forwards (more batches, gradient checkpointing's
    recomputation in the backward) change nothing. A layer called several times counts with each of its calls; a
    layer that never runs is in no edge. Without ``model`` and without a backward (a ``no_grad`` loop), call
    :meth:`stop` after the first forward: until then every call counts.

    Example:
        >>> import torch
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
        >>> recorder = EdgeRecorder(dict(model.named_children()), model=model)
        >>> _ = model(torch.randn(2, 8))
        >>> for fqn, reason in recorder.edges().items():
        ...     print(fqn, "first" if reason == FIRST_REASON else "last")
        0 first
        3 last
        >>> recorder.close()
    """

    def __init__(self, layers: Mapping[str, nn.Module], *, model: nn.Module | None = None) -> None:
        if not isinstance(layers, Mapping) or not all(isinstance(m, nn.Module) for m in layers.values()):
            raise TypeError(f"`EdgeRecorder(layers={layers!r})`: pass a mapping {{fqn: module}}, e.g."
                            " `{fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}`.")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"`EdgeRecorder(model={model!r})`: pass the nn.Module whose forward runs the layers, or"
                            " None.")
        # One module under several names is one layer: it is hooked once and reported under its first name.
        names: dict[int, str] = {}
        for fqn, module in layers.items():
            names.setdefault(id(module), fqn)
        self.calls: list[_Call] = []
        self.done = False
        # id(storage) -> (weak reference to the storage, {layout: tensor number}). A live weak reference pins the id:
        # a storage freed and another allocated at the same id is told apart by the dead reference.
        self._seen: dict[int, tuple[weakref.ref[Any], dict[tuple[Any, ...], int]]] = {}
        self._depth = 0
        self._handles: list[Any] = []
        for module in {id(m): m for m in layers.values()}.values():
            fqn = names[id(module)]
            # Prepended: another pre-hook (a cast, a probe) may hand the layer a new tensor; the edge is what the
            # model gave it.
            self._handles.append(module.register_forward_pre_hook(self._before(fqn), prepend=True, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._after))
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._enter))
            # Called also when the forward raises (with output None), so that a failed forward leaves no count behind.
            self._handles.append(model.register_forward_hook(self._exit, always_call=True))

    def edges(self) -> dict[str, str]:
        """``{fqn: reason}``: the layers that read the model's input or its embedding, then those that write the
        logits (a layer that is both has both reasons). Empty when no layer ran. Before the first forward ended, the
        answer holds for the calls so far."""
        if not self.calls:
            return {}
        first, last = self.calls[0].tensor, self.calls[-1].tensor
        out: dict[str, list[str]] = {}
        for tensor, reason, fallback in ((first, FIRST_REASON, self.calls[0].fqn),
                                         (last, LAST_REASON, self.calls[-1].fqn)):
            # An input that is not a tensor matches nothing: only its own layer is the edge.
            readers = [c.fqn for c in self.calls if c.tensor == tensor] if tensor >= 0 else [fallback]
            for fqn in readers:
                if reason not in out.setdefault(fqn, []):
                    out[fqn].append(reason)
        return {fqn: "; ".join(reasons) for fqn, reasons in out.items()}

    def stop(self) -> None:
        """End the first forward now: later calls are not recorded, and the hooks go."""
        self.done = True
        self._seen.clear()
        self.close()

    def close(self) -> None:
        """Remove every hook (the record stays). Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> EdgeRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._depth += 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        # The model's forward ran the layers: that was the first forward. One that raised (output None) was not: its
        # calls stay, and the next forward's are added to them.
        if self._depth == 0 and self.calls and output is not None:
            self.stop()

    def _before(self, fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.done:
                return
            x = args[0] if args else kwargs.get("input")
            self.calls.append(_Call(fqn, self._number(x) if isinstance(x, Tensor) else -1))

        return hook

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        # The first gradient that reaches a recorded output means the loss's backward began: the forward is over.
        if not self.done and isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(self._backward_began)

    def _backward_began(self, grad: Tensor) -> None:
        if not self.done:
            self.stop()

    def _number(self, x: Tensor) -> int:
        try:
            owner: Any = x.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # no storage (a wrapper subclass): the tensor itself
            owner = x
        layout = (x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
        entry = self._seen.get(id(owner))
        if entry is None or entry[0]() is not owner:  # new, or the id of a storage that died
            entry = (weakref.ref(owner), {})
            self._seen[id(owner)] = entry
        return entry[1].setdefault(layout, len(self.calls))


def edges_of(model: nn.Module, forward: Callable[[], Any],
             layers: Mapping[str, nn.Module] | None = None) -> dict[str, str]:
    """Run ``forward()`` (one forward of ``model``, e.g. ``lambda: model(batch)``) under an :class:`EdgeRecorder` on
    ``layers`` (default: every ``nn.Linear`` of ``model``, under its first name) and return its edges, ``{fqn:
    reason}``. Gradients are not needed: run it under ``torch.no_grad()`` to save memory.

    Example:
        >>> import torch
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> with torch.no_grad():
        ...     sorted(edges_of(model, lambda: model(torch.randn(2, 8))))
        ['0', '2']
    """
    if layers is None:
        layers = {}
        for fqn, module in model.named_modules():
            if isinstance(module, nn.Linear):
                layers.setdefault(fqn, module)
    recorder = EdgeRecorder(layers, model=model)
    try:
        forward()
    finally:
        recorder.stop()
    return recorder.edges()
