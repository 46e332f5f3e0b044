"""What ``compare``'s fork server imports (``runner.PRELOAD``): what every precision's process needs, so that each is
forked ready to build its recipe; and the server's quick end."""

from __future__ import annotations

import atexit
import gc
import os
import sys

import lightning  # noqa: F401
import torch  # noqa: F401

import lightning_precision.cli.compare.child  # noqa: F401

__all__ = ["in_fork_server"]


def in_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server (or forked from it): its ``__main__`` is the server's
    command, which runs ``multiprocessing.forkserver.main``."""
    from multiprocessing import forkserver

    return getattr(sys.modules.get("__main__"), "main", None) is forkserver.main


if in_fork_server():
    # The server ends once the command and its processes have (its pipe closes). Tearing torch and Lightning down module
    # by module then takes seconds, during which the output the command shares with it stays open (`compare | tee`
    # waits): it has nothing to flush or close, so it ends at once. Its processes never run this: multiprocessing ends
    # each with os._exit.
    atexit.register(os._exit, 0)
    # What the server imported stays as it is: out of the garbage collector's sight, which would otherwise walk it (and
    # so copy its memory page by page) in every process forked from the server (the gc module's advice for fork).
    gc.freeze()
