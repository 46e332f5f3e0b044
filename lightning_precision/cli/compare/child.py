"""What one precision's process does in ``lightning-precision compare``: build the recipe, fit it under the precision
taking turns when the parent says "go", measure it (step times, losses, peak memory, the figures that need the whole
run) and send all of it to the parent through the pipe."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_precision._bytes import training_bytes
from lightning_precision._launches import host_launch_us
from lightning_precision._mfu import plugin_compute_dtype
from lightning_precision._upstream.torch import DispatchCounter
from lightning_precision.cli.compare import user_model
from lightning_precision.cli.compare.args import block_size, compiled, eval_of, make_plugin, one_line, untimed_steps
from lightning_precision.cli.compare.threads import bound_threads
from lightning_precision.cli.console import quiet_lightning
from lightning_precision.cli.recipes import RECIPES
from lightning_precision.cli.stop import STOP_SIGNALS, signals_blocked

__all__ = ["RunStats", "held_bytes", "run_child", "train"]

Gate = Callable[[], None]
OnBlock = Callable[[list[float], list[float], float | None], None]


def _reset_peak_rss() -> bool:
    """Restart the kernel's resident high-water mark (Linux >= 4.0), so the peak is training's, not the imports'."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """Peak resident memory: VmHWM where /proc has it (reset by ``_reset_peak_rss``), else the process's lifetime
    peak."""
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


class RunStats(Callback):
    """Step times and losses of one run; waits for its turn at every block start (``gate``) and hands each
    finished block to ``on_block``. Times exclude the waits. The aten ops of step ``count_step`` (an untimed one:
    counting costs Python time per op) are counted, and on a GPU the host's cost of a kernel launch is timed at the
    start: what tells a launch-bound step (``lightning_precision._launches``)."""

    def __init__(self, block: int, gate: Gate, on_block: OnBlock, count_step: int | None = None) -> None:
        self.block, self.gate, self.on_block, self.count_step = block, gate, on_block, count_step
        self.ops_per_step: int | None = None
        self.launch_us: float | None = None
        self._counter: DispatchCounter | None = None
        self.times: list[float] = []
        self._losses: list[torch.Tensor] = []
        self._t0 = 0.0
        self.sent = 0
        self.cuda = torch.cuda.is_available()
        self.rss_start = 0
        self.val_samples = 0

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if pl_module.device.type == "cuda":
            self.launch_us = host_launch_us(pl_module.device)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            _reset_peak_rss()
            self.rss_start = _rss_bytes()
        except ImportError:  # no /proc and no ``resource`` (Windows): the memory column stays empty
            pass

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if len(self.times) % self.block == 0:
            if self.times:
                self.flush()
            self.gate()
        if self.cuda:
            torch.cuda.synchronize()
        if len(self.times) == self.count_step:
            self._counter = DispatchCounter()
            self._counter.__enter__()
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.ops_per_step, self._counter = len(self._counter.names), None
        # read at the block's end: no device read inside a step. A user's step may return no loss (None skips it)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        # (its NaN where the others are: `flush` stacks them, and a CPU tensor among CUDA ones fails there)
        self._losses.append(loss.detach() if isinstance(loss, torch.Tensor)
                            else torch.full((), float("nan"), device=pl_module.device))

    @override
    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, *args: Any) -> None:
        # The samples the accuracy rests on (fewer than --val-batches x batch size on a small validation set): the
        # verdict's notion of "same accuracy" depends on it. The recipes' batches end with the labels.
        labels = batch[-1] if isinstance(batch, (list, tuple)) and batch else None
        self.val_samples += len(labels) if isinstance(labels, torch.Tensor) and labels.ndim else 0

    def peak_memory_mb(self) -> float | None:
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


def _no_gate() -> None:
    pass


def _no_block(times: list[float], losses: list[float], peak_mb: float | None) -> None:
    pass


def train(recipe: str, precision: str, args: argparse.Namespace, gate: Gate = _no_gate,
          on_block: OnBlock = _no_block) -> dict[str, Any]:
    """Train ``recipe`` under ``precision`` in this process; the figures that need the whole run (validation accuracy,
    underflow, skipped steps), under the report's keys. Step times and losses go to ``on_block`` as they come."""
    import lightning as L

    from lightning_precision.callbacks import GradientUnderflowMonitor

    L.seed_everything(args.seed, verbose=False)
    data_args = {"batch_size": args.batch_size, "seed": args.seed}
    if args.data_dir:
        data_args["data_dir"] = args.data_dir
    user = getattr(args, "user", None)  # the user's own model (--model/--data, --config) instead of the recipe
    size: Literal["embedded", "real"] = "real" if getattr(args, "size", None) == "real" else "embedded"  # as chosen
    model, data = (user_model.build(user) if user is not None
                   else RECIPES[recipe].sized(size).build(data_args=data_args))
    measure_every = max(1, args.steps // 10)
    compile_model = compiled(precision, args)
    # a compiled step runs its own kernels, not aten ops one by one: counting them would say nothing of its launches
    stats = RunStats(block_size(args.steps), gate, on_block,
                     count_step=None if compile_model else _counted_step(precision, args.steps, measure_every))
    monitor = GradientUnderflowMonitor(formats=("fp16",), top_k=0, warn_threshold=1.0,
                                       measure_every_n_steps=measure_every, log_every_n_steps=args.steps)
    plugin = make_plugin(precision, args.emulate, args.steps, eval_of(args))
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.steps, plugins=[plugin] if plugin else None,
        callbacks=[stats, monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=args.val_batches, num_sanity_val_steps=0,
        check_val_every_n_epoch=10**9, log_every_n_steps=args.steps,  # validation once, after the timed steps
    )
    fitted: Any = torch.compile(model) if compile_model else model  # Lightning takes the compiled module as it is
    trainer.fit(fitted, data)  # compiled: validate runs compiled too
    stats.flush()
    metrics = dict(trainer.callback_metrics)
    held = held_bytes(trainer)  # after the steps, which made the optimizer's states
    gate()  # validation takes a turn too: it must not run beside another precision's timed steps
    validate = args.val_batches and (user is None or user_model.validates(model, data))
    val = trainer.validate(model, datamodule=data, verbose=False)[0] if validate else {}
    unscaled, scaled = (metrics.get(f"precision/underflow/fp16{k}") for k in ("", "/scaled"))
    return {
        "val_acc": float(val["val_acc"]) if "val_acc" in val else None,
        # a user's model may log another metric: the report names it where no val_acc comes
        **({"val_metrics": {k: float(v) for k, v in val.items()} if validate else None} if user is not None else {}),
        "val_samples": stats.val_samples,
        # two figures, never one for the other: parameter gradients cast to fp16 as they are (every precision), and at
        # the loss scale in effect (the fp16 run only: what its backward meets)
        "grad_underflow_fp16": float(unscaled) if unscaled is not None else None,
        "grad_underflow_fp16_scaled": float(scaled) if scaled is not None else None,
        "skipped_steps": int(getattr(trainer.precision_plugin, "skipped_steps", 0) or 0),
        "ops_per_step": stats.ops_per_step,  # each a kernel launch on a GPU
        **({"launch_us": stats.launch_us} if stats.launch_us is not None else {}),
        **held,
        # what the plugin's matmuls ran in (an fp8 plugin says fp8 only for real fp8 layers): MFU's peak
        "compute_dtype": str(plugin_compute_dtype(trainer.precision_plugin)),
        **_fp8_layers(trainer.precision_plugin),
    }


def _counted_step(precision: str, steps: int, measure_every: int) -> int | None:
    """The step whose aten ops are counted: the last untimed one (after the warm-up's lazy setup and fp8-auto's
    measured steps) on which the underflow monitor does not measure (it measures step i when (i + 1) % measure_every
    is 0; every step when measure_every is 1); None when every step is timed (a run too short to leave any out)."""
    untimed = untimed_steps(precision, steps)
    if steps <= untimed:
        return None
    ordinary = [i for i in range(untimed - 1, 0, -1) if (i + 1) % measure_every]
    return ordinary[0] if ordinary else untimed - 1


def held_bytes(trainer: Any) -> dict[str, Any]:
    """What training held per parameter after the run, under the report's keys: ``bytes_per_param`` (weights +
    gradients + optimizer states, and what a plugin keeps beside them) and ``training_bytes`` (those bytes apart).
    None for both when no optimizer step landed (every one skipped for inf/nan gradients, as fp16's first steps can be
    while the loss scale settles): the optimizer's states are made by its first step, and a count without them would
    say 4 bytes a parameter where training holds 8 or 16."""
    skipped = int(getattr(trainer.precision_plugin, "skipped_steps", 0) or 0)
    if trainer.global_step - skipped <= 0:
        return {"bytes_per_param": None, "training_bytes": None}
    held = training_bytes(trainer.lightning_module, trainer.optimizers)
    return {"bytes_per_param": held.per_parameter,
            "training_bytes": {"parameters": held.parameters, "weights": held.weights, "gradients": held.gradients,
                               "optimizer_states": held.optimizer_states}}


def _fp8_layers(plugin: Any) -> dict[str, Any]:
    """For fp8 runs: how many linear layers ran in fp8, of how many, where their speed came from (timed on a GPU, or
    predicted); for fp8-auto, the plan it made."""
    decisions = getattr(plugin, "layer_decisions", None)
    if not decisions:
        return {}
    plan = getattr(plugin, "plan", None)
    # a layer timed on a GPU says so first in its reason: "measured faster on <GPU>: ..." (`MeasuredSpeed.said`)
    timed = next(("measured " + d.reason.partition(": ")[0].split(" ", 2)[2] for d in decisions
                  if d.reason.startswith(("measured faster on ", "measured slower on "))), None)
    speed = plan.speed_source if plan is not None and plan.speed_source else timed
    return {"fp8_layers": sum(d.fp8 for d in decisions), "linear_layers": len(decisions),
            **({"fp8_speed": speed} if speed else {}),
            **({"fp8_plan": plan.to_dict()} if plan is not None else {})}


def run_child(conn: Any, recipe: str, precision: str, args: argparse.Namespace,
              environ: dict[str, str] | None = None) -> None:
    """A precision's process's whole life: one precision's run, taking turns when the parent says "go". Messages to the
    parent: ``("threads", n)`` first (torch's threads here), ``("yield",)`` at each turn's end, ``("block", times,
    losses, peak_mb)``, then ``("done", figures)`` or ``("error", line, traceback)``. ``environ``: the parent's
    environment, taken as this process's own before anything reads it (a process forked from the fork server starts
    with the server's)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    if getattr(args, "threads", None) is not None:  # before torch does any work here
        bound_threads(args.threads)
    conn.send(("threads", torch.get_num_threads()))
    # Ctrl-C and SIGTERM are the parent's to handle: it stops every run at once and writes what they reached. Ignored,
    # and blocked (from the process's start, ``runner.start``, and again here): Lightning's SIGTERM handler, installed
    # at every fit, never runs either (it would end this run as an error, or swallow the signal and keep running).
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    quiet_lightning()

    def gate() -> None:
        conn.send(("yield",))
        if conn.recv() != "go":
            raise SystemExit(0)

    def on_block(times: list[float], losses: list[float], peak_mb: float | None) -> None:
        conn.send(("block", times, losses, peak_mb))

    try:
        with signals_blocked():
            result = train(recipe, precision, args, gate, on_block)
    except BaseException as err:  # the parent reports it; nothing must be lost silently
        if isinstance(err, SystemExit) and err.code == 0:
            return
        user = getattr(args, "user", None)  # the class that failed, named with the precision: the row says both
        where = f" (training {user.model.path} on {user.data.path} under {precision})" if user is not None else ""
        conn.send(("error", f"{type(err).__name__}: {one_line(err)}{where}", traceback.format_exc()))
        return
    conn.send(("done", result))
