"""``lightning-precision compare``: one recipe under several precisions, same seed and steps, side by side.

Each precision trains in its own process, and the processes take turns: a block of steps each, in an order that
rotates every round, so a machine that slows down or speeds up during the comparison slows every precision alike, and
each precision's memory is its own process's, whatever the run order. Every timing figure rests on each turn's median
step time: ms/step is their median, samples/s and MFU follow from it, and the speedup is 32-true's ms/step over this
precision's, so they rank the precisions alike. The speedup's bracket is the interquartile range of the paired ratios
(32-true's turn over this precision's in the same round, measured back to back); a speedup whose bracket includes 1x,
or lies on its other side (the machine's speed changed), is flagged as not resolved.

Per precision: step time (median and spread), samples/s, speedup, peak memory, final loss, validation accuracy,
gradient underflow in fp16 (unscaled, and at the loss scale for 16-mixed) and skipped steps. A table on the terminal
(a line per finished turn where stdout is not one), and ``report.md``, ``report.json`` (with the machine),
``report.csv``, ``loss.png``, ``throughput.png`` and ``memory.png`` in the output folder.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import shlex
import signal
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_precision.cli.console import say
from lightning_precision.cli.outdir import claim_folder
from lightning_precision.cli.report import FILES, NOISY
from lightning_precision.cli.spawn import NO_MAIN_GUARD_EXIT, exit_if_importing_main, no_main_guard_message
from lightning_precision.cli.stop import STOP_SIGNALS, Interrupted, Stop, signal_name
from lightning_precision._mfu import (
    choose_peak,
    compute_kind,
    mfu,
    model_flops_per_step,
    parse_peak_override,
    plugin_compute_dtype,
)
from lightning_precision.cli.recipes import RECIPES

__all__ = ["PRECISIONS", "main"]

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "fp8", "fp8-auto")
_FP8_PRECISIONS = ("fp8", "fp8-auto")  # fp8-auto: FP8Precision(layers="auto"), layers chosen from measured numerics
_WARMUP = 3  # first steps left out of every timing (allocation, autotuning, lazy init)
_QUICK_STEPS, _QUICK_VAL_BATCHES = 30, 2
_MIN_PAIRS = 3  # paired blocks needed before a speedup can count as resolved
_GRACE_S = 5.0  # after a signal, how long a process may take to reach its next turn before it is killed
_MAX_SEED = 2**32 - 1  # Lightning's seed_everything (numpy's bound) refuses a seed outside [0, 2**32 - 1]


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


def _one_line(text: str) -> str:
    """A message as one line: the whole of it, whitespace runs folded."""
    return " ".join(str(text).split())


def _calibration_steps(steps: int) -> int:
    """fp8-auto's measured steps: 8 (the plugin's default), fewer in short runs so that most steps run the plan."""
    return max(1, min(8, steps // 4))


def _untimed_steps(precision: str, steps: int) -> int:
    """Steps left out of the timings: the warm-up, and for fp8-auto its measured steps and a warm-up after them."""
    return _WARMUP + (_calibration_steps(steps) if precision == "fp8-auto" else 0)


def _make_plugin(precision: str, emulate: bool, steps: int = 100) -> Any:
    from lightning_precision import BF16MixedPrecision, FP8Precision, FP16MixedPrecision
    from lightning_precision.fp8 import fp8_gpu_available

    if precision == "32-true":
        return None
    if precision == "bf16-mixed":
        return BF16MixedPrecision()
    if precision == "16-mixed":
        return FP16MixedPrecision()
    # Emulated fp8 is for numerics on small models: run every eligible layer in fp8, not only the large ones.
    kwargs = {"emulate": emulate and not fp8_gpu_available(), "skip_small_layers": not emulate}
    if precision == "fp8-auto":
        kwargs.update(layers="auto", calibration_batches=_calibration_steps(steps))
    return FP8Precision(**kwargs)


# ---------------------------------------------------------------------------------------------------------- planning


def _on_gpu(args: argparse.Namespace) -> bool:
    return torch.cuda.is_available() and args.accelerator in ("auto", "cuda", "gpu")


def _emulated(precision: str, machine: dict[str, Any], gpu: bool) -> bool:
    """Whether this precision's arithmetic is emulated where it runs: its speed then says nothing about the format."""
    if precision in _FP8_PRECISIONS:
        from lightning_precision.fp8 import fp8_gpu_available

        return not fp8_gpu_available()
    if gpu or precision == "32-true":
        return False
    return not machine["cpu"][f"native_{'bf16' if precision == 'bf16-mixed' else 'fp16'}"]


