"""When a callback measures and logs: the logger's cadence, or its own."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_precision._checks import is_positive_int
from lightning_precision._upstream.lightning import batches_that_stepped, should_update_logs

__all__ = ["on_cadence", "set_cadence"]


def validate_every(owner: str, name: str, value: int | None) -> None:
    if value is not None and not is_positive_int(value):
        raise ValueError(f"`{owner}({name}={value!r})`: use a positive int, or None to follow the Trainer.")


def set_cadence(callback: object, owner: str, **every: int | None) -> None:
    """Check each cadence argument of ``owner``'s constructor (``log_every_n_steps=...``, ``measure_every_n_steps=...``)
    and keep it on ``callback`` under its own name: the one place every callback's cadence arguments go through."""
    for name, value in every.items():
        validate_every(owner, name, value)
        setattr(callback, name, value)


def on_cadence(trainer: pl.Trainer, every: int | None) -> bool:
    """Whether the coming optimizer step falls on the cadence: ``every`` steps, or the Trainer's logging steps when
    ``every`` is None. Answers the same from ``on_train_batch_start`` to ``on_before_optimizer_step``."""
    if every is None:
        return should_update_logs(trainer)
    return (batches_that_stepped(trainer) + 1) % every == 0
