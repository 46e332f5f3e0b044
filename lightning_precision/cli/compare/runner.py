"""The parent's side of ``lightning-precision compare``: one process per precision (``child.run_child``), taking turns
in an order that rotates every round, the progress shown as they go, and every process ended on the way out, whatever
happened: asked to stop at its next turn, killed after a grace period or at a second signal.

The processes are forked from multiprocessing's fork server, which imports what a run needs (``PRELOAD``: torch,
Lightning, this package) once, while the parent measures the batch, instead of once per precision: each run still has
a process of its own (its own memory, its own crash), forked from a server that has run nothing but those imports.
Where there is no fork server (Windows), each process is spawned and imports them itself."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from lightning_precision.cli.compare.args import UsageError, block_size
from lightning_precision.cli.compare.child import run_child
from lightning_precision.cli.spawn import NO_MAIN_GUARD_EXIT, no_main_guard_message
from lightning_precision.cli.stop import Interrupted, Stop, signals_blocked

__all__ = ["GRACE_S", "PRELOAD", "Run", "advance", "context", "end_server", "fork_server", "preload", "run_all",
           "start", "stop_all"]

GRACE_S = 5.0  # after a signal, how long a process may take to reach its next turn before it is killed

# What the fork server imports: torch, Lightning and the child's side of compare. Only modules that leave CUDA alone as
# they import (tests/cli/test_compare_overhead.py checks it): a process forked from one in which CUDA started cannot use
# CUDA. So not the recipes' model libraries (transformers imports torchao, which asks torch.cuda.is_available() as it
# loads): each run imports those itself.
PRELOAD = ("lightning_precision.cli.compare.preload",)

OnStep = Callable[[int], None]


def _no_step(steps: int) -> None:
    pass


class Run:
    """The parent's record of one precision's process: what it has reported so far."""

    def __init__(self, precision: str, process: Any, conn: Any) -> None:
        self.precision, self.process, self.conn = precision, process, conn
        self.times: list[float] = []
        self.losses: list[float] = []
        self.blocks: list[list[float]] = []
        self.peak_mb: float | None = None
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.detail: str | None = None
        self.no_main_guard = False  # it ended as it started: the calling script lacks the __main__ guard
        self.threads: int | None = None  # torch's intra-op threads in the process, as it counted them at its start

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def take_turn(self, on_step: OnStep, stop: Stop) -> None:
        """Let the process run until it yields (a block done) or ends (its result, or an error)."""
        try:
            self.conn.send("go")
        except OSError:  # the process died between turns (BrokenPipeError): say how it ended
            self.fail_from_exit()
            return
        self.wait(on_step, stop)

    def wait(self, on_step: OnStep, stop: Stop) -> None:
        """Read the process's messages until it yields or ends; ``Interrupted`` as soon as a signal has arrived."""
        while True:
            if stop.signum is not None:
                raise Interrupted
            if not self.conn.poll(0.2):
                if self.process.is_alive() or self.conn.poll(0):  # its last message may have come as it exited
                    continue
                self.fail_from_exit()
                return
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.fail_from_exit()
                return
            if self.take(message, on_step):
                if self.finished:  # its result is in: a process that does not exit by itself must not hang the run
                    self.end(stop)
                return

    def take(self, message: tuple[Any, ...], on_step: OnStep = _no_step) -> bool:
        """Record one message; True if the process's turn is over (it yielded, or ended)."""
        kind = message[0]
        if kind == "block":
            times, losses, self.peak_mb = message[1], message[2], message[3]
            self.times += times
            self.losses += losses
            self.blocks.append(times)
            on_step(len(times))
            return False
        if kind == "threads":
            self.threads = message[1]
            return False
        if kind == "done":
            self.result = message[1]
        elif kind == "error":
            self.error, self.detail = message[1], message[2]
        return True

    def drain(self) -> None:
        """Record what the process has sent and not been read, without waiting: blocks finished as it was stopped."""
        try:
            while self.conn.poll(0):
                self.take(self.conn.recv())
        except (EOFError, OSError):
            pass

    def fail_from_exit(self) -> None:
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code == NO_MAIN_GUARD_EXIT:  # it ended while importing the calling script (``spawn``)
            self.error, self.no_main_guard = no_main_guard_message(), True
            return
        why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        hint = " (signal 9 is often the out-of-memory killer)" if code == -signal.SIGKILL else ""
        self.error = f"its process ended before finishing: {why}{hint}"

    def ask_to_stop(self) -> None:
        """Tell the process to end at its next turn boundary (Lightning would swallow a SIGTERM)."""
        if self.process.is_alive():
            try:
                self.conn.send("stop")
            except OSError:
                pass

    def end(self, stop: Stop) -> None:
        """The process has reported its end: give it 10 s to exit, then kill it. A signal cuts the wait short
        (``stop_all`` ends it then)."""
        self.ask_to_stop()
        deadline = time.monotonic() + 10
        while self.process.is_alive() and time.monotonic() < deadline and stop.signum is None:
            self.process.join(timeout=0.2)
        if self.process.is_alive() and stop.signum is None:
            self.process.kill()
            self.process.join()


