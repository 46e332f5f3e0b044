"""AmaxHistoryLogger's hooks on the linear-like layers: in each training call, the layer's input, weight and output
gradient go to the step's record (``StepExtremes``) and, on logging steps, to the what-if's capture."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrize import is_parametrized

from lightning_precision._core.probe_pass import in_probe_pass
from lightning_precision._warnings import NoEffectWarning, warn
from lightning_precision.callbacks._amax.extremes import StepExtremes, weight_values
from lightning_precision.fp8._selection import functional_linears

__all__ = ["Capture", "LayerHooks", "linear_layers"]

# Per layer and tensor kind: (the tensor, or under FSDP a copy of its sample; its real number of elements).
Capture = list[dict[str, tuple[Tensor, int]]]


def _is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` and its subclasses (torchao's ``Float8Linear``), and Transformer Engine modules (``fp8_meta``)."""
    return isinstance(module, nn.Linear) or (hasattr(module, "fp8_meta") and hasattr(module, "weight"))


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The linear-like layers of ``model`` that run as modules (not those a forward calls functionally), named."""
    functional = functional_linears(model)
    return [(name, m) for name, m in model.named_modules() if _is_linear_like(m) and id(m) not in functional]


def _training_call(module: nn.Module) -> bool:
    """A training forward of the step: not evaluation, not another part's pass beside the step (`in_probe_pass`)."""
    return torch.is_grad_enabled() and module.training and not in_probe_pass()


class LayerHooks:
    """The hooks of one model's layers, recording into ``extremes``; ``sample(values)`` is the what-if's sample of a
    weight, copied under FSDP2 (which frees a gathered weight's storage after the forward)."""

    def __init__(self, extremes: StepExtremes, sample: Callable[[Tensor], Tensor]) -> None:
        self.extremes = extremes
        self.sample = sample
        self.handles: list[Any] = []
        self.ran: list[bool] = []  # per layer: a training call ran it (else it has no amax)
        self.parametrized: set[int] = set()
        self.capture: Capture | None = None
        self.copy_weights = False

    def attach(self, names: list[str], modules: list[nn.Module], device: torch.device, fused: bool,
               sharded: bool) -> None:
        """Hook ``modules`` (named ``names``, on ``device``); ``fused``: the weights' amaxes are one fused norm at the
        flush (an accelerator); ``sharded``: FSDP2 gathers the weights for the forward only."""
        # FSDP2 frees a gathered weight's storage after the forward: the what-if keeps a copy of its sample instead.
        self.copy_weights = sharded
        # A parametrized weight (spectral_norm, weight_norm, orthogonal) is computed anew at each read, and
        # spectral_norm's read runs a power iteration in training mode: reading it would change the training.
        self.parametrized = {i for i, m in enumerate(modules) if is_parametrized(m, "weight")}
        if self.parametrized:
            warn("AmaxHistoryLogger: the weights of " + ", ".join(names[i] for i in sorted(self.parametrized))
                 + " are parametrized (`torch.nn.utils.parametrize`: spectral_norm, weight_norm, ...); reading one"
                 " computes it again (spectral_norm's power iteration would change your training), so their weight"
                 " amax is not recorded (0 in the history, no `fp8_scale` for it); inputs and gradients are.",
                 NoEffectWarning)
        self.ran = [False] * len(modules)
        self.capture = None
        self.extremes.reset(modules, device, defer_weights=fused and not sharded)
        # Input and weight before the forward where ops are cheap (a CPU: the forward then finds them in cache; after
        # it, a 16 x 512 x 512 MLP's reads cost 1 ms a step more) or the weight is gathered only then (FSDP2, whose
        # post-forward hook frees it before a forward hook of ours runs); elsewhere (a GPU) in the one forward hook a
        # layer, which also hooks the output's gradient.
        early = not fused or sharded
        for i, module in enumerate(modules):
            if early:
                self.handles.append(module.register_forward_pre_hook(self._pre_hook(i)))
            self.handles.append(module.register_forward_hook(self._layer_hook(i, inputs=not early)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _pre_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            if _training_call(module):
                self._inputs(i, module, args)

        return hook

    def _layer_hook(self, i: int, inputs: bool) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not _training_call(module):
                return
            if inputs:
                self._inputs(i, module, args)
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(functools.partial(self._grad, i))

        return hook

    def _inputs(self, i: int, module: nn.Module, args: tuple) -> None:
        """A training call's input and weight."""
        self.ran[i] = True
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if x is not None and x.numel() == 0:
            x = None  # no tokens reached it this call (an idle expert): its weight is still recorded
        with torch.no_grad():
            if x is not None:
                self.extremes.record(i, 0, x)
            self._weight(i, module)
        if self.capture is not None and x is not None:
            self.capture[i]["input"] = (x.detach(), x.numel())

    def _weight(self, i: int, module: nn.Module) -> None:
        if i in self.parametrized:
            return  # not read: see `attach`
        weight = module.weight
        self.extremes.record_weight(i, weight)
        if self.capture is not None:
            values = weight_values(weight).detach()
            self.capture[i]["weight"] = (self.sample(values).clone() if self.copy_weights else values, values.numel())

    def _grad(self, i: int, g: Tensor) -> None:
        if g.numel() == 0 or in_probe_pass():  # no tokens; or another's pass through this step's graph
            return
        # inside the backward, before any optimizer step: the weights the forward used
        self.extremes.record_deferred()
        if torch.is_grad_enabled():  # a backward with create_graph=True
            with torch.no_grad():
                self.extremes.record(i, 2, g)
        else:
            self.extremes.record(i, 2, g)
        if self.capture is not None:
            self.capture[i]["grad_output"] = (g.detach(), g.numel())
