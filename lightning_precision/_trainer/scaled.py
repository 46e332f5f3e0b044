"""What the Trainer adds to a plugin with a loss scaler or the non-finite guard (every plugin that trains): the scale
unscaled before the closure's hooks, updated once per backward, logged at the logger's cadence, held schedulers on
skipped steps, and checkpoints Lightning's own plugin can resume (a real loss scaler's state only). With neither
(``skip_nonfinite=False`` in bf16) it is plain autocast, Lightning's step.

Which hooks see scaled values:

- ``on_before_backward``: the unscaled loss (Lightning's ``MixedPrecision`` passes the scaled one);
- ``on_after_backward``: scaled gradients (unscaling waits until every accumulated backward pass is done);
- ``on_before_optimizer_step`` and ``configure_gradient_clipping``: unscaled gradients, except with fused optimizers,
  which unscale inside ``step`` (clipping then raises, as in Lightning). The guard checks for inf/nan before them,
  fused optimizers included: clipping cannot turn a non-finite gradient into a finite one before it is seen.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision._core.scaled import ScaledPrecision
from lightning_precision._trainer.schedulers import hold_step_schedulers
from lightning_precision._trainer.seam import LIGHTNING_AMP_KEY, TrainerHooks
from lightning_precision._upstream.lightning import optimizer_handles_unscaling, should_update_logs

if TYPE_CHECKING:  # what the mixin is always mixed with, for the type checker
    FabricCore = ScaledPrecision
else:
    FabricCore = object

__all__ = ["TrainerScaledPrecision"]


class TrainerScaledPrecision(TrainerHooks, FabricCore):
    """Mixed into ``class X(TrainerScaledPrecision, FabricX)`` where ``FabricX`` is a ``ScaledPrecision``.

    The scale is updated after the optimizer step with automatic optimization (one optimizer per backward), and at the
    end of ``training_step`` with manual optimization, so that several optimizers stepped after one backward are all
    unscaled with the same scale. The state it keeps for the Trainer is created at ``connect`` (the class has no
    ``__init__``, so ``help()`` and LightningCLI show the Fabric class's real signature).
    """

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        self._held_optimizers: set[int] = set()
        self._manual_model: pl.LightningModule | None = None
        self.step_policy.check_optimizers(optimizers)  # a loss scaler; the guard steps closure-driven ones its own way
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
        if self.step_policy.reads_skips:
            # A bound method, not a local function: the stand-ins pickle with the schedulers they hold.
            lr_schedulers = hold_step_schedulers(lr_schedulers, self._holds_schedulers_of)
        return model, optimizers, lr_schedulers

    def _holds_schedulers_of(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s last step was skipped, so that its step-interval schedulers stay where they are."""
        return id(optimizer) in getattr(self, "_held_optimizers", ())

    @override
    def _after_trainer_step(self, optimizer: Optimizable) -> None:
        if self.step_was_skipped:
            self._held_optimizers.add(id(optimizer))
        else:
            self._held_optimizers.discard(id(optimizer))

    @override
    def _after_iteration_step(self, model: pl.LightningModule) -> None:
        if model.automatic_optimization:  # one optimizer per backward: its update is due now
            self._update_and_log(model)
        else:
            self._manual_model = model

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with super().train_step_context():
            yield
        # With manual optimization every optimizer step of this training_step has happened by now.
        model, self._manual_model = self._manual_model, None
        if model is not None:
            self._update_and_log(model)

    def _update_and_log(self, model: pl.LightningModule) -> None:
        self.update_after_every_step()
        # `metrics()` on the logger's steps only (`log_every_n_steps`): tensors, nothing read from the device here.
        # FP8Precision's include `precision/fp8_layers`, which FP8Guard logs on the other steps it measures.
        if should_update_logs(model.trainer):
            for name, value in self.metrics().items():
                model.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if (clip_val > 0 and self.step_policy.refuses_fused_clipping() and not self.clips_in_step
                and optimizer_handles_unscaling(optimizer)):
            raise RuntimeError(
                f"`{type(optimizer).__qualname__}` unscales gradients inside `step()` (a fused optimizer), so they"
                " cannot be clipped. Use the non-fused optimizer, or drop `gradient_clip_val`."
            )
        TrainerPrecision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Also under Lightning's key, so that a run resumed with `precision="16-mixed"` keeps its scale: a real loss
        # scaler's state alone (not the plan FP8Precision keeps beside it, nor the guard's counters, which Lightning's
        # plugin would take for a GradScaler's state).
        state = self.step_policy.lightning_state_dict()
        if state:
            checkpoint[LIGHTNING_AMP_KEY] = state

    @override
    def teardown(self) -> None:
        self._held_optimizers = set()
        self._manual_model = None
        super().teardown()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_manual_model"] = None
        state["_held_optimizers"] = set()  # ids of this process's optimizers: the copies have others
        return state
