"""A saved loss-scaler state read back: each value checked, what no scaler saved refused with a ``ValueError`` that
names the key, the value and the fix, and what the resumed scaler takes from it under its own arguments.

Torch alone (the scaler sits deep in the plugins' imports): what a resume changes is said in ``CheckedState.warnings``,
for the scaler to warn.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["COUNTER_KEYS", "CheckedState"]

# The counters every scaler saves beside torch's state; all the non-finite guard saves.
COUNTER_KEYS = ("skipped_steps", "optimizer_steps", "consecutive_skips")


class CheckedState:
    """Reads a saved scaler state, refusing what no scaler saved with a ``ValueError`` that names the key, the value and
    the fix (a checkpoint edited by hand, cut short, or of another object)."""

    def __init__(self, owner: str, state: dict[str, Any]) -> None:
        self.owner, self.state = owner, state
        self.warnings: list[str] = []  # what the resume changed, in the order found

    def _fail(self, problem: str) -> ValueError:
        return ValueError(
            f"`{self.owner}.load_state_dict`: the checkpoint's scaler state {problem}. Resume from a checkpoint that"
            " this"
            f" plugin or Lightning's MixedPrecision saved, or delete the plugin's entry (`checkpoint[{self.owner!r}]`,"
            " and `checkpoint['MixedPrecision']` if there is one) to start the scaler afresh."
        )

    def _get(self, key: str) -> Any:
        if key not in self.state:
            raise self._fail(f"lacks {key!r} (it holds {sorted(self.state)})")
        value = self.state[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        return value

    def number(self, key: str) -> float:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self._fail(f"has {key}={value!r}, which is not a number")
        return float(value)

    def count(self, key: str, required: bool = False) -> int:
        if not required and key not in self.state:
            return 0
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise self._fail(f"has {key}={value!r}, which is not a count of steps (an int >= 0)")
        return int(value)

    def counters(self, max_consecutive_skips: int | None) -> tuple[int, int, int]:
        """``skipped_steps``, ``optimizer_steps`` and ``consecutive_skips`` (0 where absent, as in Lightning's state);
        a streak at or above ``max_consecutive_skips`` restarts from 0, with a warning."""
        skipped, steps, streak = (self.count(key) for key in COUNTER_KEYS)
        if max_consecutive_skips is not None and streak >= max_consecutive_skips:
            self.warnings.append(
                f"`{self.owner}.load_state_dict`: the checkpoint's consecutive_skips={streak} is at or above"
                f" max_consecutive_skips={max_consecutive_skips} (saved under a larger limit, or none): resumed as is,"
                " the run would stop at its first skipped step. The streak restarts from 0, so the run stops only"
                f" after {max_consecutive_skips} skipped steps in a row from here. Pass a larger"
                " `max_consecutive_skips`"
                " to keep counting the checkpoint's streak."
            )
            streak = 0
        return skipped, steps, streak

    def resumed_scale(self, scale: float, tracker: int, arguments: Mapping[str, Any]) -> tuple[float, int]:
        """The saved ``scale`` and growth ``tracker`` as a scaler of ``arguments`` (its ``ScalerConfig``'s fields)
        resumes them: a scale that is not a finite positive number restarts from ``init_scale`` (and the tracker from
        0), one outside ``[min_scale, max_scale]`` is clamped into it, and a tracker is at most due; each change, and
        any argument that differs from the checkpoint's, in ``warnings``."""
        changed = [f"{name}: checkpoint {self.state[name]!r}, now {arguments[name]!r}"
                   for name in ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale")
                   if name in self.state and self.state[name] != arguments[name]]
        if changed:
            self.warnings.append(
                "Resuming the loss scaler with other arguments than the checkpoint's: " + "; ".join(changed) + ". The"
                " arguments you pass are in force; the scale, growth tracker and counters come from the checkpoint."
            )
        low, high = arguments["min_scale"], arguments["max_scale"]
        bounded = min(max(scale, low), high)
        if not (math.isfinite(scale) and scale > 0):
            bounded = float(arguments["init_scale"])
            tracker = 0
            self.warnings.append(
                f"The checkpoint's loss scale is {scale!r}, which would turn the next clean step into NaN weights"
                f" (it was saved by a scaler without bounds). Restarting the scale from init_scale={bounded:g}."
            )
        elif bounded != scale:
            self.warnings.append(
                f"The checkpoint's loss scale {scale:g} lies outside [min_scale, max_scale] = [{low:g}, {high:g}]:"
                f" clamped to {bounded:g}."
            )
        # torch grows the scale when the tracker reaches growth_interval exactly: a tracker saved under a larger
        # interval would pass the new one and never grow again (until an overflow). Such a tracker is due: it grows
        # next.
        return bounded, min(tracker, arguments["growth_interval"] - 1)
