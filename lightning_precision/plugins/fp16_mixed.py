"""fp16 mixed precision for the Trainer: the Fabric plugin plus the Trainer's closure, hooks, logging and schedulers."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision._lightning import optimizer_handles_unscaling, should_update_logs
from lightning_precision.fabric.fp16_mixed import FP16MixedPrecision as _FabricFP16MixedPrecision
from lightning_precision.fabric.fp16_mixed import _check_optimizer
from lightning_precision.plugins._schedulers import hold_step_schedulers
from lightning_precision.plugins._trainer import LIGHTNING_AMP_KEY, _TrainerPrecision


class FP16MixedPrecision(_TrainerPrecision, _FabricFP16MixedPrecision):
    """fp16 autocast with a ``GradScaler`` for the Trainer: ``Trainer(plugins=[FP16MixedPrecision()])``.

    Same arguments as :class:`lightning_precision.fabric.FP16MixedPrecision`. In addition, at the logger's cadence it
    logs ``precision/loss_scale`` and ``precision/skipped_steps`` (no device read on other steps), and with
    ``skip_schedulers_on_overflow=True`` (the default) the step-interval LR schedulers you configured are not advanced
    after a step the scaler skipped (Lightning's own schedulers, such as ``Tuner.lr_find``'s sweep, are left alone).

    The scale is updated after the optimizer step with automatic optimization (one optimizer per backward), and at the
    end of ``training_step`` with manual optimization, so that several optimizers stepped after one backward are all
    unscaled with the same scale.

    Which hooks see scaled values:

    - ``on_before_backward``: the unscaled loss (Lightning's ``MixedPrecision`` passes the scaled one);
    - ``on_after_backward``: scaled gradients (unscaling waits until every accumulated backward pass is done);
    - ``on_before_optimizer_step`` and ``configure_gradient_clipping``: unscaled gradients, except with fused
      optimizers, which unscale inside ``step`` (clipping then raises, as in Lightning).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held_optimizers: set[int] = set()
        self._manual_model: Optional[pl.LightningModule] = None

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        for optimizer in optimizers:
            _check_optimizer(type(self).__name__, optimizer)
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
        if self.skip_schedulers_on_overflow:
            lr_schedulers = hold_step_schedulers(lr_schedulers, lambda opt: id(opt) in self._held_optimizers)
        return model, optimizers, lr_schedulers

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        # Hooks see the real loss; only the tensor handed to backward is scaled.
        tensor = super().pre_backward(tensor, module)
        self.apply_pending_update()
        return self.scaler.scale(tensor)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        closure_result = closure()
        # In automatic optimization a closure returning None skipped backward: nothing to unscale or step.
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward and not optimizer_handles_unscaling(optimizer):
            self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
        self._after_closure(model, optimizer)
        if skipped_backward:
            return closure_result
        output = self._scaler_step(optimizer, **kwargs)
        if self.step_was_skipped:
            self._held_optimizers.add(id(optimizer))
        else:
            self._held_optimizers.discard(id(optimizer))
        if model.automatic_optimization:  # one optimizer per backward: its update is due now
            self._update_and_log(model)
        else:
            self._manual_model = model
        return output

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
        self.apply_pending_update()
        if should_update_logs(model.trainer):
            for name, value in self.metrics().items():
                model.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"`{type(optimizer).__qualname__}` unscales gradients inside `step()` (a fused optimizer), so they"
                " cannot be clipped. Use the non-fused optimizer, or drop `gradient_clip_val`."
            )
        TrainerPrecision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Also under Lightning's key, so that a run resumed with `precision="16-mixed"` keeps its scale.
        state = self.state_dict()
        if state:
            checkpoint[LIGHTNING_AMP_KEY] = state

    @override
    def teardown(self) -> None:
        self._held_optimizers.clear()
        self._manual_model = None
        super().teardown()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_manual_model"] = None
        return state
