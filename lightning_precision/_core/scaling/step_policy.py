"""How a plugin that trains takes an optimizer step: plainly, guarded, or loss-scaled. One of the three is chosen once,
when the plugin is built (``make_step_policy``), and both the Fabric and the Trainer classes call it; nothing else in
the package asks which it is.

- ``PlainStep``: Lightning's step. Nothing is scaled, checked or skipped (bf16 and fp8 without ``skip_nonfinite``).
- ``GuardedStep``: a ``NonFiniteGuard`` (a scaler at a fixed scale of 1) checks the gradients for inf/nan and skips such
  a step, counting it and stopping after ``max_consecutive_skips`` in a row (``skip_nonfinite=True``, true precision).
- ``LossScaledStep``: the bounded, counting ``GradScaler`` of fp16 scales the loss, unscales, skips and backs off.

The scale is updated once per backward, after every optimizer that uses its gradients has stepped: at the next
backward (``update_after_every_step``), or when a figure or the state is read (``apply_pending_update``): torch's
documented pattern for several optimizers; updating after each would unscale the second with the new scale.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor
from torch.optim import LBFGS

from lightning_precision._core.scaling.scaler import NonFiniteGuard, ScalerConfig, TrackingGradScaler
from lightning_precision._upstream.lightning import optimizer_handles_unscaling

__all__ = ["GuardedStep", "LossScaledStep", "PlainStep", "StepPolicy", "check_optimizer", "closure_driven",
           "make_step_policy"]


def closure_driven(optimizer: Any) -> bool:
    """Whether ``optimizer`` evaluates its closure inside ``step`` (its gradients do not exist before it): LBFGS, or any
    optimizer whose ``step`` requires a closure."""
    cls: Any = type(optimizer)
    return _requires_closure(cls)


@functools.cache
def _requires_closure(cls: Any) -> bool:
    if issubclass(cls, LBFGS):
        return True
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def check_optimizer(owner: str, optimizer: Any) -> None:
    if closure_driven(optimizer):
        raise ValueError(
            f"`{owner}` cannot drive `{type(optimizer).__name__}`: a loss scaler cannot skip a step that re-evaluates"
            " its closure. Use another optimizer, or `BF16MixedPrecision`, which needs no scaler."
        )


class StepPolicy:
    """What the plugins call at each point of a step; as written here, Lightning's plain step (``PlainStep``): the
    optimizer steps as it is, nothing is scaled, checked, skipped or kept."""

    kind = "plain"
    # The scaler or guard behind the step (None here), and the loss scaler a plugin shows as ``plugin.scaler``.
    scaler: TrackingGradScaler | None = None
    loss_scaler: TrackingGradScaler | None = None
    # Whether each step asks the scaler if it skipped (for held schedulers): a host read for fused optimizers.
    reads_skips = False

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.step_was_skipped = False
        self.update_pending = False

    def scale_loss(self, tensor: Tensor) -> Tensor:
        return tensor

    def on_device(self, device_type: str) -> None:
        """The model's device is known: device-bound state moves there."""

    def lets_lightning_step(self, optimizer: Any) -> bool:
        """Whether the Trainer's step is Lightning's own (the closure run by the optimizer)."""
        return True

    def steps_with_closure(self, optimizer: Any) -> bool:
        """Whether the Trainer hands ``optimizer`` Lightning's closure and the policy steps it whole (LBFGS)."""
        return False

    def check_optimizers(self, optimizers: Iterable[Any]) -> None:
        """Refuse, at setup, an optimizer this step cannot drive."""

    def step(self, optimizer: Any, closure_step: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Step ``optimizer``. ``closure_step``: how a closure-driven optimizer steps (evaluating its closure)."""
        self.step_was_skipped = False
        return optimizer.step(**kwargs) if closure_step is None else closure_step()

    def unscale_for_clipping(self, optimizer: Any) -> None:
        """Fabric's ``clip_gradients``: the gradients as the step will see them, checked where the step checks."""

    def unscale_before_hooks(self, optimizer: Any) -> None:
        """The Trainer, after the closure: what ``on_before_optimizer_step`` and clipping see."""

    def refuses_fused_clipping(self) -> bool:
        """Whether a fused optimizer's gradients, unscaled only inside its step, cannot be clipped."""
        return False

    def update_after_every_step(self) -> None:
        """Update the scale now that every optimizer of the last backward has stepped."""

    def apply_pending_update(self) -> None:
        """Update the scale for the steps taken since the last backward, if not done yet (a read of a figure or the
        state); may raise ``SkippedStepsError``."""

    def loss_scale(self) -> float | None:
        return None

    def skipped_steps(self) -> int:
        return 0

    def metrics(self) -> dict[str, Tensor]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def lightning_state_dict(self) -> dict[str, Any]:
        """What Lightning's own ``MixedPrecision`` can resume: a real loss scaler's state alone."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing is kept, so nothing is loaded."""


class PlainStep(StepPolicy):
    """Lightning's step (bf16 and fp8 without ``skip_nonfinite``)."""


class GuardedStep(StepPolicy):
    """The gradients checked for inf/nan by a ``NonFiniteGuard`` (a scaler at a fixed scale of 1); such a step skipped,
    counted, and stopped after ``max_consecutive_skips`` in a row."""

    kind = "guarded"

    def __init__(self, owner: str, scaler: TrackingGradScaler, reads_skips: bool) -> None:
        super().__init__(owner)
        self.scaler: TrackingGradScaler = scaler
        self.reads_skips = reads_skips

    def _rebuilt(self, device_type: str) -> TrackingGradScaler:
        return NonFiniteGuard(device_type, self.scaler.config.max_consecutive_skips, owner=self.owner)

    def on_device(self, device_type: str) -> None:
        if self.scaler.device_type != device_type:
            # With the last step's update applied first (a plugin reused on another device rests between a step and
            # its update under Fabric): the new scaler has no record of that step, and updating it would fail.
            state = self.state_dict()
            self.scaler = self._rebuilt(device_type)
            self.scaler.load_state_dict(state)

    def lets_lightning_step(self, optimizer: Any) -> bool:
        return False

    def steps_with_closure(self, optimizer: Any) -> bool:
        return closure_driven(optimizer)  # the guard undoes a step that left a weight non-finite

    def scale_loss(self, tensor: Tensor) -> Tensor:
        return self.scaler.scale(tensor)

    def catch_up(self, optimizer: Any) -> None:
        """A new iteration whose backward did not come through the plugin (``loss.backward()`` by hand): at a scale of
        1 nothing was missed but the update, applied now."""
        if self.update_pending and isinstance(self.scaler, NonFiniteGuard) and self.scaler.has_stepped(optimizer):
            self.update_after_every_step()

    def step(self, optimizer: Any, closure_step: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        self.catch_up(optimizer)
        if closure_step is not None or "closure" in kwargs:
            assert isinstance(self.scaler, NonFiniteGuard)
            output = self.scaler.step_undoing_nonfinite(optimizer, closure_step or functools.partial(optimizer.step,
                                                                                                      **kwargs))
        else:
            output = self.scaler.step(optimizer, **kwargs)
        self.stepped(optimizer)
        return output

    def step_checked(self, optimizer: Any, step: Callable[[], Any]) -> None:
        """Take ``step`` (the true-precision step) if ``optimizer``'s gradients are finite (known on the host)."""
        self.catch_up(optimizer)
        self.step_was_skipped = not self.scaler.step_checked(optimizer, step)
        self.update_pending = True

    def stepped(self, optimizer: Any) -> None:
        if self.reads_skips:
            self.step_was_skipped = self.scaler.step_was_skipped(optimizer)
        self.update_pending = True

    def unscale_for_clipping(self, optimizer: Any) -> None:
        # The guard (scale 1) checks now, fused optimizers included: clipping by value after this could clamp an inf
        # into a finite gradient that the fused step's own check would let through.
        self.scaler.unscale_(optimizer)

    def unscale_before_hooks(self, optimizer: Any) -> None:
        self.scaler.unscale_(optimizer)  # the inf/nan check, times 1

    def update_after_every_step(self) -> None:
        if self.update_pending:
            self.update_pending = False
            self.scaler.update()

    def apply_pending_update(self) -> None:
        if self.update_pending:
            self.update_pending = False
            # Called by a read, maybe between two optimizers' steps on one backward: those still to step keep the
            # scale their gradients carry.
            self.scaler.update_before_every_step()

    def skipped_steps(self) -> int:
        self.apply_pending_update()
        return int(self.scaler.skipped_tensor())

    def metrics(self) -> dict[str, Tensor]:
        self.apply_pending_update()
        return {"precision/skipped_steps": self.scaler.skipped_tensor().float()}

    def state_dict(self) -> dict[str, Any]:
        self.apply_pending_update()
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)


class LossScaledStep(GuardedStep):
    """fp16's loss scaler: the loss scaled, the gradients unscaled before the hooks and clipping (a fused optimizer
    unscales inside its step), a step with inf/nan skipped and the scale backed off."""

    kind = "loss-scaled"

    def __init__(self, owner: str, scaler: TrackingGradScaler, reads_skips: bool) -> None:
        super().__init__(owner, scaler, reads_skips)
        self.loss_scaler = scaler

    def _rebuilt(self, device_type: str) -> TrackingGradScaler:
        scaler = type(self.scaler)(device_type, self.scaler.config, owner=self.owner)
        self.loss_scaler = scaler
        return scaler

    def steps_with_closure(self, optimizer: Any) -> bool:
        return False  # refused at setup (`check_optimizers`): a loss scaler cannot skip a step that evaluates it

    def check_optimizers(self, optimizers: Iterable[Any]) -> None:
        for optimizer in optimizers:
            check_optimizer(self.owner, optimizer)

    def step(self, optimizer: Any, closure_step: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        check_optimizer(self.owner, optimizer)
        output = self.scaler.step(optimizer, **kwargs)
        self.stepped(optimizer)
        return output

    def unscale_for_clipping(self, optimizer: Any) -> None:
        if optimizer_handles_unscaling(optimizer):
            raise NotImplementedError(
                f"`{type(optimizer).__name__}` unscales inside `step()` (a fused optimizer), so its gradients cannot"
                " be unscaled for clipping. Use the non-fused optimizer to clip."
            )
        self.scaler.unscale_(optimizer)

    def unscale_before_hooks(self, optimizer: Any) -> None:
        if not optimizer_handles_unscaling(optimizer):  # a fused one unscales inside its step
            self.scaler.unscale_(optimizer)

    def refuses_fused_clipping(self) -> bool:
        return True

    def loss_scale(self) -> float | None:
        self.apply_pending_update()
        return float(self.scaler.scale_tensor())

    def metrics(self) -> dict[str, Tensor]:
        skipped = super().metrics()
        return {"precision/loss_scale": self.scaler.scale_tensor().float(), **skipped}

    def lightning_state_dict(self) -> dict[str, Any]:
        return self.state_dict()


def make_step_policy(owner: str, scaler: ScalerConfig | None, skip_nonfinite: bool, max_consecutive_skips: int | None,
                     reads_skips: bool,
                     scaler_class: type[TrackingGradScaler] = TrackingGradScaler) -> StepPolicy:
    """The step of a plugin built with these arguments: loss-scaled with a ``ScalerConfig``, else guarded when
    ``skip_nonfinite``, else plain. Its scaler is built on the cpu, even for an explicit ``device``, until the model's
    device is resolved and checked (``on_device`` then rebuilds it there with its state): built for a device this
    process has not got, torch's scaler would warn and disable itself. ``reads_skips``: each step learns whether it
    was skipped (the plugin holds schedulers then)."""
    if scaler is not None:
        return LossScaledStep(owner, scaler_class("cpu", scaler, owner=owner), reads_skips)
    if skip_nonfinite:
        return GuardedStep(owner, NonFiniteGuard("cpu", max_consecutive_skips, owner=owner), reads_skips)
    return PlainStep(owner)