def stop_all(runs: list[Run], stop: Stop, grace: float = GRACE_S) -> None:
    """End every process, whatever happened: each is asked to stop at its next turn boundary, and killed if it has
    not ended ``grace`` seconds later, or at once once a second signal has come. Blocks that arrive meanwhile are
    kept. Returns when every process is gone (a process in an uninterruptible wait, e.g. a driver call, after 5 s
    more)."""
    for run in runs:
        run.ask_to_stop()
    deadline = time.monotonic() + grace
    while not stop.hurry and time.monotonic() < deadline:
        alive = [run for run in runs if run.process.is_alive()]
        if not alive:
            break
        for run in alive:
            run.drain()  # a process blocked on a full pipe would never reach its turn boundary
        multiprocessing.connection.wait([run.process.sentinel for run in alive], timeout=0.1)
    for run in runs:
        if run.process.is_alive():
            run.process.kill()
    for run in runs:
        run.process.join(timeout=5)
        run.drain()


def context() -> Any:
    """Where the precisions' processes come from: the fork server, preloaded with ``PRELOAD``, where the platform has
    one; else spawn. Never a plain fork of the parent: it has run torch (threads, possibly CUDA) by then."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(list(PRELOAD))  # taken when the server starts (a running one is kept as it is)
    return forkserver


def _unblockable_helpers() -> None:
    """multiprocessing starts its resource tracker at the first process (or fork server) it starts, and then unblocks
    SIGINT and SIGTERM instead of restoring the mask it found: started first, it leaves the mask alone."""
    if hasattr(signal, "pthread_sigmask"):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()


def preload() -> bool:
    """Start the fork server now, so that it imports ``PRELOAD`` while the parent does its own work (measuring the
    batch); nothing where processes are spawned. Born with the stop signals blocked, as each process is (``start``):
    the server, and every process forked from it, outlives a Ctrl-C to the process group until the parent has stopped
    the runs. True if this call started it (none was running)."""
    if context().get_start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    before = _server_pid()
    _unblockable_helpers()
    with signals_blocked():
        forkserver.ensure_running()
    return _server_pid() != before


def _server() -> Any:
    """multiprocessing's one fork server object: its pid and ``_stop`` have no public name."""
    from multiprocessing import forkserver

    return forkserver._forkserver


def _server_pid() -> int | None:
    return getattr(_server(), "_forkserver_pid", None)


def end_server() -> None:
    """End the fork server now, also in the middle of its imports (it has nothing to flush: ``preload``), and reap it;
    the processes forked from it are not its to end. The next process to start starts a new one."""
    pid = _server_pid()
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    try:
        _server()._stop()  # closes its pipe, reaps it, forgets its address
    except ChildProcessError:  # reaped already (a SIGCHLD handler of the caller's)
        _server()._forkserver_pid = None


@contextlib.contextmanager
def fork_server() -> Iterator[None]:
    """``preload`` for one comparison: a server it starts ends with it, on every way out. Otherwise it outlived the
    command by the rest of its imports after a usage error or a Ctrl-C (holding the output open: `compare | tee`
    waited), and a second comparison in one Python process forked from a server started with the first one's
    environment: libgomp reads OMP_NUM_THREADS as torch loads, so its runs had the first one's thread count."""
    started = preload()
    try:
        yield
    finally:
        if started:
            end_server()