def _default_precisions(machine: dict[str, Any], args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The precisions this machine can compare usefully, and a line for each one left out, saying why."""
    from lightning_precision import _imports
    from lightning_precision.fp8 import fp8_gpu_available

    chosen, notes = ["32-true"], []
    gpu = _on_gpu(args)
    no_bf16 = _precheck("bf16-mixed", args) if gpu else None
    if no_bf16:
        notes.append(f"bf16-mixed left out: {no_bf16}")
    else:
        chosen.append("bf16-mixed")
    if gpu or machine["cpu"]["native_fp16"]:
        chosen.append("16-mixed")
    else:
        notes.append("16-mixed left out: this CPU has no fp16 arithmetic (torch emulates it, several times slower than"
                     " 32-true). Add it with --precisions 32-true,bf16-mixed,16-mixed to check its numerics.")
    if fp8_gpu_available() or args.emulate:
        if _imports.TORCHAO_AVAILABLE:
            chosen.append("fp8")
        else:
            notes.append(f"fp8 left out: torchao is not installed ({_imports.install_command('torchao')}).")
    return chosen, notes


def _precheck(precision: str, args: argparse.Namespace) -> Optional[str]:
    """Why this precision cannot run here, found before any precision starts; None if it can."""
    from lightning_precision import _imports

    if precision in _FP8_PRECISIONS and not _imports.TORCHAO_AVAILABLE:
        return f"{precision} needs torchao, which is not installed: {_imports.install_command('torchao')}"
    if precision == "bf16-mixed" and _on_gpu(args):
        from lightning_precision.fabric._devices import check_bf16_supported

        try:
            check_bf16_supported("cuda")
        except RuntimeError as err:
            return _one_line(err)
    try:
        _make_plugin(precision, args.emulate, args.steps)
    except Exception as err:  # a constructor's own check (hardware, versions): its message is the reason
        return f"{type(err).__name__}: {_one_line(err)}"
    return None


def _block_size(steps: int) -> int:
    """Steps per turn: about ten turns per run."""
    return max(1, steps // 10)


# ------------------------------------------------------------------------------------------------- the child process


def _reset_peak_rss() -> bool:
    """Restart the kernel's resident high-water mark (Linux >= 4.0), so the peak is training's, not the imports'."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """Peak resident memory: VmHWM where /proc has it (reset by ``_reset_peak_rss``), else the process's lifetime peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # Unix only: on Windows the memory column stays empty

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _rss_bytes() -> int:
    """Resident memory now; where /proc is missing (macOS), the peak so far, which is what training adds to."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _peak_rss_bytes()


class _RunStats(Callback):
    """Step times and losses of one run; waits for its turn at every block start (``gate``) and hands each
    finished block to ``on_block``. Times exclude the waits."""

    def __init__(self, block: int, gate: Callable[[], None], on_block: Callable[..., None]) -> None:
        self.block, self.gate, self.on_block = block, gate, on_block
        self.times: list[float] = []
        self._losses: list[torch.Tensor] = []
        self.sent = 0
        self.cuda = torch.cuda.is_available()
        self.rss_start = 0
        self.val_samples = 0

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            _reset_peak_rss()
            self.rss_start = _rss_bytes()
        except ImportError:
            pass

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if len(self.times) % self.block == 0:
            if self.times:
                self.flush()
            self.gate()
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)
        self._losses.append(outputs["loss"].detach())  # read at the block's end: no device read inside a step

    @override
    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, *args: Any) -> None:
        # The samples the accuracy rests on (fewer than --val-batches x batch size on a small validation set): the
        # verdict's notion of "same accuracy" depends on it. The recipes' batches end with the labels.
        labels = batch[-1] if isinstance(batch, (list, tuple)) and batch else None
        self.val_samples += len(labels) if isinstance(labels, torch.Tensor) and labels.ndim else 0

    def peak_memory_mb(self) -> Optional[float]:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        try:
            return max(0, _peak_rss_bytes() - self.rss_start) / 2**20
        except ImportError:
            return None

    def flush(self) -> None:
        """Hand over the steps not handed over yet."""
        losses = torch.stack(self._losses[self.sent:]).float().tolist() if len(self._losses) > self.sent else []
        self.on_block(self.times[self.sent:], losses, self.peak_memory_mb())
        self.sent = len(self.times)


_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning")


def _quiet_lightning() -> None:
    """One table, not a Trainer banner and hints per precision; Lightning's known-harmless notices go too."""
    from lightning_precision._warnings import ignore_known_harmless

    ignore_known_harmless()
    for pattern in (".*does not have many workers.*", ".*GPU available but not used.*"):
        warnings.filterwarnings("ignore", pattern)
    for name in _LIGHTNING_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


@contextlib.contextmanager
def _lightning_quieted() -> Iterator[None]:
    """``_quiet_lightning`` in the caller's process for the comparison only: ``main`` called from a script (or a test)
    leaves Lightning's logger levels and the warning filters as it found them."""
    levels = {name: logging.getLogger(name).level for name in _LIGHTNING_LOGGERS}
    with warnings.catch_warnings():
        _quiet_lightning()
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def _run_one(recipe: str, precision: str, args: argparse.Namespace, gate: Callable[[], None] = lambda: None,
            on_block: Callable[..., None] = lambda *a: None) -> dict[str, Any]:
    """Train ``recipe`` under ``precision`` in this process; the figures that need the whole run (validation accuracy,
    underflow, skipped steps). Step times and losses go to ``on_block`` as they come."""
    import lightning as L

    from lightning_precision.callbacks import GradientUnderflowMonitor

    L.seed_everything(args.seed, verbose=False)
    data_args = {"batch_size": args.batch_size, "seed": args.seed}
    if args.data_dir:
        data_args["data_dir"] = args.data_dir
    model, data = RECIPES[recipe].build(data_args=data_args)
    stats = _RunStats(_block_size(args.steps), gate, on_block)
    monitor = GradientUnderflowMonitor(formats=("fp16",), top_k=0, warn_threshold=1.0,
                                       measure_every_n_steps=max(1, args.steps // 10), log_every_n_steps=args.steps)
    plugin = _make_plugin(precision, args.emulate, args.steps)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.steps, plugins=[plugin] if plugin else None,
        callbacks=[stats, monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=args.val_batches, num_sanity_val_steps=0,
        check_val_every_n_epoch=10**9, log_every_n_steps=args.steps,  # validation once, after the timed steps
    )
    trainer.fit(model, data)
    stats.flush()
    metrics = dict(trainer.callback_metrics)
    gate()  # validation takes a turn too: it must not run beside another precision's timed steps
    val = trainer.validate(model, datamodule=data, verbose=False)[0] if args.val_batches else {}
    unscaled, scaled = (metrics.get(f"precision/underflow/fp16{k}") for k in ("", "/scaled"))
    return {
        "val_acc": float(val["val_acc"]) if "val_acc" in val else None,
        "val_samples": stats.val_samples,
        # two figures, never one for the other: parameter gradients cast to fp16 as they are (every precision), and at
        # the loss scale in effect (the fp16 run only: what its backward meets)
        "grad_underflow_fp16": float(unscaled) if unscaled is not None else None,
        "grad_underflow_fp16_scaled": float(scaled) if scaled is not None else None,
        "skipped_steps": int(getattr(trainer.precision_plugin, "skipped_steps", 0) or 0),
        # what the plugin's matmuls ran in (an fp8 plugin says fp8 only for real fp8 layers): MFU's peak
        "compute_dtype": str(plugin_compute_dtype(trainer.precision_plugin)),
        **_fp8_layers(trainer.precision_plugin),
    }


def _fp8_layers(plugin: Any) -> dict[str, Any]:
    """For fp8 runs: how many linear layers ran in fp8, of how many; for fp8-auto, the plan it made."""
    decisions = getattr(plugin, "layer_decisions", None)
    if not decisions:
        return {}
    plan = getattr(plugin, "plan", None)
    return {"fp8_layers": sum(d.fp8 for d in decisions), "linear_layers": len(decisions),
            **({"fp8_plan": plan.to_dict()} if plan is not None else {})}


def _child(conn: Any, recipe: str, precision: str, args: argparse.Namespace) -> None:
    """A spawned process: one precision's run, taking turns when the parent says "go"."""
    # Ctrl-C and SIGTERM are the parent's to handle: it stops every run at once and writes what they reached. Ignored,
    # and blocked (from the process's start, ``_start``, and again here): Lightning's SIGTERM handler, installed at
    # every fit, never runs either (it would end this run as an error, or swallow the signal and keep running).
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _quiet_lightning()

    def gate() -> None:
        conn.send(("yield",))
        if conn.recv() != "go":
            raise SystemExit(0)

    def on_block(times: list[float], losses: list[float], peak_mb: float) -> None:
        conn.send(("block", times, losses, peak_mb))

    try:
        with _stop_signals_blocked():
            result = _run_one(recipe, precision, args, gate, on_block)
    except BaseException as err:  # noqa: BLE001  (the parent reports it; nothing must be lost silently)
        if isinstance(err, SystemExit) and err.code == 0:
            return
        conn.send(("error", f"{type(err).__name__}: {_one_line(err)}", traceback.format_exc()))
        return
    conn.send(("done", result))


# ------------------------------------------------------------------------------------------------ the parent process


class _Run:
    """The parent's record of one precision's process: what it has reported so far."""

    def __init__(self, precision: str, process: Any, conn: Any) -> None:
        self.precision, self.process, self.conn = precision, process, conn
        self.times: list[float] = []
        self.losses: list[float] = []
        self.blocks: list[list[float]] = []
        self.peak_mb: Optional[float] = None
        self.result: Optional[dict[str, Any]] = None
        self.error: Optional[str] = None
        self.detail: Optional[str] = None
        self.no_main_guard = False  # it ended as it started: the calling script lacks the __main__ guard

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def take_turn(self, on_step: Callable[[int], None], stop: Stop) -> None:
        """Let the process run until it yields (a block done) or ends (its result, or an error)."""
        try:
            self.conn.send("go")
        except OSError:  # the process died between turns (BrokenPipeError): say how it ended
            self.fail_from_exit()
            return
        self.wait(on_step, stop)

    def wait(self, on_step: Callable[[int], None], stop: Stop) -> None:
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

    def take(self, message: tuple, on_step: Callable[[int], None] = lambda n: None) -> bool:
        """Record one message; True if the process's turn is over (it yielded, or ended)."""
        kind = message[0]
        if kind == "block":
            times, losses, self.peak_mb = message[1], message[2], message[3]
            self.times += times
            self.losses += losses
            self.blocks.append(times)
            on_step(len(times))
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
        if code == NO_MAIN_GUARD_EXIT:  # it ended while importing the calling script (``_spawn``)
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
        (``_stop_all`` ends it then)."""
        self.ask_to_stop()
        deadline = time.monotonic() + 10
        while self.process.is_alive() and time.monotonic() < deadline and stop.signum is None:
            self.process.join(timeout=0.2)
        if self.process.is_alive() and stop.signum is None:
            self.process.kill()
            self.process.join()


def _stop_all(runs: list[_Run], stop: Stop, grace: float = _GRACE_S) -> None:
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


@contextlib.contextmanager
def _stop_signals_blocked() -> Any:
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


def _start(recipe: str, precision: str, args: argparse.Namespace) -> _Run:
    context = multiprocessing.get_context("spawn")  # fork after torch has threads can deadlock; CUDA needs spawn too
    parent, child = context.Pipe()
    process = context.Process(target=_child, args=(child, recipe, precision, args), daemon=True,
                              name=f"compare-{precision}")
    # Born with SIGINT and SIGTERM blocked: a signal sent to the whole process group (Ctrl-C in a terminal, timeout,
    # SLURM) must not end it while it imports, before ``_child`` ignores them. multiprocessing starts its resource
    # tracker at the first start() and then unblocks both signals instead of restoring the mask it found: started
    # first, it leaves the mask alone.
    if hasattr(signal, "pthread_sigmask"):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    with _stop_signals_blocked():
        process.start()
    child.close()
    return _Run(precision, process, parent)


def _advance(progress: Any, task: Any, steps: int) -> None:
    """The progress bar of one precision moved by ``steps``. Where stdout is not a terminal (a pipe, a log file, a batch
    job) rich draws nothing until the end: a line per finished turn says how far each precision is."""
    progress.advance(task, steps)
    if progress.disable:
        state = progress.tasks[task]
        progress.console.print(f"{' '.join(state.description.split())}: {state.completed:.0f}/{state.total:.0f} steps,"
                               f" {datetime.timedelta(seconds=round(state.elapsed or 0))} elapsed", highlight=False,
                               markup=False)


def _run_all(args: argparse.Namespace, precisions: list[str], progress: Any, stop: Stop) -> dict[str, _Run]:
    """Start every precision's process, then take turns until all are done or a signal arrives; every process has
    ended on return, whatever happened."""
    runs: dict[str, _Run] = {}
    tasks = {p: progress.add_task(f"{args.recipe} {p:>10}", total=args.steps) for p in precisions}
    if progress.disable:  # no bars (stdout is not a terminal): say what comes, as a bar at 0 would
        block = _block_size(args.steps)
        progress.console.print(f"{args.recipe}: starting {', '.join(precisions)}, each in its own process; a line per"
                               f" turn of {block} step{'s' if block > 1 else ''} follows", highlight=False, markup=False)
    try:
        for p in precisions:
            if stop.signum is not None:
                raise Interrupted
            runs[p] = _start(args.recipe, p, args)
        for run in runs.values():  # up to its first turn: imports, model, data, Trainer; untimed, side by side
            run.wait(lambda n: None, stop)
            if run.no_main_guard:  # every process would end so: one line, as for any argument the runs refuse
                raise UsageError(run.error)
        turn = 0
        while not all(r.finished for r in runs.values()):
            order = precisions[turn % len(precisions):] + precisions[: turn % len(precisions)]
            for p in order:  # the order rotates: no precision always runs first after a pause
                if not runs[p].finished:
                    runs[p].take_turn(lambda n, p=p: _advance(progress, tasks[p], n), stop)
            turn += 1
    except Interrupted:
        pass
    finally:
        _stop_all(list(runs.values()), stop)
    return runs


# --------------------------------------------------------------------------------------------------------- the rows


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _timed(run: _Run, steps: int) -> tuple[list[list[float]], int]:
    """The run's turns with the untimed steps left out (``_untimed_steps``; emptied turns stay, for pairing), and how
    many steps were left out. A run that reported no step past them (``--steps 1``, an early stop) is timed whole,
    warm-up included (0 left out): the report says so."""
    blocks, seen, skip = [], 0, _untimed_steps(run.precision, steps)
    if len(run.times) <= skip:
        skip = 0
    for block in run.blocks:
        blocks.append(block[max(0, skip - seen):])
        seen += len(block)
    return blocks, skip


def _turn_medians(run: _Run, steps: int) -> list[Optional[float]]:
    """Each turn's median timed step time (None for a turn with no timed step): every timing figure rests on these."""
    return [statistics.median(b) if b else None for b in _timed(run, steps)[0]]


def _make_row(run: _Run, args: argparse.Namespace, machine: dict[str, Any],
              interrupted: Optional[str] = None) -> dict[str, Any]:
    """One precision's figures; ``interrupted``: the signal that stopped the comparison ("Ctrl-C", "SIGTERM"), if one
    did. ms/step is the median over turns of each turn's median step time (samples/s, units/s, MFU and the speedup
    follow from it); spread is the interquartile range of all timed steps over their median (how much steps varied)."""
    row: dict[str, Any] = {"precision": run.precision, "steps_done": len(run.times),
                           "emulated": _emulated(run.precision, machine, _on_gpu(args)), "losses": run.losses,
                           "step_ms": [t * 1e3 for t in run.times]}
    if run.error:
        row["error"] = run.error
        if run.detail:
            row["traceback"] = run.detail
    elif run.result is None:
        row["error"] = (f"interrupted ({interrupted}) after {len(run.times)} of {args.steps} steps" if interrupted
                        else "did not finish")
        if interrupted:
            row["interrupted"] = interrupted
    blocks, left_out = _timed(run, args.steps)
    times = [t for block in blocks for t in block]
    turns = [m for m in _turn_medians(run, args.steps) if m is not None]
    if times:
        q1, median, q3 = _quartiles(times)
        t1, turn_median, t3 = _quartiles(turns)
        row.update(median_step_ms=turn_median * 1e3, turn_ms_q1=t1 * 1e3, turn_ms_q3=t3 * 1e3, turns=len(turns),
                   step_ms_q1=q1 * 1e3, step_ms_q3=q3 * 1e3, samples_per_s=args.batch_size / turn_median,
                   spread=(q3 - q1) / median, noisy=(q3 - q1) / median > NOISY, timed_steps=len(times),
                   untimed_steps=left_out)
    row["peak_memory_mb"] = run.peak_mb
    row["final_loss"] = statistics.mean(run.losses[-5:]) if run.losses else None
    row.update(run.result or {"val_acc": None, "grad_underflow_fp16": None, "grad_underflow_fp16_scaled": None,
                              "skipped_steps": None})
    if "fp8_layers" in row:  # the steps that ran fp8 layers: none if it has none, or fp8-auto measured all along
        measured = _calibration_steps(args.steps) if run.precision == "fp8-auto" else 0
        row["fp8_steps"] = max(0, row["steps_done"] - measured) if row["fp8_layers"] else 0
        if not row["fp8_steps"]:  # every matmul ran in bf16: emulated only where bf16 is
            row["emulated"] = _emulated("bf16-mixed", machine, _on_gpu(args))
    return row


def _schedule(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """How the steps were run and which were timed, as it happened: a run with no more steps than it leaves untimed
    (``--steps 1``, an early stop) is timed whole, warm-up included, and this says so."""
    block = _block_size(args.steps)
    parts = [f"interleaved, {block} step{'s' if block > 1 else ''} per turn"]
    timed = [r for r in rows if "untimed_steps" in r]
    whole = [r for r in timed if not r["untimed_steps"]]
    groups: dict[int, list[str]] = {}
    for r in timed:
        if r["untimed_steps"]:
            groups.setdefault(r["untimed_steps"], []).append(r["precision"])
    for left_out, names in groups.items():
        who = f" for {', '.join(names)}" if len(groups) > 1 or whole else ""
        why = "warm-up" if left_out == _WARMUP else f"{left_out - _WARMUP} measuring steps, then the warm-up"
        parts.append(f"first {left_out} steps untimed{who} ({why})")
    if whole:
        done = max(r["steps_done"] for r in whole)
        who = f" for {', '.join(r['precision'] for r in whole)}" if len(whole) < len(timed) else ""
        first = sorted({_untimed_steps(r["precision"], args.steps) for r in whole})
        parts.append(f"every step timed{who}, warm-up included: {done} step{'s' if done > 1 else ''} reported, too few"
                     f" to leave out the first {' or '.join(map(str, first))}")
    return "; ".join(parts)


def _measure_batch(args: argparse.Namespace) -> dict[str, Any]:
    """What one training batch of the recipe costs and holds, the same for every precision, so measured once before the
    runs: ``model_flops_per_step`` (forward and backward, in fp32 on the CPU; None if it cannot be counted) and
    ``units_per_batch`` with its ``unit`` (tokens or images)."""
    recipe = RECIPES[args.recipe]
    data_args = {"batch_size": args.batch_size, "seed": args.seed}
    if args.data_dir:
        data_args["data_dir"] = args.data_dir
    out: dict[str, Any] = {"model_flops_per_step": None, "unit": recipe.unit, "units_per_batch": None}
    given = f"--recipe {args.recipe} --batch-size {args.batch_size}" + (f" --data-dir {args.data_dir}" if args.data_dir
                                                                         else "")
    try:
        model, (batch,) = recipe.training_batches(1, data_args)
        out["units_per_batch"] = recipe.units(batch)
    except Exception as err:  # every precision's run builds the same data: none of them could start
        raise UsageError(f"{given}: the recipe's first batch cannot be made ({type(err).__name__}: {_one_line(err)}),"
                         " so every precision would fail; check --data-dir or choose other arguments.") from None
    try:
        out["model_flops_per_step"] = model_flops_per_step(model, batch, lambda m, b: m.training_loss(b))
    except Exception as err:
        _check_one_step(model, batch, given)
        # a model flop_counter cannot trace: MFU is then n/a, the comparison still runs
        warnings.warn(f"compare: the model's FLOPs could not be counted ({type(err).__name__}: {err}); MFU is n/a.")
    return out


def _check_one_step(model: Any, batch: Any, given: str) -> None:
    """A ``UsageError`` if one fp32 training step fails here for a reason that is not memory (every precision's run
    would fail the same way: a ResNet's batch norm refuses a batch of 1)."""
    try:
        model.training_loss(batch).backward()
    except Exception as err:
        text = str(err).lower()  # the CPU's allocator ran out: a GPU run might not
        memory = isinstance(err, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))) or \
            "out of memory" in text or "allocate" in text
        if not memory:
            raise UsageError(f"{given}: one training step fails in fp32 before any precision runs"
                             f" ({type(err).__name__}: {_one_line(err)}), so every precision would fail; choose other"
                             " arguments (e.g. a larger --batch-size).") from None


def _add_mfu(rows: list[dict[str, Any]], meta: dict[str, Any], args: argparse.Namespace) -> None:
    """Achieved TFLOP/s (the model's FLOPs per step over the median step time) and MFU against the device's dense
    peak for the run's compute kind (``lightning_precision._mfu``), with the peak's source or why there is none."""
    flops, units = meta.get("model_flops_per_step"), meta.get("units_per_batch")
    for row in rows:
        if "median_step_ms" not in row:
            continue
        if units:  # tokens or images per second: what a recipe's readers compare, beside samples/s
            row["units_per_s"] = units / (row["median_step_ms"] / 1e3)
        if row.get("compute_dtype") is None:  # a run that did not finish does not say
            row.update(peak_source="n/a: the run did not finish")
            continue
        kind = compute_kind(row["compute_dtype"])
        peak = choose_peak(meta["device"], kind, args.peak_overrides)
        row.update(compute_kind=kind, peak_tflops=peak.tflops, peak_source=peak.source)
        if flops:
            achieved, fraction = mfu(flops, row["median_step_ms"] / 1e3, peak.tflops)
            row.update(achieved_tflops=achieved, mfu=fraction)


def _add_speedups(rows: list[dict[str, Any]], runs: dict[str, _Run], steps: int) -> None:
    """Speedup over 32-true: 32-true's ms/step over this one's, so that the speedup, ms/step, samples/s and the
    throughput plot rank the precisions alike. Its bracket is the interquartile range of the paired ratios (32-true's
    turn median over this one's, in the same round: measured back to back, so a machine whose speed drifts affects
    both); it is resolved when at least ``_MIN_PAIRS`` pairs put the whole range on the speedup's side of 1x. A range
    wholly on the other side (``speedup_drift``) means the machine's speed changed during the run."""
    base_row = next((r for r in rows if r["precision"] == "32-true" and "median_step_ms" in r), None)
    if base_row is None:
        return
    base = _turn_medians(runs["32-true"], steps)
    for row in rows:
        if "median_step_ms" not in row:
            continue
        if row is base_row:
            row.update(speedup=1.0, speedup_resolved=None)  # the reference itself
            continue
        speedup = base_row["median_step_ms"] / row["median_step_ms"]
        row.update(speedup=speedup, speedup_resolved=False, speedup_pairs=0)
        ratios = [b / m for b, m in zip(base, _turn_medians(runs[row["precision"]], steps)) if b and m]
        if not ratios:
            continue
        q1, median, q3 = _quartiles(ratios)
        above, below = q1 > 1, q3 < 1
        row.update(speedup_q1=q1, speedup_q3=q3, speedup_paired=median, speedup_pairs=len(ratios),
                   speedup_resolved=len(ratios) >= _MIN_PAIRS and ((above and speedup > 1) or (below and speedup < 1)),
                   speedup_drift=(above and speedup < 1) or (below and speedup > 1))


# -------------------------------------------------------------------------------------------------------- arguments


def _parse(argv: list[str]) -> argparse.Namespace:
    from lightning_precision.fp8 import fp8_gpu_available

    parser = argparse.ArgumentParser(
        prog="lightning-precision compare", description=__doc__.splitlines()[0],
        epilog="Run `lightning-precision doctor` to see what this machine supports natively. Exit codes: 0 all ran, 1"
               " a precision failed or the report could not be written, 2 bad arguments or --out held by another"
               " run, 130 interrupted by Ctrl-C, 143 by SIGTERM, 129 by SIGHUP (the terminal closed; not under"
               " nohup): what finished is written.")
    parser.add_argument("--recipe", default="distilbert", help=f"the recipe: {', '.join(RECIPES)} (default: distilbert)")
    parser.add_argument("--precisions", default=None,
                        help="comma-separated, from 32-true, bf16-mixed, 16-mixed, fp8, fp8-auto (default: chosen"
                             " for this machine: 32-true and bf16-mixed; 16-mixed where fp16 arithmetic is native (any"
                             " CUDA GPU, CPUs with AVX512-FP16/AMX-FP16); fp8 on a GPU of compute capability >= 8.9 or"
                             " with --emulate). fp8-auto: the layers chosen from their measured fp8 numerics"
                             " (FP8Precision(layers='auto'); its measured steps are left out of the timings)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps per precision (default: 100; {_QUICK_STEPS} with --quick)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step (default: 32)")
    parser.add_argument("--val-batches", type=int, default=None,
                        help=f"validation batches for the accuracy, 0 for none (default: 8; {_QUICK_VAL_BATCHES} with"
                             " --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the data and their order (default: 0)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a rough first look: {_QUICK_STEPS} steps, {_QUICK_VAL_BATCHES} validation batches")
    parser.add_argument("--accelerator", default="auto", help="auto, cpu, cuda, ... (default: auto)")
    parser.add_argument("--data-dir", default=None,
                        help="real data for the recipe: aclImdb for distilbert, an ImageFolder for vit and resnet50"
                             " (default: the recipe's embedded generated task)")
    parser.add_argument("--emulate", action="store_true",
                        help="allow fp8 without fp8 hardware (torchao emulation: numerics, not speed)")
    parser.add_argument("--out", default="compare-report", help="output folder (default: ./compare-report)")
    parser.add_argument("--peak-tflops", default=None,
                        help="the device's peak for MFU, instead of the built-in table of GPUs: one number in TFLOP/s"
                             " for every precision, or kind=number pairs (kinds fp32, tf32, bf16, fp16, fp8), e.g."
                             " bf16=989,fp8=1979")
    args = parser.parse_args(argv)
    if args.recipe not in RECIPES:
        raise UsageError(f"unknown recipe {args.recipe!r}: choose one of {', '.join(RECIPES)}")
    args.steps = args.steps if args.steps is not None else (_QUICK_STEPS if args.quick else 100)
    args.val_batches = args.val_batches if args.val_batches is not None else (_QUICK_VAL_BATCHES if args.quick else 8)
    if args.precisions is not None:
        given = args.precisions
        args.precisions = list(dict.fromkeys(p.strip() for p in given.split(",") if p.strip()))
        if not args.precisions:
            raise UsageError(f"--precisions {given!r} names no precision: choose from {', '.join(PRECISIONS)}")
        for p in args.precisions:
            if p not in PRECISIONS:
                raise UsageError(f"unknown precision {p!r}: choose from {', '.join(PRECISIONS)}")
        fp8 = [p for p in args.precisions if p in _FP8_PRECISIONS]
        if fp8 and not (fp8_gpu_available() or args.emulate):
            raise UsageError(f"{fp8[0]} needs a CUDA GPU of compute capability >= 8.9; pass --emulate to run its numerics"
                             " emulated")
    try:
        args.peak_overrides = parse_peak_override(args.peak_tflops) if args.peak_tflops is not None else {}
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.steps < 1 or args.batch_size < 1 or args.val_batches < 0:
        raise UsageError("--steps and --batch-size must be positive, --val-batches not negative")
    if not 0 <= args.seed <= _MAX_SEED:
        raise UsageError(f"--seed {args.seed} is out of range: seeds go from 0 to {_MAX_SEED} (2**32 - 1).")
    if args.accelerator != "auto":
        _check_accelerator(args.accelerator)
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise UsageError(f"data folder {args.data_dir!r} does not exist")
    # --out is checked (it can be written, it holds nothing but a report) when it is claimed, in ``main``: under its lock,
    # so that no check writes into a folder another run holds
    return args


def _check_accelerator(name: str) -> None:
    """A ``UsageError`` if a Trainer refuses ``--accelerator`` here (unknown, or absent from this machine), which every
    precision's run would do."""
    import lightning as L

    _quiet_lightning()  # the Trainer's banner ("GPU available: ...") is for runs, not for a check
    try:
        L.Trainer(accelerator=name, devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    except Exception as err:  # noqa: BLE001  (Lightning raises ValueError, MisconfigurationException, ImportError)
        raise UsageError(f"--accelerator {name!r}: {_one_line(err)}") from None


# ------------------------------------------------------------------------------------------------------------- main


def main(argv: list[str], stop: Optional[Stop] = None) -> int:
    """``lightning-precision compare``: the exit code. ``stop``: the recorder of SIGINT, SIGTERM and SIGHUP that the
    command line installed before importing this module (torch and Lightning take seconds to import); without one, one
    is installed for the call."""
    exit_if_importing_main()  # a process of a comparison importing a script that lacks the __main__ guard: ends here
    with contextlib.ExitStack() as held:
        held.enter_context(_lightning_quieted())
        if stop is None:
            stop = held.enter_context(Stop())
        try:
            with stop.raising():  # nothing is under way yet (--accelerator builds a Trainer): a signal ends it at once
                args = _parse(argv)
        except Interrupted:
            say(stop.nothing_written())
            return stop.exit_code(1)
        # Before any training (an output folder that cannot be written must not cost the whole comparison), and held
        # for the whole run, released on every way out: a second run on this folder is refused meanwhile.
        try:
            folder = held.enter_context(claim_folder(args.out, "--out", FILES))
        except ValueError as err:
            raise UsageError(str(err)) from None
        code = _compare(args, argv, folder, stop)
    return stop.exit_code(code)


def _prepare(args: argparse.Namespace, argv: list[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], Any]:
    """Before any process starts: the machine, the report's meta (with the batch measured once), the precisions that
    cannot run here and why, and the console (its first lines printed)."""
    from lightning_precision.cli.console import console
    from lightning_precision.cli.machine import describe, machine_info

    machine = machine_info()
    notes: list[str] = []
    if args.precisions is None:
        args.precisions, notes = _default_precisions(machine, args)
    spec = RECIPES[args.recipe]
    gpu = _on_gpu(args)
    meta = {"recipe": args.recipe, "task": spec.task if not args.data_dir else args.data_dir, "chance": spec.chance,
            "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed, "val_batches": args.val_batches,
            "quick": args.quick, "device": torch.cuda.get_device_name() if gpu else "cpu",
            "machine_line": describe(machine, "cuda" if gpu else "cpu"), "machine": machine, "notes": notes,
            "interrupted": False, "command": shlex.join(["lightning-precision", "compare", *argv])}
    meta.update(_measure_batch(args))  # first: data that every run would refuse is one line, with nothing before it
    out = console(outlive_reader=True)  # `compare | head` must not end the comparison: the report is written
    out.print(f"[bold]{args.recipe}[/bold] on {meta['machine_line']}", highlight=False)
    for note in notes:
        out.print(f"note: {note}", highlight=False, markup=False)
    doomed = {p: why for p in args.precisions if (why := _precheck(p, args))}
    for p, why in doomed.items():
        out.print(f"{p} cannot run here: {why}", style="red", highlight=False, markup=False)
    return machine, meta, doomed, out


def _compare(args: argparse.Namespace, argv: list[str], folder: Path, stop: Stop) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lightning_precision.cli import report

    try:
        with stop.raising():  # nothing runs yet (measuring the batch takes seconds): a signal ends it at once
            machine, meta, doomed, out = _prepare(args, argv)
    except Interrupted:
        say(stop.nothing_written(args.out))
        return 1
    runnable = [p for p in args.precisions if p not in doomed]
    runs: dict[str, _Run] = {}
    if runnable:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=out, disable=not out.is_terminal) as progress:
            runs = _run_all(args, runnable, progress, stop)
    stopped_by = None
    if stop.signum is not None and (len(runs) < len(runnable) or not all(r.finished for r in runs.values())):
        stopped_by = signal_name(stop.signum)
        meta.update(interrupted=True, signal=signal.Signals(stop.signum).name)
    rows = []
    for p in args.precisions:
        if p in doomed or p not in runs:
            row = {"precision": p, "error": doomed.get(p), "steps_done": 0, "losses": []}
            if p not in doomed:
                row.update(error=f"not started: the comparison was interrupted ({stopped_by}) before it",
                           interrupted=stopped_by)
            rows.append(row)
        else:
            rows.append(_make_row(runs[p], args, machine, stopped_by))
    meta["schedule"] = _schedule(rows, args)
    _add_speedups(rows, runs, args.steps)
    _add_mfu(rows, meta, args)
    meta["verdict"] = report.verdict(rows, meta)
    if meta["interrupted"] and not any(r.get("steps_done") for r in rows):  # a report of nothing replaces no report
        say(stop.nothing_written(args.out))
        return 1
    report.print_table(rows, meta, out)  # first: whatever happens to the files, the results are on the screen
    try:  # whole or not at all, also when interrupted: written beside the folder, then swapped in
        where, names, note = report.write_reports(rows, folder, meta)
    except OSError as err:
        say(f"lightning-precision compare: could not write the report to {args.out!r} ({err}); the folder keeps what"
            " it held.")
        return 1
    if where != folder:
        say(f"lightning-precision compare: could not write the report to {args.out!r}: {note}.")
    elif note:
        say(f"lightning-precision compare: note: {note}.")
    shown = Path(args.out) if where == folder else where  # the folder as the user named it
    out.print("wrote " + ", ".join(str(shown / name) for name in names), highlight=False, markup=False, soft_wrap=True)
    return 1 if where != folder or any("error" in r for r in rows) else 0
