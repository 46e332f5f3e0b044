"""Argument checks shared by the constructors (each keeps its own message, which names the call it rejects)."""

from typing import Any

__all__ = ["is_positive_int", "one_config"]


def is_positive_int(value: Any) -> bool:
    """A count of steps or elements: an int >= 1 (``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def one_config(owner: str, arg: str, config_cls: type, config: Any, flat: dict[str, Any]) -> Any:
    """The config a constructor takes either as one frozen ``config`` (passed as ``arg=``) or as flat arguments, never
    both: a flat argument changed beside the config would be silently overridden by one of them. Flat arguments left
    at the config class's defaults are no conflict."""
    if config is None:
        return config_cls(**flat)
    if not isinstance(config, config_cls):
        raise ValueError(f"`{owner}({arg}={config!r})`: pass a `lightning_precision.{config_cls.__name__}(...)`, or the"
                         f" flat arguments ({', '.join(flat)}).")
    changed = [f"{name}={value!r}" for name, value in flat.items() if value != getattr(config_cls, name)]
    if changed:
        raise ValueError(f"`{owner}({arg}={config_cls.__name__}(...), {', '.join(changed)})`: give these arguments in"
                         f" one place. Put them in the config:"
                         f" `{arg}=dataclasses.replace(config, {', '.join(changed)})`.")
    return config