def start(recipe: str, precision: str, args: argparse.Namespace) -> Run:
    """Start one precision's process (``child.run_child``); it reports once ready for its first turn."""
    ctx = context()
    parent, child = ctx.Pipe()
    # The parent's environment as it is now: a process forked from the server would otherwise have the server's, taken
    # when it started (a script may set CUDA_VISIBLE_DEVICES between two comparisons).
    process = ctx.Process(target=run_child, args=(child, recipe, precision, args, dict(os.environ)), daemon=True,
                          name=f"compare-{precision}")
    # Born with SIGINT and SIGTERM blocked: a signal sent to the whole process group (Ctrl-C in a terminal, timeout,
    # SLURM) must not end it while it starts, before ``run_child`` ignores them.
    _unblockable_helpers()
    with signals_blocked():
        process.start()
    child.close()
    return Run(precision, process, parent)


def _started(start_one: Callable[[], Run], stop: Stop) -> Run:
    """``start_one()``, in a thread of its own, the signals watched meanwhile. A process forked from the fork server
    starts once the server has finished its imports (seconds, more on a network file system), with the stop signals
    blocked in the thread that starts it: a Ctrl-C, even a second one, waited for those imports. Now a signal ends the
    server (the process is never forked, or already was: then it is returned, for ``stop_all`` to end); ``Interrupted``
    if it was not started."""
    started: list[Run] = []
    failed: list[BaseException] = []

    def target() -> None:
        # The signals blocked here for good: taken by this thread, a signal waited for the next one the main thread took
        # (CPython then tells only its own thread that one is pending).
        with signals_blocked():
            try:
                started.append(start_one())
            except BaseException as err:  # raised here, in the caller's thread
                failed.append(err)

    thread = threading.Thread(target=target, name="compare-start", daemon=True)
    thread.start()
    ended = False
    while thread.is_alive():
        if stop.signum is not None and not ended:
            end_server()
            ended = True
        thread.join(0.1)
    if failed:
        if ended:  # the server ended under it
            raise Interrupted
        raise failed[0]
    return started[0]


def advance(progress: Any, task: Any, steps: int) -> None:
    """The progress bar of one precision moved by ``steps``. Where stdout is not a terminal (a pipe, a log file, a batch
    job) rich draws nothing until the end: a line per finished turn says how far each precision is."""
    progress.advance(task, steps)
    if progress.disable:
        state = progress.tasks[task]
        progress.console.print(f"{' '.join(state.description.split())}: {state.completed:.0f}/{state.total:.0f} steps,"
                               f" {datetime.timedelta(seconds=round(state.elapsed or 0))} elapsed", highlight=False,
                               markup=False)


def run_all(args: argparse.Namespace, precisions: list[str], progress: Any, stop: Stop) -> dict[str, Run]:
    """Start every precision's process, then take turns until all are done or a signal arrives; every process has
    ended on return, whatever happened. ``start`` and ``advance`` are looked up here at each call: a test (or a
    driver script) may wrap them."""
    runs: dict[str, Run] = {}
    tasks = {p: progress.add_task(f"{args.recipe} {p:>10}", total=args.steps) for p in precisions}
    if progress.disable:  # no bars (stdout is not a terminal): say what comes, as a bar at 0 would
        block = block_size(args.steps)
        progress.console.print(f"{args.recipe}: starting {', '.join(precisions)}, each in its own process; a line per"
                               f" turn of {block} step{'s' if block > 1 else ''} follows", highlight=False,
                               markup=False)

    def stepped(precision: str) -> OnStep:
        return lambda steps: advance(progress, tasks[precision], steps)

    try:
        for p in precisions:
            if stop.signum is not None:
                raise Interrupted
            runs[p] = _started(functools.partial(start, args.recipe, p, args), stop)
        for run in runs.values():  # up to its first turn: imports, model, data, Trainer; untimed, side by side
            run.wait(_no_step, stop)
            if run.no_main_guard:  # every process would end so: one line, as for any argument the runs refuse
                raise UsageError(run.error)
        turn = 0
        while not all(r.finished for r in runs.values()):
            order = precisions[turn % len(precisions):] + precisions[: turn % len(precisions)]
            for p in order:  # the order rotates: no precision always runs first after a pause
                if not runs[p].finished:
                    runs[p].take_turn(stepped(p), stop)
            turn += 1
    except Interrupted:
        pass
    finally:
        stop_all(list(runs.values()), stop)
    return runs
