"""SIGINT, SIGTERM and SIGHUP while ``lightning-precision compare`` runs: recorded, and acted on where it is safe.
Imports nothing heavy, so that the command line can take them before it imports torch and Lightning (seconds, during
which a Ctrl-C used to print a traceback, or vanish where SIGINT was ignored at start, as in a job started with
``&``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Interrupted", "STOP_SIGNALS", "Stop", "signal_name", "signals_blocked"]

# What stops a comparison: the terminal's Ctrl-C; SIGTERM from timeout, SLURM and Kubernetes; SIGHUP when the terminal
# closes (an ssh connection that drops): its default ends the process at once, every finished step lost. Where SIGHUP
# is ignored as the command starts (``nohup``) it stays ignored: the comparison runs on. (Windows has no SIGHUP.)
_SIGHUP = getattr(signal, "SIGHUP", None)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, *((_SIGHUP,) if _SIGHUP is not None else ()))
_NAMES: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


def signal_name(signum: int) -> str:
    """How the report names a signal: "Ctrl-C", "SIGTERM"."""
    return _NAMES.get(signum) or signal.Signals(signum).name


class Interrupted(BaseException):
    """A signal arrived where the work can be abandoned. Not an ``Exception``: no ``except Exception`` on the way may
    take it for a failure of what it interrupted."""


class Stop:
    """``STOP_SIGNALS`` from ``__enter__`` to ``__exit__`` (the previous handlers are restored then). The first signal
    asks every run to stop at its next turn, and what finished is written; a second one kills what still runs at
    once. The handler only records: the loops look between messages (every 0.2 s at most), so no exception lands in
    the middle of a message or of the cleanup. In a ``raising`` block (work that can be abandoned at any point: imports,
    parsing, measuring the batch) a signal raises ``Interrupted`` at once instead, as does entering such a block after
    one came."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}
        self._raising = False

    def __enter__(self) -> Stop:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set a handler
            for signum in STOP_SIGNALS:
                if signum == _SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:  # nohup: asked to run on
                    continue
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            # Ctrl-C works afterwards: Lightning leaves SIGINT ignored after a fit it interrupted (a notebook, a script
            # that trained first), and a CI run once found it ignored.
            if signum == signal.SIGINT and handler in (signal.SIG_IGN, None):
                handler = signal.default_int_handler
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if self._raising:
            self._raising = False  # once: what unwinds must not be cut again
            raise Interrupted

    @contextlib.contextmanager
    def raising(self) -> Iterator[None]:
        """A signal raises ``Interrupted`` in this block; one already received raises it on entry."""
        if self.received:
            raise Interrupted
        self._raising = True
        try:
            yield
        finally:
            self._raising = False

    @property
    def signum(self) -> int | None:
        """The first signal received, None if none."""
        return self.received[0] if self.received else None

    @property
    def hurry(self) -> bool:
        """A signal came after the first: nothing is waited for any more."""
        return len(self.received) > 1

    def exit_code(self, code: int) -> int:
        """128 + the first signal, as a shell reports a command the signal stopped (130 for Ctrl-C, 143 for SIGTERM, 129
        for SIGHUP); ``code`` if none came."""
        return 128 + self.signum if self.signum is not None else code

    def nothing_written(self, out: str | None = None) -> str:
        """The line for a comparison stopped before any precision reported a step."""
        kept = f", {out!r} keeps what it held" if out is not None else ""
        return (f"lightning-precision compare: interrupted ({signal_name(self.signum or signal.SIGINT)}) before any"
                f" precision reported a step: nothing written{kept}.")


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """``STOP_SIGNALS`` held back in this thread (and in what it starts: the mask is inherited through fork and exec);
    those that arrive meanwhile are delivered on leaving."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no process group receives them
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
