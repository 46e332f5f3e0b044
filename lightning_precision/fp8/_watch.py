"""Which converted layers have run: a layer chosen for fp8 whose forward never runs (a weight used functionally, an
expert no token reached yet) is not reported as fp8 until it does."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_precision._warnings import NoEffectWarning, warn
from lightning_precision.fp8._torchao import MARKS_RAN, MXFP8_FLAG, RAN_FLAG, mark_ran

__all__ = ["NEVER_RAN", "ForwardWatch", "warn_never_ran"]

NEVER_RAN = ("converted, but its forward did not run in the first training step (its weight is used elsewhere, or no"
              " input reached it): not fp8 until it runs")


class ForwardWatch:
    """Which of the layers chosen for fp8 have run. ``settle()`` (at the first backward) returns the layers that have
    not run and keeps watching only them; ``ran()`` (at each later backward) returns those that have run since: a
    layer no input reached at first (an expert a mixture of experts does not call while no token is routed to it)
    computes in fp8 from the step it runs.

    Each layer records its own calls in a flag its forward writes (``RAN_FLAG``; a forward pre-hook for layers whose
    class does not, Transformer Engine's), read here on the host after each backward. Nothing on the model changes
    when a layer is found to have run: dynamo guards on a module's hooks, so hooks taken off after the first step
    compiled the model a second time. Until the backward after their first call (the first backward; later for an
    idle expert), MXFP8 layers leave their fallback warnings to the plugin, which gives them once it knows what ran
    (``mxfp8_after_first_step``); ``close()`` hands them back to the layers still watched."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self.layers = layers
        self.settled = False
        self._watched = list(layers)  # not run yet
        self._handles = []
        for m in layers.values():
            m.__dict__[RAN_FLAG] = False  # as `mark_ran` writes it: runs from this conversion on count
            if not getattr(type(m), MARKS_RAN, False):
                self._handles.append(m.register_forward_pre_hook(mark_ran))  # a function: the model pickles
            if getattr(m, MXFP8_FLAG, False):
                setattr(m, "_mxfp8_quiet", True)  # noqa: B010  (an MXFP8 layer's attribute, not nn.Module's)

    def _count(self, fqn: str, module: nn.Module, args: Any) -> None:
        """Does nothing. Earlier releases watched with this bound method as a forward pre-hook and left it on layers
        that never ran, so a model saved whole (``torch.save(model)``) after such a fit holds it: it still loads."""

    def ran(self) -> list[str]:
        """The layers watched that have run, no longer watched."""
        ran = [fqn for fqn in self._watched if getattr(self.layers[fqn], RAN_FLAG, False)]
        self._watched = [fqn for fqn in self._watched if fqn not in ran]
        return ran

    def settle(self) -> list[str]:
        """At the first backward: the layers that have not run (still watched)."""
        self.settled = True
        self.ran()
        return list(self._watched)

    @property
    def watching(self) -> bool:
        return bool(self._watched)

    def close(self) -> None:
        """The layers are converted again (or no longer the plugin's): their pre-hooks go."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for fqn in self._watched:
            # Its MXFP8 fallbacks were left to the plugin, which no longer watches it: the layer says them itself again.
            if getattr(self.layers[fqn], MXFP8_FLAG, False):
                setattr(self.layers[fqn], "_mxfp8_quiet", False)  # noqa: B010  (as above)
        self._watched = []


def warn_never_ran(paths: list[str]) -> None:
    warn(
        f"FP8Precision: {len(paths)} layer(s) chosen for fp8 did not run their forward in the first training step:"
        f" {', '.join(paths)}. If another module uses their weights directly (as nn.MultiheadAttention does with"
        " out_proj), they never compute in fp8: exclude them with `module_filter` to silence this. If no input reached"
        " them (an expert a mixture of experts skips while no token is routed to it), they compute in fp8 from the"
        " step they run. `plugin.layer_decisions` lists them as high precision until they do.",
        NoEffectWarning,
    )
