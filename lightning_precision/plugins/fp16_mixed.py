"""fp16 mixed precision for the Trainer: the Fabric plugin plus the Trainer's closure, hooks, logging and schedulers."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_precision.fabric.fp16_mixed import FP16MixedPrecision as _FabricFP16MixedPrecision
from lightning_precision.fabric.fp16_mixed import _check_optimizer
from lightning_precision.plugins._trainer import _TrainerAutocast


class FP16MixedPrecision(_TrainerAutocast, _FabricFP16MixedPrecision):
    """fp16 autocast with a ``GradScaler`` for the Trainer: ``Trainer(plugins=[FP16MixedPrecision()])``.

    Same arguments as :class:`lightning_precision.fabric.FP16MixedPrecision`. In addition, at the logger's cadence it
    logs ``precision/loss_scale`` and ``precision/skipped_steps`` (no device read on other steps), and with
    ``skip_schedulers_on_overflow=True`` (the default) step-interval LR schedulers of an optimizer whose step the
    scaler skipped are not advanced for that batch.

    Which hooks see scaled values:

    - ``on_before_backward``: the unscaled loss (Lightning's ``MixedPrecision`` passes the scaled one);
    - ``on_after_backward``: scaled gradients (unscaling waits until every accumulated backward pass is done);
    - ``on_before_optimizer_step`` and ``configure_gradient_clipping``: unscaled gradients, except with fused
      optimizers, which unscale inside ``step`` (clipping then raises, as in Lightning).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held_optimizers: set[int] = set()
        self._patched_loop: Optional[Any] = None

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        for optimizer in optimizers:
            _check_optimizer(type(self).__name__, optimizer)
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        # Hooks see the real loss; only the tensor handed to backward is scaled.
        return self.scaler.scale(super().pre_backward(tensor, module))

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
        if not skipped_backward and not _optimizer_handles_unscaling(optimizer):
            self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
        self._after_closure(model, optimizer)
        if skipped_backward:
            return closure_result
        output = self._scaler_step(optimizer, **kwargs)
        trainer = model.trainer
        if self.step_was_skipped:
            self._hold_schedulers(trainer, optimizer)
        if trainer._logger_connector.should_update_logs:
            for name, value in self.metrics().items():
                model.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        return output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and _optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"`{type(optimizer).__qualname__}` unscales gradients inside `step()` (a fused optimizer), so they"
                " cannot be clipped. Use the non-fused optimizer, or drop `gradient_clip_val`."
            )
        TrainerPrecision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    def _hold_schedulers(self, trainer: pl.Trainer, optimizer: Optimizable) -> None:
        """Keep this batch's step-interval schedulers of ``optimizer`` where they are (Lightning issue #5558).

        Lightning steps schedulers from its epoch loop after ``on_train_batch_end``, with no hook in between, so the
        loop's ``update_lr_schedulers`` is wrapped (on the instance, removed at teardown) to leave those out once.
        """
        self._held_optimizers.add(id(optimizer))
        loop = trainer.fit_loop.epoch_loop
        if self._patched_loop is loop:
            return
        original = type(loop).update_lr_schedulers
        plugin = self

        def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
            held = plugin._held_optimizers
            if interval != "step" or not held:
                return original(loop, interval, update_plateau_schedulers)
            strategy = trainer.strategy
            configs = strategy.lr_scheduler_configs
            strategy.lr_scheduler_configs = [
                c for c in configs if c.interval != "step" or id(getattr(c.scheduler, "optimizer", None)) not in held
            ]
            try:
                original(loop, interval, update_plateau_schedulers)
            finally:
                strategy.lr_scheduler_configs = configs
                if update_plateau_schedulers:  # the batch's last scheduler update
                    held.clear()

        loop.update_lr_schedulers = update_lr_schedulers
        self._patched_loop = loop

    @override
    def teardown(self) -> None:
        if self._patched_loop is not None:
            del self._patched_loop.update_lr_schedulers
            self._patched_loop = None
        self._held_optimizers.clear()
        super().teardown()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_patched_loop"] = None
        return state
