"""Argument checks shared by the constructors (each keeps its own message, which names the call it rejects)."""

from typing import Any


def is_positive_int(value: Any) -> bool:
    """A count of steps or elements: an int >= 1 (``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
