"""The terminal the command line prints to."""

import os
import sys

from rich.console import Console
from typing_extensions import override

__all__ = ["console"]


class _Outliving(Console):
    """A console that goes quiet when its reader goes away (``compare | head``) instead of ending the program, as
    rich's does (``SystemExit(1)`` from inside the print): a comparison under way goes on and writes its report."""

    @override
    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)  # Python's own writes and its flush at exit go nowhere too
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def console(outlive_reader: bool = False) -> Console:
    """The console on stdout; ``outlive_reader``: printing never stops the program, even when stdout is a pipe that
    was closed."""
    # A pipe or a log file reports width 80, which folds every column of a wide table: use a readable width there.
    return (_Outliving if outlive_reader else Console)(width=None if sys.stdout.isatty() else 150)
