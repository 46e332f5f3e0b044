"""The terminal the command line prints to."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["console", "echo"]


def console() -> Console:
    from rich.console import Console  # here: `echo`'s users (plan) do not pay for importing rich

    # A pipe or a log file reports width 80, which folds every column of a wide table: use a readable width there.
    return Console(width=None if sys.stdout.isatty() else 150)


def echo(text: str) -> bool:
    """Print ``text`` to standard output, flushed; False if the reader has gone (``| head`` closed the pipe). The rest
    of the output then goes nowhere, quietly, as Unix tools do: no BrokenPipeError from this call, nor from Python's
    last flush at exit. The command carries on (a plan is still written to its file)."""
    try:
        print(text, flush=True)
        return True
    except BrokenPipeError:
        # What is still buffered is lost with the reader; stdout now points at the null device, so nothing else fails.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return False
