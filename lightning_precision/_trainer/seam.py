"""The seam between the Trainer and the Fabric classes: the one place that re-implements, for the Trainer, what
Lightning's Trainer ``Precision`` hides of them.

Each Trainer plugin is ``class X(TrainerScaledPrecision, FabricX)``. In its MRO Lightning's ``lightning.pytorch``
``Precision`` sits between our Trainer mixins and our Fabric class, and the methods in ``SHADOWED`` override the Fabric
``Precision``'s without calling ``super()``: whatever our Fabric class does in them never runs under the Trainer.
``TrainerHooks`` re-implements each one here, over the same step policy (``_core/scaling/step_policy.py``) the Fabric
class calls; tests/trainer/test_seam.py fails when Lightning adds such a method, drops one or changes its parameters,
and when a Trainer plugin would let Lightning's shadow a Fabric method.

- ``pre_backward``: Lightning's callback and module hooks see the real loss, then the plugin's ``_before_backward`` (as
  the Fabric ``pre_backward``); the loss handed to backward is scaled here (the Fabric class scales it in
  ``backward``), after the update left pending by the last step's reads.
- ``backward``: Lightning's ``model.backward`` inside the plugin's backward scope (its matmul precision, then its
  after-backward hook), as the Fabric ``backward``.
- ``post_backward``: Lightning's own (the Fabric classes add nothing there).
- ``optimizer_step``: the closure (forward, backward), the policy's check or unscale before Lightning's
  ``on_before_optimizer_step`` hooks and clipping, then the policy's step; the plain policy leaves it to Lightning's.

Also here, what every Trainer plugin adds at ``connect`` (the device resolved), to Lightning's ThroughputMonitor (the
plugin's compute dtype), at ``on_load_checkpoint`` (a scaler saved by Lightning's own plugin), and to validation, test
and predict (``eval_precision``: each step inside the plugin's ``eval_context``, and its batch converted for it).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision._core.autocast import AutocastPrecision
from lightning_precision._core.process_effects import TRAINER_THROUGHPUT
from lightning_precision._upstream.lightning import after_closure

if TYPE_CHECKING:  # what the mixin is always mixed with, for the type checker
    from lightning_precision._core.scaled import ScaledPrecision as FabricCore
else:
    FabricCore = object

__all__ = ["LIGHTNING_AMP_KEY", "SHADOWED", "TrainerHooks"]

# Lightning's Trainer `Precision` methods that override the Fabric `Precision`'s without calling `super()`, each with
# its parameters as Lightning declares them.
SHADOWED: dict[str, tuple[str, ...]] = {
    "pre_backward": ("self", "tensor", "module"),
    "backward": ("self", "tensor", "model", "optimizer", "args", "kwargs"),
    "post_backward": ("self", "tensor", "module"),
    "optimizer_step": ("self", "optimizer", "model", "closure", "kwargs"),
}

# Keys under which Lightning's own plugin saves the scaler: its class name, and the pre-1.6 name.
LIGHTNING_AMP_KEY = "MixedPrecision"
_LIGHTNING_AMP_KEYS = (LIGHTNING_AMP_KEY, "native_amp_scaling_state")


class TrainerHooks(TrainerPrecision, FabricCore):
    """Mixed into the Trainer classes before the Fabric class (see the module's docstring)."""

    _lightning_ref: weakref.ref | None = None  # the LightningModule, whose Trainer says whether it evaluates

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        # Strategies call this after moving the model: the first moment its device is known, and the one step that
        # resolves it (hardware checks, FSDP2's checks).
        self._module_ref = weakref.ref(model)
        # DDP connects its wrapper: the LightningModule is inside it.
        lightning = next((m for m in model.modules() if isinstance(m, pl.LightningModule)), None)
        self._lightning_ref = weakref.ref(lightning) if lightning is not None else None
        self.resolve_device()
        return super().connect(model, optimizers, lr_schedulers)

    def _trainer_evaluates(self) -> bool:
        """Whether the model's Trainer is validating, testing, predicting or sanity checking."""
        model = self._lightning_ref() if self._lightning_ref is not None else None
        if model is None:
            return False
        try:
            trainer = model.trainer
        except RuntimeError:  # not attached to a Trainer (Lightning's own error for it)
            return False
        return bool(trainer.evaluating or trainer.predicting)

    @override
    def convert_input(self, data: Any) -> Any:
        # Lightning's evaluation and prediction loops convert the batch before the step's context is open: the
        # evaluation's conversion there (a true-precision plugin evaluating in fp32 must not round the batch first).
        if self.eval_precision is not None and self._trainer_evaluates():
            return self._eval_input(data)
        return super().convert_input(data)

    @override
    @contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        with self.eval_context(), super().val_step_context():
            yield

    @override
    @contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        with self.eval_context(), super().test_step_context():
            yield

    @override
    @contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        with self.eval_context(), super().predict_step_context():
            yield

    def _install_throughput_dtype(self) -> None:
        super()._install_throughput_dtype()
        TRAINER_THROUGHPUT.hold(self, AutocastPrecision)

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        # Fabric accepts any Precision, Trainer plugins included, and then fails deep inside `fabric.backward`.
        if not isinstance(module, pl.LightningModule):
            name = type(self).__name__
            raise TypeError(
                f"`lightning_precision.{name}` is the Trainer plugin and cannot run `fabric.backward`. With Fabric,"
                f" use `from lightning_precision.fabric import {name}`."
            )
        tensor = super().pre_backward(tensor, module)  # Lightning's: the hooks see the real loss
        self._before_backward(tensor)  # what the Fabric class's `pre_backward` does
        self.apply_pending_update()
        return self.step_policy.scale_loss(tensor)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        with self._backward_scope():
            super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        self.check_readable_states(optimizer)
        policy = self.step_policy
        if policy.lets_lightning_step(optimizer):  # plain: Lightning's step, closure-driven optimizers included
            output = super().optimizer_step(optimizer, model, closure, **kwargs)
        elif policy.steps_with_closure(optimizer):
            # The guard with LBFGS: Lightning's own step hands it the closure; the guard undoes a non-finite step.
            output = self._scaler_step(optimizer, closure_step=functools.partial(
                super().optimizer_step, optimizer, model, closure, **kwargs))
            self._after_trainer_step(optimizer)
        else:
            output = closure()
            # In automatic optimization a closure returning None skipped backward: nothing to unscale or step.
            skipped_backward = output is None and model.automatic_optimization
            # Before the hooks and clipping see the gradients: a loss scaler unscales (a fused optimizer unscales inside
            # its step); the guard checks, fused optimizers included, before clipping by value can clamp an inf into
            # a finite gradient that the fused step's own check would let through.
            if not skipped_backward:
                self._unscale_before_hooks(optimizer)
            after_closure(self, model, optimizer)
            if not skipped_backward:
                output = self._scaler_step(optimizer, **kwargs)
                self._after_trainer_step(optimizer)
        self._after_optimizer_step()
        self._after_iteration_step(model)
        return output

    def _unscale_before_hooks(self, optimizer: Optimizable) -> None:
        """What the hooks and clipping see: gradients unscaled (a fused optimizer unscales inside its step, and its
        gradients stay scaled), checked by the guard."""
        self.step_policy.unscale_before_hooks(optimizer)

    def _after_trainer_step(self, optimizer: Optimizable) -> None:
        """Hook: after the policy stepped ``optimizer`` (skipped or not), under the Trainer."""

    def _after_iteration_step(self, model: pl.LightningModule) -> None:
        """Hook: at the end of every ``optimizer_step`` of the Trainer, whichever policy stepped."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_lightning_ref"] = None  # a weak reference does not pickle; set again at `connect`
        return state

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The Trainer loads `checkpoint[type(self).__qualname__]` right after this hook; a run started with
        # Lightning's MixedPrecision saved its scaler under another key, so take it from there.
        if type(self).__qualname__ in checkpoint:
            return
        for key in _LIGHTNING_AMP_KEYS:
            if key in checkpoint:
                self.load_state_dict(checkpoint[key])
                return
