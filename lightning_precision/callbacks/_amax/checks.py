"""AmaxHistoryLogger's constructor arguments, checked in its order: each error repeats the call and says the fix (the
cadence goes through ``_cadence.set_cadence``, between the window's arguments and the what-if's)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning_precision._checks import is_positive_int
from lightning_precision.formats import BLOCK_FORMATS, BlockFormat, get_format

__all__ = ["check_window", "what_if_formats"]

_OWNER = "AmaxHistoryLogger"


def check_window(history_len: Any, amax_compute_algo: Any, margin: Any, max_history_len: int) -> None:
    """The delayed-scaling window: its length, how its amax is taken, and TE's margin."""
    if not is_positive_int(history_len) or history_len > max_history_len:
        raise ValueError(f"`{_OWNER}(history_len={history_len!r})`: a number of steps from 1 to"
                         f" {max_history_len}, e.g. 16 (Transformer Engine's default is 1024).")
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"`{_OWNER}(amax_compute_algo={amax_compute_algo!r})`: use 'max' or 'most_recent'.")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"`{_OWNER}(margin={margin!r})`: Transformer Engine's margin, a whole number of powers of"
                         " two >= 0, e.g. 0.")


def _block_format(name: str) -> object:
    try:
        return get_format(name)
    except ValueError:
        return None


def what_if_formats(what_if: Any, what_if_sample: Any, block_formats: Sequence[str], save_dir: Any) -> tuple[str, ...]:
    """The what-if's arguments and ``save_dir``, checked; the names of ``block_formats``."""
    if not isinstance(what_if, bool):
        raise ValueError(f"`{_OWNER}(what_if={what_if!r})`: pass True or False.")
    if what_if_sample is not None and not is_positive_int(what_if_sample):
        raise ValueError(f"`{_OWNER}(what_if_sample={what_if_sample!r})`: a positive number of elements, e.g. 65536,"
                         " or None for all.")
    if isinstance(block_formats, str) or not all(
            isinstance(f, str) and isinstance(_block_format(f), BlockFormat) for f in block_formats):
        raise ValueError(f"`{_OWNER}(block_formats={block_formats!r})`: a tuple of block-scaled formats from"
                         f" {tuple(BLOCK_FORMATS)}, or ().")
    if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
        raise ValueError(f"`{_OWNER}(save_dir={save_dir!r})`: a folder path, or None.")
    return tuple(get_format(f).name for f in block_formats)
