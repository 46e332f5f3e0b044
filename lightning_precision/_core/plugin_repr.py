"""A plugin's ``repr``: its class and the constructor arguments that differ from their defaults, read back from the
plugin (``BF16TruePrecision(update='compensated', eval_precision='32-true')``)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["plugin_repr"]

_MISSING = object()
_LONGEST = 60  # a value whose repr is longer (a plan, a TE recipe object) is shown by its type


def _show(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f for f in dataclasses.fields(value) if f.repr]
        changed = [f"{f.name}={_show(getattr(value, f.name))}" for f in fields
                   if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default]
        return f"{type(value).__name__}({', '.join(changed)})"
    if isinstance(value, tuple) and all(isinstance(v, type) for v in value):  # keep_fp32's classes
        return f"({', '.join(v.__name__ for v in value)}{',' if len(value) == 1 else ''})"
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    shown = repr(value)
    return shown if len(shown) <= _LONGEST else f"<{type(value).__name__}>"


def _default_of(value: Any, default: Any, parameters: Mapping[str, inspect.Parameter]) -> Any:
    """A dataclass argument left at None (``scaler``, ``layer_policy``) is resolved from the flat arguments beside it:
    its default is what their defaults make."""
    if default is not None or not dataclasses.is_dataclass(value) or isinstance(value, type):
        return default
    flat = {f.name: parameters[f.name].default for f in dataclasses.fields(value) if f.name in parameters}
    return type(value)(**flat)


def _same(value: Any, default: Any) -> bool:
    try:
        return value is default or bool(type(value) is type(default) and value == default)
    except Exception:  # a tensor, an object without equality: shown
        return False


def plugin_repr(plugin: Any, kept_by: Callable[[], Mapping[str, Any]]) -> str:
    """``kept_by()``: the arguments the plugin keeps under another name (the resolved ``scaler``); the others are read
    as attributes of the same name, and one it does not keep is left out. Never raises: a plugin half built or unpickled
    is shown by its class name."""
    name = type(plugin).__name__
    try:
        parameters = inspect.signature(type(plugin).__init__).parameters
        kept = kept_by()
        shown: dict[str, Any] = {}
        for arg, parameter in parameters.items():
            if arg == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            value = kept[arg] if arg in kept else getattr(plugin, arg, _MISSING)
            if value is not _MISSING and not _same(value, _default_of(value, parameter.default, parameters)):
                shown[arg] = value
        # A flat argument shown inside its dataclass (`scaler=ScalerConfig(init_scale=...)`) is not repeated.
        inside = {f.name for v in shown.values() if dataclasses.is_dataclass(v) for f in dataclasses.fields(v)}
        return f"{name}({', '.join(f'{arg}={_show(v)}' for arg, v in shown.items() if arg not in inside)})"
    except Exception:
        return name
