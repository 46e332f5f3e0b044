"""A ``torch.amp.GradScaler`` that counts the steps it skips, without asking the device.

``GradScaler`` decides to skip from its ``found_inf`` tensors and forgets them at ``update()``. This subclass adds
those flags to an on-device counter just before they are forgotten (no synchronisation), and keeps the host-side
answer the scaler already computed for ordinary optimizers, so that "was this step skipped?" is free there.
It relies on ``_per_optimizer_states`` and ``_maybe_opt_step``, stable since torch 1.6; the overflow tests break if
torch changes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.optim import Optimizer


@dataclass(frozen=True)
class ScalerConfig:
    """Arguments of ``torch.amp.GradScaler``, validated with errors that say the fix."""

    # 2**16 is torch's default: large enough that small gradients survive fp16, and the first few steps back off.
    init_scale: float = 2.0**16
    # Multiplies the scale after `growth_interval` steps without inf/nan; must be > 1.
    growth_factor: float = 2.0
    # Multiplies the scale on a step with inf/nan; must be in (0, 1).
    backoff_factor: float = 0.5
    # Overflow-free steps before the scale grows; larger is steadier, smaller adapts faster.
    growth_interval: int = 2000

    def validate(self, owner: str) -> None:
        def fail(name: str, value: Any, fix: str) -> None:
            raise ValueError(f"`{owner}({name}={value!r})` is invalid: {fix}")

        if not self.init_scale > 0:
            fail("init_scale", self.init_scale, "the initial loss scale must be > 0, e.g. 2.0**16 (the default).")
        if not self.growth_factor > 1:
            fail("growth_factor", self.growth_factor, "the scale must grow, so use a factor > 1, e.g. 2.0.")
        if not 0 < self.backoff_factor < 1:
            fail("backoff_factor", self.backoff_factor, "the scale must shrink on overflow: use a value in (0, 1).")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            fail("growth_interval", self.growth_interval, "it is a number of steps: pass a positive int.")
        if self.growth_interval < 1:
            fail("growth_interval", self.growth_interval, "it is a number of steps: pass a positive int, e.g. 2000.")


class _TrackingGradScaler(torch.amp.GradScaler):
    def __init__(self, device: str, config: ScalerConfig, enabled: bool = True) -> None:
        super().__init__(
            device,
            init_scale=config.init_scale,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            growth_interval=config.growth_interval,
            enabled=enabled,
        )
        # Tensors on the scale's device, created with it; ints until then (or after a load).
        self._skipped: torch.Tensor | int = 0
        self._steps: torch.Tensor | int = 0
        self._host_skipped: dict[int, bool] = {}

    def _found_inf(self, optimizer: Optional[Optimizer] = None) -> Optional[torch.Tensor]:
        states = (
            [self._per_optimizer_states[id(optimizer)]] if optimizer is not None else self._per_optimizer_states.values()
        )
        flags = [f for state in states for f in state["found_inf_per_device"].values()]
        if not flags or self._scale is None:
            return None
        return sum(f.to(self._scale.device, non_blocking=True) for f in flags)  # type: ignore[return-value]

    def _maybe_opt_step(self, optimizer: Optimizer, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
        # The same host read the parent makes (one sync), kept so nobody has to read the device again.
        skipped = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self._host_skipped[id(optimizer)] = skipped
        return None if skipped else optimizer.step(*args, **kwargs)

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
        if self._enabled and new_scale is None:
            found = self._found_inf()
            if found is not None:
                self._skipped = self._skipped + (found > 0).to(torch.int64)
                self._steps = self._steps + 1
        self._host_skipped.clear()
        super().update(new_scale)

    def skipped_tensor(self) -> torch.Tensor:
        """Skipped optimizer steps, on the scale's device when it exists (no synchronisation)."""
        return torch.as_tensor(self._skipped, device=self._scale.device if self._scale is not None else "cpu")

    def scale_tensor(self) -> torch.Tensor:
        """The current loss scale, on its device when it exists (no synchronisation)."""
        if self._scale is None:
            return torch.tensor(self._init_scale)
        return self._scale.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        # Flat, as Lightning's MixedPrecision saves it, plus our counters: either plugin can load the other's state.
        if not self._enabled:
            return {}
        state = super().state_dict()
        state["skipped_steps"] = int(self._skipped)
        state["optimizer_steps"] = int(self._steps)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled or not state_dict:
            return
        super().load_state_dict(state_dict)
        self._skipped = int(state_dict.get("skipped_steps", 0))
        self._steps = int(state_dict.get("optimizer_steps", 0))
