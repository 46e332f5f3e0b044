"""Warnings of the package, and ``warn``, which attributes them to the user's line."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import warnings
from types import FrameType

from lightning_utilities.core.rank_zero import rank_zero_only

__all__ = ["NoEffectWarning", "process_rank"]


class NoEffectWarning(UserWarning):
    """A transform or plugin found nothing to change (no convolution to make channels-last, no layer to run in fp8)."""


# Our warnings are raised from inside Lightning hooks, torch hooks and the CLI: the user's line is the first frame
# outside all of them. contextlib too: hooks that run on leaving our context managers are called from its __exit__.
_FRAMEWORKS = ("lightning_precision", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities",
               "torch", "torchao", "jsonargparse")


@functools.cache
def _internal_prefixes() -> tuple[str, ...]:
    # `find_spec` of a top-level name locates the package without importing it (torchao's import is slow and noisy).
    # The separator keeps `torch` from matching `torchvision`, and `lightning` from matching the user's `lightning_app`.
    prefixes = [contextlib.__file__]
    for name in _FRAMEWORKS:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            prefixes += [os.path.join(d, "") for d in spec.submodule_search_locations]
    return tuple(prefixes)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` called from ``warn`` point at the first frame outside the
    package and the frameworks it runs inside; the direct caller of ``warn`` when the whole stack is theirs."""
    prefixes = _internal_prefixes()
    frame: FrameType | None
    frame, level = sys._getframe(2), 2  # the caller of `warn`, as `warnings.warn(stacklevel=2)` from `warn` sees it
    while frame is not None:
        if not frame.f_code.co_filename.startswith(prefixes):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def process_rank() -> int:
    """This process's global rank, as Lightning's rank-zero utilities hold it (an attribute their typing does not
    declare; 0 before a launcher sets it)."""
    return int(getattr(rank_zero_only, "rank", 0))  # noqa: B009


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` on global rank zero (every rank would say the same), attributed to the user's code.

    Python attributes a warning to a fixed number of frames up; ours are raised from inside Lightning and torch hooks,
    so that would name Lightning's ``strategy.py``, whose line the user cannot act on (nor filter by module).
    """
    if process_rank() == 0:
        warnings.warn(message, category, stacklevel=_user_stacklevel())


def deprecated(old: str, new: str) -> None:
    """Say once per call site that ``old`` is now ``new``: for a name of a released version only (an unreleased one is
    renamed outright). The test suite turns these warnings into errors."""
    warn(f"`{old}` is deprecated and will be removed after 0.2: use `{new}`.", DeprecationWarning)


# Warnings of the libraries beneath us that a user of our command line can do nothing about, by message. Lightning
# 2.6 calls torch's deprecated `isinstance(treespec, LeafSpec)` on torch >= 2.10, once per fit.
_KNOWN_HARMLESS = (r".*isinstance\(treespec, LeafSpec\).*is deprecated.*",)


def ignore_known_harmless() -> None:
    """For the command line's own process: hide ``_KNOWN_HARMLESS`` (a library calling the code must decide itself)."""
    for pattern in _KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", pattern)
