"""A ``torch.amp.GradScaler`` that cannot write NaN into the weights, counts the steps it skips without asking the
device, and stops a run that skips every step.

Three holes of torch's scaler are closed here:

- **The scale is bounded.** At a scale <= 2**-128, ``1/scale`` is inf in fp32, and torch's unscale checks gradients for
  inf *before* multiplying, so a clean step computes ``0 * inf = nan`` into every weight, unflagged. 144 non-finite
  steps in a row with torch's defaults get there. After every update that can move the scale (a backoff or a growth)
  it is clamped to ``[min_scale, max_scale]`` (an on-device op: no synchronisation); arguments and checkpoints are
  validated against the same bounds.
- **A run that skips every step stops.** After ``max_consecutive_skips`` skipped steps in a row it raises
  :class:`SkippedStepsError` instead of training nothing (at ``min_scale`` fp16 flushes almost every gradient, and the
  scale takes ``growth_interval`` clean steps to double).
- **Skipped steps are counted**: ``found_inf`` flags are added to an on-device counter just before ``update()`` forgets
  them, and the host-side answer torch already computed for ordinary optimizers is kept, so that "was this step
  skipped?" is free there.

It uses its base's own state (``_per_optimizer_states``, ``_scale``, ...) and torch's check-and-unscale kernel, and
overrides one private method, ``_unscale_grads_``, all listed in ``_upstream/torch.py`` with their canary. That
override checks any gradient dtype on any device without a host read: torch's hands bf16 gradients (a bf16 submodule
under fp16 autocast, bf16 LoRA adapters) to a kernel that refuses them on CUDA. Whether a step ran is seen through
the optimizer's public step post-hook (``step_seen``). The host also follows torch's growth tracker while every answer
is on the host, so the bound is applied (one device op) only on the updates that can move the scale, a backoff or a
growth. The non-finite guard (the scaler of plugins without loss scaling) records its check where ``unscale_`` does,
with torch's own kernel. A saved state is read back by ``scaler_state``.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from lightning_precision._checks import is_positive_int, one_config
from lightning_precision._core.scaling.loss_scale import SCALE_RANGE
from lightning_precision._core.scaling.scaler_state import COUNTER_KEYS, CheckedState
from lightning_precision._core.scaling.step_seen import StepSeen, run_undoing_nonfinite
from lightning_precision._upstream.lightning import optimizer_handles_unscaling
from lightning_precision._upstream.torch import grad_scaler_scale, non_finite_check_and_unscale_, sparse_values
from lightning_precision._warnings import warn

__all__ = ["InStepScaler", "NonFiniteGuard", "ScalerConfig", "SkippedStepsError",
           "TrackingGradScaler", "check_gradients", "gradient_groups", "resolve_scaler_config", "scale_of"]


class SkippedStepsError(RuntimeError):
    """Raised when the loss scaler skipped ``max_consecutive_skips`` optimizer steps in a row."""


_FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class ScalerConfig:
    """The loss scaler's arguments, one frozen value: ``FP16MixedPrecision(scaler=ScalerConfig(init_scale=2.0**10))``.

    Validated when a plugin takes it, with errors that say the fix. The defaults are written here only; the plugins'
    flat arguments (``FP16MixedPrecision(init_scale=...)``) take them from this class.
    """

    # 2**16 is torch's default: large enough that small gradients survive fp16, and the first few steps back off.
    init_scale: float = 2.0**16
    # Multiplies the scale after `growth_interval` steps without inf/nan; must be > 1.
    growth_factor: float = 2.0
    # Multiplies the scale on a step with inf/nan; must be in (0, 1).
    backoff_factor: float = 0.5
    # Overflow-free steps before the scale grows; larger is steadier, smaller adapts faster.
    growth_interval: int = 2000
    # Floor of the scale: fp16's smallest subnormal. Below it a scale flushes every gradient under 0.5 anyway, and far
    # below it (2**-128) unscaling turns clean gradients into NaN weights.
    min_scale: float = 2.0**-24
    # Ceiling of the scale: gradients of 2**-48 still survive fp16 at it; more only invites overflow.
    max_scale: float = 2.0**24
    # Skipped steps in a row before the run stops with SkippedStepsError (None: never). From max_scale to min_scale is
    # 48 backoffs: a run that keeps skipping at the floor has non-finite gradients at every scale (a NaN in the loss,
    # a diverged model, activations beyond fp16's range), and training on would change nothing.
    max_consecutive_skips: int | None = 50

    def validate(self, owner: str, defaults: dict[str, float] | None = None) -> None:
        """Raise a ``ValueError`` naming the first invalid field; ``defaults``: the owner's own defaults where they are
        not the config's (``FP16TruePrecision``'s ``init_scale``), cited in the message."""
        def default(name: str) -> Any:
            return (defaults or {}).get(name, getattr(ScalerConfig, name))

        def fail(name: str, fix: str) -> None:
            raise ValueError(f"`{owner}({name}={getattr(self, name)!r})` is invalid: {fix}")

        def real(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                fail(name, f"pass a finite number, e.g. {default(name)!r} (the default).")
            return float(value)

        def steps(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not is_positive_int(value):
                fail(name, f"it is a number of steps: pass a positive int, e.g. {getattr(ScalerConfig, name)!r}"
                           + (", or None" if allow_none else "") + ".")

        low, high = real("min_scale"), real("max_scale")
        if not SCALE_RANGE[0] <= low < high <= SCALE_RANGE[1]:
            fail("min_scale" if not SCALE_RANGE[0] <= low < high else "max_scale",
                 f"the scale bounds need 2**-126 <= min_scale < max_scale <= 2**126 (got [{low:g}, {high:g}]), so that"
                 " 1/scale stays a normal fp32 number; the defaults are 2**-24 and 2**24.")
        if not low <= real("init_scale") <= high:
            fail("init_scale", f"the initial loss scale must lie in [min_scale, max_scale] = [{low:g}, {high:g}],"
                               f" e.g. {default('init_scale')!r} (the default).")
        growth = real("growth_factor")
        if not growth > 1:
            fail("growth_factor", "the scale must grow, so use a factor > 1, e.g. 2.0.")
        # torch grows the scale only when `scale * growth_factor` is a finite fp32 number: past that bound a scale that
        # backed off below max_scale would never grow again.
        if growth > _FP32_MAX / high:
            fail("growth_factor", f"max_scale * growth_factor must stay a finite fp32 number (<= {_FP32_MAX:.6g}), or"
                                  " torch never grows the scale again after a backoff: use a factor <="
                                  f" {_FP32_MAX / high:.8g} (max_scale = {high:g}), e.g. 2.0.")
        backoff = real("backoff_factor")
        if not 0 < backoff < 1:
            fail("backoff_factor", "the scale must shrink on overflow: use a value in (0, 1), e.g. 0.5.")
        if backoff < low / high:
            fail("backoff_factor", f"one backoff would take the scale from max_scale below min_scale ({low:g}): use a"
                                   " value in (0, 1) such as 0.5.")
        steps("growth_interval")
        steps("max_consecutive_skips", allow_none=True)


def resolve_scaler_config(owner: str, scaler: ScalerConfig | None, defaults: dict[str, float] | None = None,
                          **flat: Any) -> ScalerConfig:
    """One validated config from a plugin's ``scaler=`` and its flat scaler arguments (either, not both);
    ``defaults``: the plugin's own defaults of those arguments, where they are not the config's."""
    config: ScalerConfig = one_config(owner, "scaler", ScalerConfig, scaler, flat)
    config.validate(owner, None if scaler is not None else defaults)
    return config


class TrackingGradScaler(torch.amp.GradScaler):
    def __init__(self, device: str, config: ScalerConfig, enabled: bool = True, owner: str = "GradScaler") -> None:
        super().__init__(
            device,
            init_scale=float(config.init_scale),
            growth_factor=float(config.growth_factor),
            backoff_factor=float(config.backoff_factor),
            growth_interval=config.growth_interval,
            enabled=enabled,
        )
        self.config = config
        self.owner = owner  # the plugin, named in errors
        self.device_type = device  # what it was built for (torch keeps it as the private `_device`)
        # Counted on the host while every step's answer is known there for free (ordinary optimizers: torch reads it to
        # decide), on the device (tensors) from the first update whose answer only the device knows (fused optimizers).
        self._skipped: torch.Tensor | int = 0
        self._steps: torch.Tensor | int = 0
        self._streak: torch.Tensor | int = 0  # skipped updates in a row; back to an int at the first clean host answer
        self._unread_updates = 0
        self._host_skipped: dict[int, bool] = {}
        # The post-hook of each optimizer stepped through this scaler (weak keys: it goes with the optimizer).
        self._seen: weakref.WeakKeyDictionary[Optimizer, StepSeen] = weakref.WeakKeyDictionary()
        # torch's growth tracker, followed on the host while every update's answer is known there; None from the first
        # update whose answer only the device knows (then every update is bounded) until a state read gives it back.
        self._host_tracker: int | None = 0  # torch's starts at 0 (and a disabled scaler has none)
        # Set by `update_before_every_step`: the scale this backward's gradients carry, and whether that update saw an
        # inf; cleared by `scale` (the next backward).
        self._carried: torch.Tensor | None = None
        self._early_found: torch.Tensor | None = None

    def scale(self, outputs: Any) -> Any:
        self._carried = self._early_found = None
        return super().scale(outputs)

    def update_before_every_step(self) -> None:
        """``update()`` while optimizers of this backward may still step (the scale was read between two steps). Those
        are then unscaled with the scale their gradients carry, and an inf they find counts in the next update only if
        this one saw none: one backoff per backward, as if every optimizer had stepped first."""
        found = self._found_inf()
        self._carried = scale_of(self) if self._scale is not None else None
        self._early_found = found > 0 if found is not None else None
        self.update()

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self._carried is None or self._scale is None:
            return self._step_and_record(optimizer, *args, **kwargs)
        live, self._scale = self._scale, self._carried
        try:
            output = self._step_and_record(optimizer, *args, **kwargs)
        finally:
            self._scale = live
        if self._early_found is not None:
            # Whether this step's inf counts depends on the update before it, which only the device knows.
            self._host_skipped.pop(id(optimizer), None)
            state = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            for device, flag in state.items():
                state[device] = flag * (~self._early_found).to(flag.device, flag.dtype)
        return output

    def _found_inf(self, optimizer: Optimizer | None = None) -> torch.Tensor | None:
        every = self._per_optimizer_states
        states = [every[id(optimizer)]] if optimizer is not None else every.values()
        flags = [f for state in states for f in state["found_inf_per_device"].values()]
        if not flags or self._scale is None:
            return None
        return sum(f.to(self._scale.device, non_blocking=True) for f in flags)

    def _step_and_record(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``GradScaler.step``, remembering whether the optimizer stepped. torch reads the answer on the host anyway
        for ordinary optimizers (one sync, inside ``step``); a step post-hook, public since torch 2.0, sees it for free.
        Fused optimizers (which unscale inside ``step`` and are always called) and optimizers without hooks are not
        recorded: asked, they read the device. The hook is registered at the optimizer's first step here and stays
        (a :class:`StepSeen`, cleared before each step)."""
        try:
            seen = self._seen.get(optimizer)
        except TypeError:  # an optimizer without weak references: not recorded, as one without hooks
            return super().step(optimizer, *args, **kwargs)
        if seen is None:
            register = getattr(optimizer, "register_step_post_hook", None)
            if not self._enabled or register is None or optimizer_handles_unscaling(optimizer):
                return super().step(optimizer, *args, **kwargs)
            seen = self._seen[optimizer] = StepSeen()
            register(seen)
        seen.stepped = False
        output = super().step(optimizer, *args, **kwargs)
        self._host_skipped[id(optimizer)] = not seen.stepped
        return output

    def record_check(self, optimizer: Optimizer) -> None:
        """Whether ``optimizer``'s gradients hold inf or nan, recorded where torch's ``unscale_`` records it for
        ``step`` and ``update``, without unscaling: one check per (device, dtype) group of gradients
        (``check_gradients``), without torch's per-parameter bookkeeping, which cost more than the check on small
        models. Its flag is all-reduced across ranks for sharded (DTensor) gradients, as in torch's ``unscale_``. fp16
        gradients are checked as they are (nothing is unscaled). The non-finite guard's ``unscale_``, and the check of
        plugins that unscale inside their own step (the true-precision plugins: fp16 gradients stay scaled, and are
        unscaled in fp32)."""
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update(), or"
                               " step() has.")
        state["found_inf_per_device"] = check_gradients(optimizer, None)
        state["stage"] = OptState.UNSCALED

    def _unscale_grads_(self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """torch's check (and unscale) of ``optimizer``'s gradients, behind its ``unscale_`` and the check before a
        fused optimizer's step, here through ``check_gradients``: torch's own hands bf16 gradients to a kernel that
        refuses them on CUDA. Same contract: a new flag per device (torch passes ``found_inf`` as a zero to copy), fp16
        gradients refused unless ``allow_fp16``."""
        inv_scales = {inv_scale.device: inv_scale}

        def inv_scale_on(device: torch.device) -> torch.Tensor:
            if device not in inv_scales:
                inv_scales[device] = inv_scale.to(device, non_blocking=True)
            return inv_scales[device]

        return check_gradients(optimizer, inv_scale_on, allow_fp16=allow_fp16)

    def step_checked(self, optimizer: Optimizer, step: Callable[[], Any]) -> bool:
        """After ``record_check``: ``step()`` unless the gradients held inf or nan (one read of the device, as torch's
        own ``step`` reads it), recorded as ``step`` records it for ``update``. Returns whether it stepped."""
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            self.record_check(optimizer)
        found = self._found_inf(optimizer)
        skipped = bool(found is not None and found.item() > 0)
        if not state["found_inf_per_device"] and self._scale is not None:  # no gradient: a clean (empty) step
            state["found_inf_per_device"] = {self._scale.device: torch.zeros((), dtype=torch.float32,
                                                                             device=self._scale.device)}
        if not skipped:
            step()
        state["stage"] = OptState.STEPPED
        self._host_skipped[id(optimizer)] = skipped
        return not skipped

    def carried_scale(self) -> torch.Tensor:
        """The scale the current gradients carry (on its device): the live one, or the one before an update applied
        between two optimizers' steps on one backward (``update_before_every_step``)."""
        return self._carried if self._carried is not None else scale_of(self)

    def step_was_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last ``step(optimizer)`` was skipped. Free for ordinary optimizers; reads the device for fused
        ones (which unscale inside ``step``). Call it between ``step`` and ``update``."""
        if not self._enabled:
            return False
        if id(optimizer) in self._host_skipped:
            return self._host_skipped[id(optimizer)]
        found = self._found_inf(optimizer)
        return bool(found is not None and found.item() > 0)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale)
            if not self.config.min_scale <= value <= self.config.max_scale:
                raise ValueError(
                    f"`update(new_scale={value!r})`: the loss scale must lie in [min_scale, max_scale] ="
                    f" [{self.config.min_scale:g}, {self.config.max_scale:g}]."
                )
            self._host_skipped.clear()
            super().update(new_scale)
            return
        host = self._host_answer()
        if host is not None:  # no device op
            self._skipped = self._skipped + host
            self._steps = self._steps + 1
            self._streak = self._streak + 1 if host else 0
        elif (found := self._found_inf()) is not None:
            skipped = (found > 0).to(torch.int64)
            self._skipped = self._skipped + skipped
            self._steps = self._steps + 1
            self._streak = (self._streak + 1) * skipped
        self._host_skipped.clear()
        self._update_scale(self._scale_may_move(host))
        self._check_streak()

    def _scale_may_move(self, skipped: bool | None) -> bool:
        """Whether this update may change the scale (a backoff, or a growth), following torch's growth tracker on the
        host as its update kernel moves it: reset on a skip, else one more, and reset on growing at exactly
        ``growth_interval``. ``skipped`` None (only the device knows) loses track: every update may move it then."""
        tracker = self._host_tracker
        if skipped is None or tracker is None:
            self._host_tracker = None
            return True
        tracker += 1
        if skipped or tracker == self.config.growth_interval:
            self._host_tracker = 0
            return True
        self._host_tracker = tracker
        return False

    def _update_scale(self, may_move: bool) -> None:
        """torch's update (back off or grow, and forget this iteration's flags), then the bounds where it may have moved
        the scale: a scale it left alone is where the last bound put it."""
        super().update()
        if may_move and self._scale is not None:
            self._scale.clamp_(self.config.min_scale, self.config.max_scale)

    def _host_answer(self) -> bool | None:
        """Whether this iteration skipped, if every optimizer stepped since the last update answered on the host."""
        if not self._per_optimizer_states:
            return None
        answer = False
        for i in self._per_optimizer_states:  # a plain loop: this runs every step, and generators cost more here
            skipped = self._host_skipped.get(i)
            if skipped is None:
                return None
            answer = answer or skipped
        return answer

    def _check_streak(self) -> None:
        limit = self.config.max_consecutive_skips
        if limit is None:
            return
        streak = self._streak
        if not isinstance(streak, int):
            # Fused optimizers answer only on the device: look once every `limit` updates (one read, not one a step).
            self._unread_updates += 1
            if self._unread_updates < limit:
                return
            self._unread_updates = 0
            streak = int(streak)
        if streak >= limit:
            raise SkippedStepsError(self._streak_message(streak, limit))

    def _streak_message(self, streak: int, limit: int) -> str:
        return (
            f"The loss scaler skipped {streak} optimizer steps in a row (max_consecutive_skips={limit}): every"
            f" gradient had inf or nan, now at loss scale {float(self._scale):g} (min_scale ="  # type: ignore[arg-type]
            f" {self.config.min_scale:g}), so the weights have not changed for {streak} steps. Usual causes: a"
            " nan/inf in the loss itself (check the data, and the forward in fp32), a learning rate that made the"
            " model diverge, or activations beyond fp16's range (65504): train in bf16 (BF16MixedPrecision). Pass"
            " `max_consecutive_skips=None` to train on regardless."
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_seen"] = None  # weak references do not pickle; the copy steps other optimizers anyway
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._seen = weakref.WeakKeyDictionary()

    def skipped_tensor(self) -> torch.Tensor:
        """Skipped optimizer steps, on the scale's device when it exists (no synchronisation)."""
        return torch.as_tensor(self._skipped, device=self._scale.device if self._scale is not None else "cpu")

    def scale_tensor(self) -> torch.Tensor:
        """The current loss scale, on its device when it exists (no synchronisation)."""
        return scale_of(self)

    def state_dict(self) -> dict[str, Any]:
        # Flat, as Lightning's MixedPrecision saves it, plus our counters: either plugin can load the other's state.
        if not self._enabled:
            return {}
        state = super().state_dict()
        self._host_tracker = state["_growth_tracker"]  # read from the device by torch: in step with it again
        state["skipped_steps"] = int(self._skipped)
        state["optimizer_steps"] = int(self._steps)
        state["consecutive_skips"] = int(self._streak)
        state["min_scale"] = self.config.min_scale
        state["max_scale"] = self.config.max_scale
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The checkpoint gives the state (scale, growth tracker, counters); the arguments of this scaler stay in force
        (a warning names any that differ from the checkpoint's). A scale that is not a finite positive number restarts
        from ``init_scale``; one outside ``[min_scale, max_scale]`` is clamped into it; both with a warning. A state
        that is not a scaler's (a missing key, a scale that is no number, a negative count) is a ``ValueError``; the
        non-finite guard's counters alone (a bf16 run of a plugin that also runs fp16) give the counters, and the scale
        starts from
        ``init_scale``."""
        if not self._enabled or not state_dict:
            return
        checked = CheckedState(self.owner, state_dict)
        if "scale" not in state_dict and set(state_dict) <= set(COUNTER_KEYS):
            # The non-finite guard's counters: a run without loss scaling (FP8Precision or XPUPrecision in bf16, under
            # the same checkpoint key as in fp16) resumed with it. No scale to resume: init_scale, as for a bf16 state
            # without the guard; the run's counters go on.
            self._resume_counters(checked)
            return
        scale = checked.number("scale")
        tracker = checked.count("_growth_tracker", required=True)
        skipped, steps, streak = checked.counters(self.config.max_consecutive_skips)
        bounded, tracker = checked.resumed_scale(scale, tracker, asdict(self.config))
        for message in checked.warnings:
            warn(message)
        self._init_growth_tracker = self._host_tracker = tracker
        self._init_scale = bounded
        if self._scale is not None:
            self._scale.fill_(bounded)
            self._growth_tracker.fill_(self._init_growth_tracker)  # type: ignore[union-attr]
        self._set_counters(skipped, steps, streak)

    def _resume_counters(self, checked: CheckedState) -> None:
        """The saved state's counters alone (a state of the non-finite guard, or read by it)."""
        counters = checked.counters(self.config.max_consecutive_skips)
        for message in checked.warnings:
            warn(message)
        self._set_counters(*counters)

    def _set_counters(self, skipped: int, steps: int, streak: int) -> None:
        self._skipped, self._steps, self._streak = skipped, steps, streak
        self._unread_updates = 0


class InStepScaler(TrackingGradScaler):
    """The loss scaler of a plugin that unscales inside its own step, in fp32 (the true-precision plugins: unscaled in
    place, fp16 gradients would flush): ``unscale_`` records the inf/nan check only, the gradients stay scaled."""

    def unscale_(self, optimizer: Optimizer) -> None:
        self.record_check(optimizer)


class NonFiniteGuard(TrackingGradScaler):
    """The scaler of a plugin that scales no loss (bf16, fp8 in bf16, XPU in bf16), kept for its guarantee: a step whose
    gradients hold inf or nan is skipped instead of written into every weight, counted, and a run that skips
    ``max_consecutive_skips`` in a row stops. The scale is fixed at 1 (no growth, no backoff): the loss goes to backward
    as it is, and unscaling multiplies by 1 (exact) in the same fused kernel that checks for inf/nan, all-reduced across
    ranks for sharded (DTensor) gradients. Its state is its counters only: there is no scale to save.
    """

    def __init__(self, device: str, max_consecutive_skips: int | None, owner: str = "GradScaler") -> None:
        super().__init__(device, ScalerConfig(init_scale=1.0, max_consecutive_skips=max_consecutive_skips), owner=owner)

    def scale(self, outputs: Any) -> Any:
        self._create_scale(outputs.device)
        self._carried = self._early_found = None
        return outputs  # times 1: the very loss, and no op for it

    def _create_scale(self, device: torch.device) -> None:
        if self._scale is None:  # the scale (1) lives on the loss's device, created once by torch's own scale()
            super().scale(torch.ones((), device=device))

    def has_stepped(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` stepped since the last update."""
        state = self._per_optimizer_states.get(id(optimizer))
        return state is not None and state["stage"] is OptState.STEPPED

    def _create_scale_for(self, optimizer: Optimizer) -> None:
        """A backward that did not go through ``scale`` (``loss.backward()`` by hand) needs no scaling at a scale of 1:
        the scale is created where the parameters live, so that the check still runs."""
        if self._scale is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self._create_scale(params[0].device if params else torch.device("cpu"))

    def _update_scale(self, may_move: bool) -> None:
        self._per_optimizer_states.clear()  # what torch's update does last; the scale stays 1

    def step_checked(self, optimizer: Optimizer, step: Callable[[], Any]) -> bool:
        self._create_scale_for(optimizer)
        return super().step_checked(optimizer, step)

    def unscale_(self, optimizer: Optimizer) -> None:
        """The check alone (at a scale of 1 there is nothing to unscale): ``record_check``."""
        self._create_scale_for(optimizer)
        self.record_check(optimizer)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._create_scale_for(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY and not optimizer_handles_unscaling(optimizer):
            self.unscale_(optimizer)
        if state["stage"] is OptState.UNSCALED and not state["found_inf_per_device"]:
            # Not one gradient (a part frozen, or unused this step): nothing to check, and torch's step would refuse.
            # The optimizer's own step, as under Lightning's plugin.
            state["stage"] = OptState.STEPPED
            self._host_skipped[id(optimizer)] = False
            return optimizer.step(*args, **kwargs)
        return super().step(optimizer, *args, **kwargs)

    def step_undoing_nonfinite(self, optimizer: Optimizer, closure_step: Callable[[], Any]) -> Any:
        """For an optimizer that evaluates its closure inside ``step`` (LBFGS): its gradients do not exist before the
        step, so the step cannot be skipped up front. It runs, and if it left a weight non-finite the weights are put
        back as they were and the step counts as skipped. Costs one copy of the parameters a step (LBFGS itself keeps
        ``2 * history_size`` flat copies) and a host read per parameter (LBFGS reads the host many times a step); the
        optimizer's own state is not rolled back (LBFGS drops a non-finite curvature pair by itself)."""
        output, bad = run_undoing_nonfinite(optimizer, closure_step)
        device = self._scale.device if self._scale is not None else torch.device("cpu")
        found = torch.tensor(float(bad), dtype=torch.float32, device=device)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {device: found}
        self._host_skipped[id(optimizer)] = bad
        return output

    def _streak_message(self, streak: int, limit: int) -> str:
        return (
            f"{self.owner} skipped {streak} optimizer steps in a row (max_consecutive_skips={limit}): every step's"
            f" gradients held inf or nan, so the weights have not changed for {streak} steps (each such step was"
            " skipped rather than written into the weights as NaN). Usual causes: a nan/inf in the loss or the data"
            " (check a batch, and the forward in fp32), or a learning rate that made the model diverge. Pass"
            " `max_consecutive_skips=None` to train on regardless."
        )

    def state_dict(self) -> dict[str, Any]:
        return dict(zip(COUNTER_KEYS, (int(self._skipped), int(self._steps), int(self._streak)), strict=True))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The counters, where the state has them: ``{}`` (a checkpoint from before the guard) leaves them at 0, and a
        loss scaler's state (a run that switched from fp16) gives its counters, its scale being nothing to this one."""
        self._resume_counters(CheckedState(self.owner, state_dict))


def gradient_groups(optimizer: Optimizer, allow_fp16: bool = True) -> dict[tuple[torch.device, torch.dtype],
                                                                             list[torch.Tensor]]:
    """``optimizer``'s gradients by (device, dtype), as torch's scaler groups them: sparse ones through their stored
    values (fp16 ones coalesced first, as torch does: their duplicates may overflow fp16 when summed, scaled), complex
    ones through their real views. ``allow_fp16`` False refuses fp16 gradients, which unscaling in place would flush."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError(
                    "Attempting to unscale FP16 gradients: a parameter is fp16 under fp16 mixed precision, and"
                    " unscaling its gradient in place would flush the small values the loss scale kept (torch's"
                    " GradScaler refuses it too). Keep the trained parameters in fp32 (fp16 autocast computes in fp16"
                    " anyway), or train the whole model in 16 bits with FP16TruePrecision, which unscales in fp32."
                )
            if grad.is_sparse:
                if grad.dtype == torch.float16:
                    grad = param.grad = grad.coalesce()
                grad = sparse_values(grad)
            elif grad.is_complex():
                grad = torch.view_as_real(grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def check_gradients(optimizer: Optimizer, inv_scale_on: Callable[[torch.device], torch.Tensor] | None,
                    allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
    """Check every gradient of ``optimizer`` for inf and nan, and multiply it by ``inv_scale_on(its device)`` (None:
    check only): one fp32 flag per device, 1 where a gradient there holds inf or nan. One
    ``non_finite_check_and_unscale_`` per (device, dtype) group, without a host read, whatever the dtype."""
    found_per_device: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), grads in gradient_groups(optimizer, allow_fp16).items():
            if device not in found_per_device:
                # fp32 whatever the default dtype: manual optimization steps inside a true-precision plugin's forward
                # context, where new tensors default to bf16/fp16 (the fused kernel takes only fp32 flags and factors).
                found_per_device[device] = torch.zeros((), dtype=torch.float32, device=device)
            inv_scale = inv_scale_on(device) if inv_scale_on is not None else None
            non_finite_check_and_unscale_(grads, found_per_device[device], inv_scale)
    return found_per_device


def scale_of(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The current scale of any ``GradScaler`` (ours or Lightning's) as a tensor on its device, without synchronising:
    torch's public ``get_scale()`` reads the host."""
    return grad_scaler_scale(scaler)
