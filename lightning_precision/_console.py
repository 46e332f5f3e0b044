"""The terminal the command line prints to."""

import sys

from rich.console import Console

__all__ = ["console"]


def console() -> Console:
    # A pipe or a log file reports width 80, which folds every column of a wide table: use a readable width there.
    return Console(width=None if sys.stdout.isatty() else 150)
