"""The terminal the command line prints to."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

from typing_extensions import override

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["console", "echo", "lightning_quieted", "quiet_lightning", "say"]


def _silence(stream: TextIO) -> None:
    """Point ``stream`` (stdout, stderr) at the null device: what is still buffered is lost with the reader, and
    Python's own writes and its flush at exit go nowhere instead of failing."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file of the system (a test's capture): nothing to point
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


@functools.cache
def _outliving() -> type[Console]:
    from rich.console import Console

    class Outliving(Console):
        """A console that goes quiet when its reader goes away (``compare | head``) instead of ending the program, as
        rich's does (``SystemExit(1)`` from inside the print): a comparison under way goes on and writes its report."""

        @override
        def on_broken_pipe(self) -> None:
            self.quiet = True
            _silence(sys.stdout)

        @override
        def _check_buffer(self) -> None:
            # rich takes only EPIPE for a reader gone; a terminal that hung up (the ssh connection dropped, the window
            # closed: SIGHUP) answers EIO, which would end the comparison before it writes its report.
            try:
                super()._check_buffer()
            except OSError:
                self.on_broken_pipe()

    return Outliving


def console(outlive_reader: bool = False) -> Console:
    """The console on stdout; ``outlive_reader``: printing never stops the program, even when stdout is a pipe that
    was closed. rich is imported here: `echo`'s users (plan) do not pay for it."""
    from rich.console import Console

    # A pipe or a log file reports width 80, which folds every column of a wide table: use a readable width there,
    # unless COLUMNS says the width (rich reads it, as on a terminal): the user's choice for a log or a pager.
    columns = os.environ.get("COLUMNS", "")
    chosen = sys.stdout.isatty() or (columns.isdigit() and int(columns) > 0)
    return (_outliving() if outlive_reader else Console)(width=None if chosen else 150)


def say(text: str) -> bool:
    """Print ``text`` to standard error, flushed; False if nobody reads it any more (a closed pipe, a terminal that
    hung up): stderr then goes nowhere, quietly, and the command carries on (its exit code stays its own)."""
    if sys.stderr is None:  # started with stderr closed (`2>&-`): print would write to stdout instead
        return False
    try:
        print(text, file=sys.stderr, flush=True)
        return True
    except OSError:
        _silence(sys.stderr)
        return False


def echo(text: str) -> bool:
    """Print ``text`` to standard output, flushed; False if the reader has gone (``| head`` closed the pipe). The rest
    of the output then goes nowhere, quietly, as Unix tools do: no BrokenPipeError from this call, nor from Python's
    last flush at exit. The command carries on (a plan is still written to its file)."""
    try:
        print(text, flush=True)
        return True
    except OSError:  # BrokenPipeError; EIO from a terminal that hung up
        _silence(sys.stdout)
        return False


_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning")


def quiet_lightning() -> None:
    """One table, not a Trainer banner and hints per precision; Lightning's known-harmless notices go too."""
    from lightning_precision._warnings import ignore_known_harmless

    ignore_known_harmless()
    for pattern in (".*does not have many workers.*", ".*GPU available but not used.*"):
        warnings.filterwarnings("ignore", pattern)
    for name in _LIGHTNING_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


@contextlib.contextmanager
def lightning_quieted() -> Iterator[None]:
    """``quiet_lightning`` for the duration only: a command called from a script (or a test) leaves Lightning's logger
    levels and the warning filters as it found them."""
    levels = {name: logging.getLogger(name).level for name in _LIGHTNING_LOGGERS}
    with warnings.catch_warnings():
        quiet_lightning()
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
