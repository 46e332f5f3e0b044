"""Timing a linear layer's formats on this CUDA GPU, the way the model runs it, and the cache of those timings.

``time_shapes`` times each distinct layer shape (tokens M, in_features K, out_features N, bias) once, forward and
backward, in the high dtype and in each candidate torchao format, compiled when the model is (a one-layer module under
``torch.compile``'s default mode) and eager otherwise: CUDA events, the median after a warm-up. Each timing is kept per
(device, torch, torchao, M, K, N, bias, high dtype, format, compiled) in this process and in one JSON file
(``cache_path``), so a second run times nothing. The file is ours only if it carries ``CACHE_FORMAT`` and every timing
in it is a positive finite number: anything else (corrupt, unreadable, another program's, a symbolic link) is said once
and never overwritten; a folder that cannot be written, or is a file, is said once and the timings stay in memory.
Writes are atomic (a temporary file beside it, then ``os.replace``) and merge what another process wrote meanwhile
(the last writer of a key wins): the read, merge and replace run under an advisory lock (``fcntl.flock`` on
``timings.json.lock`` beside it), so processes that write at once keep each other's timings. Where the lock is busy
for ``LOCK_WAIT_S`` nothing is written (said once; the timings stay in memory). Without ``fcntl`` (Windows) or on a
file system without locks the merge runs unlocked, as before: two processes writing at once may each drop the other's
new timings (they are timed again on a later run).

``cuda_timer`` is the one seam: the timer of this process's CUDA GPU where fp8 runs for real, None elsewhere (CPU,
``emulate=True``). Tests replace it with a timer of their own (no CUDA GPU here)."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import Tensor, nn

from lightning_precision._imports import installed_version
from lightning_precision._io import atomic_write_text
from lightning_precision._warnings import warn
from lightning_precision.fp8._plan_types import DTYPE_OF_HIGH, HIGH, HIGH_LABELS, MeasuredSpeed
from lightning_precision.fp8._selection import TORCHAO_RECIPES, LayerDecision

__all__ = [
    "CACHE_FORMAT",
    "CudaTimer",
    "LOCK_WAIT_S",
    "LayerShape",
    "Timer",
    "TimingCache",
    "benchmark_saving",
    "cache_path",
    "cuda_timer",
    "layer_shape",
    "time_shapes",
    "timer_for",
]

CACHE_FORMAT = "lightning-precision layer timings"  # the marker that makes a cache file ours (and overwritable)
_CACHE_VERSION = 1
LOCK_WAIT_S = 10.0  # the longest a write waits for another process's lock before it gives up (nothing written)


class LayerShape(NamedTuple):
    """A linear layer's GEMM shape in a training step: ``tokens`` input rows (M), ``in_features`` (K),
    ``out_features`` (N), and whether it adds a bias."""

    tokens: int
    in_features: int
    out_features: int
    bias: bool


def layer_shape(model: nn.Module, fqn: str, tokens: float) -> LayerShape:
    """The shape of ``model``'s linear layer ``fqn`` on ``tokens`` rows a step (a mean: rounded, at least 1)."""
    layer = model.get_submodule(fqn)
    assert isinstance(layer, nn.Linear)  # measured layers are the shape rules' nn.Linear
    return LayerShape(max(1, round(tokens)), layer.in_features, layer.out_features, layer.bias is not None)


class Timer(Protocol):
    """What times a layer: ``device`` (the GPU's name) and ``seconds`` of one forward and backward of ``shape`` in
    ``fmt`` (None: the high dtype ``dtype``), compiled or eager."""

    device: str

    def seconds(self, shape: LayerShape, fmt: str | None, dtype: torch.dtype, compiled: bool) -> float: ...


def _median_step(module: nn.Module, x: Tensor, grad: Tensor, steps: int, warmup: int) -> float:
    """Median seconds of ``module``'s forward and backward on ``x`` (CUDA events), after ``warmup`` steps."""
    times = []
    for i in range(max(warmup, 0) + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module(x).backward(grad)
        end.record()
        torch.cuda.synchronize()  # the measurement itself: one wait per timed step
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class CudaTimer:
    """The timer of this process's CUDA GPU: a fresh layer of the shape (random weights, random rows) in the high
    dtype, or converted to a torchao format, run ``steps`` times after ``warmup``."""

    def __init__(self, steps: int = 20, warmup: int = 5) -> None:
        self.device = torch.cuda.get_device_name()
        self.steps, self.warmup = steps, warmup

    def seconds(self, shape: LayerShape, fmt: str | None, dtype: torch.dtype, compiled: bool) -> float:
        from lightning_precision.fp8._torchao import convert_with_torchao, torchao_config

        cuda = torch.device("cuda")
        tokens, k, n, bias = shape
        module: nn.Module = nn.Sequential(nn.Linear(k, n, bias=bias, device=cuda, dtype=dtype))
        if fmt is not None:
            module = convert_with_torchao(module, torchao_config(fmt, emulate=False),
                                          [LayerDecision("0", k, n, True, "timed")])
        if compiled:
            # Each timing compiles a new module: dynamo's per-code recompile limit would fall back to eager after a
            # few shapes, so its caches are cleared after each (the model is recompiled anyway: it converts next).
            module = cast(nn.Module, torch.compile(module))
        x = torch.randn(tokens, k, device=cuda, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, n, device=cuda, dtype=dtype)
        try:
            return _median_step(module, x, grad, self.steps, self.warmup)
        finally:
            if compiled:
                torch.compiler.reset()


def cuda_timer(emulate: bool) -> Timer | None:
    """The seam: this process's CUDA GPU's timer where fp8 runs for real on it; None on a CPU or with ``emulate``."""
    if emulate or not torch.cuda.is_available():
        return None
    return CudaTimer()


def timer_for(backend: str, emulate: bool) -> Timer | None:
    """The timer of a plugin's layers: ``cuda_timer`` (looked up when called: tests replace it) for torchao's real
    fp8; None for Transformer Engine, whose recipes torchao cannot time."""
    return cuda_timer(emulate) if backend == "torchao" else None


def cache_path() -> Path:
    """``$LIGHTNING_PRECISION_CACHE_DIR/timings.json``, else ``$XDG_CACHE_HOME/lightning-precision/timings.json``,
    else ``~/.cache/lightning-precision/timings.json``."""
    folder = os.environ.get("LIGHTNING_PRECISION_CACHE_DIR")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "lightning-precision")
    return Path(folder).expanduser() / "timings.json"


_MEMORY: dict[str, float] = {}  # every timing of this process, by key: what a second plugin or plan reads first
_SAID: set[tuple[str, str]] = set()  # (path, problem) already warned about: once per process


def _say_once(path: Path, problem: str, message: str) -> None:
    if (str(path), problem) not in _SAID:
        _SAID.add((str(path), problem))
        warn(f"lightning-precision's timing cache {str(path)!r}: {message}")


class TimingCache:
    """The timings of this process and of the file at ``path``, by key (``key``)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else cache_path()
        self._disk: dict[str, float] | None = None  # the file's timings, read once

    @staticmethod
    def key(device: str, shape: LayerShape, high: str, fmt: str | None, compiled: bool) -> str:
        torchao = installed_version("torchao") or "none"
        return json.dumps([device, torch.__version__, torchao, *shape, high, fmt or high, compiled])

    def _folder_is_a_file(self) -> bool:
        """Whether the cache's folder is, or is inside, a file: said once (naming LIGHTNING_PRECISION_CACHE_DIR when
        the folder is that), instead of a failed read and a failed write."""
        folder = self.path.parent
        try:
            file = next((p for p in (folder, *folder.parents) if p.exists()), folder)
            if file.is_dir() or not file.exists():
                return False
        except OSError:  # not searchable: the read or the write says why
            return False
        env = os.environ.get("LIGHTNING_PRECISION_CACHE_DIR")
        named = env and Path(env).expanduser() == folder
        what = f"LIGHTNING_PRECISION_CACHE_DIR={env!r}" if named else f"the folder {str(folder)!r}"
        problem = ("points to a file" if named else "is a file") if file == folder else f"is inside a file ({file})"
        _say_once(self.path, "folder", f"{what} {problem}, not a folder; the file is left as it is and the timings stay"
                  " in this process. Set LIGHTNING_PRECISION_CACHE_DIR to a folder.")
        return True

    def _read(self) -> dict[str, float] | None:
        """The file's timings; {} where there is none; None where it is there but not ours (said once)."""
        path = self.path
        if self._folder_is_a_file():
            return None
        if path.is_symlink():
            _say_once(path, "link", "a symbolic link; it is not followed (neither read nor written). The timings stay"
                      " in this process: remove the link, or set LIGHTNING_PRECISION_CACHE_DIR.")
            return None
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as err:
            _say_once(path, "read", f"cannot be read ({err}); it is ignored and left as it is.")
            return None
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        timings = data.get("timings") if isinstance(data, dict) and data.get("format") == CACHE_FORMAT else None
        if not isinstance(timings, dict) or data.get("version") != _CACHE_VERSION or not all(
                _is_timing(v) for v in timings.values()):
            _say_once(path, "foreign", f"not a timing cache this version of lightning-precision wrote (no"
                      f" {CACHE_FORMAT!r} marker of version {_CACHE_VERSION}, or a corrupt file: a timing that is not"
                      " a positive finite number); it is ignored and never overwritten. Remove it to let the timings"
                      " be kept.")
            return None
        return {str(k): float(v) for k, v in timings.items()}

    def get(self, key: str) -> float | None:
        if key in _MEMORY:
            return _MEMORY[key]
        if self._disk is None:
            self._disk = self._read() or {}
        return self._disk.get(key)

    def put(self, timings: Mapping[str, float]) -> None:
        """Keep ``timings`` in this process and add them to the file: merged with what it holds now (another process
        may have written since, under the lock), written whole or not at all. A timing that is not a positive finite
        number is kept in memory only: the file would read as corrupt."""
        _MEMORY.update(timings)
        timings = {k: v for k, v in timings.items() if _is_timing(v)}
        path = self.path
        if not timings or self._folder_is_a_file():
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(path.with_name(path.name + ".lock")) as held:
                if not held:
                    _say_once(path, "lock", f"another process held its lock for {LOCK_WAIT_S:g} s; nothing was"
                              " written, the timings stay in this process.")
                    return
                disk = self._read()
                if disk is None:
                    return  # not ours: said, left alone
                merged = {**disk, **timings}
                # a link made meanwhile is replaced, never followed: no file of the user's is written
                text = json.dumps({"format": CACHE_FORMAT, "version": _CACHE_VERSION, "timings": merged}, indent=0)
                atomic_write_text(path, text, follow_links=False)
            self._disk = merged
        except OSError as err:
            _say_once(path, "write", f"cannot be written ({err.strerror or err}); the timings stay in this process"
                      " only. Set LIGHTNING_PRECISION_CACHE_DIR to a folder that can be written.")


def _is_timing(value: object) -> bool:
    """Seconds a timer can measure: a positive finite number (NaN, inf or <= 0 would decide a layer wrongly)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _acquire(fcntl: Any, fd: int) -> bool | None:
    """Lock ``fd`` exclusively: True; False where another process held it for ``LOCK_WAIT_S``; None where the file
    system has no locks."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:  # another process holds it
            if time.monotonic() >= deadline:
                return False
        except OSError:
            return None
        time.sleep(0.005)


@contextmanager
def _locked(lock: Path) -> Iterator[bool]:
    """Hold an exclusive advisory lock on the file ``lock`` (created empty, never written) while the block runs: True;
    False where another process held it for ``LOCK_WAIT_S``. Where there are no locks (no ``fcntl``: Windows; a file
    system without them) the block runs unlocked: True. The lock goes with the file descriptor, closed here or by the
    operating system when the process ends: never left held."""
    try:
        import fcntl
    except ImportError:  # Windows: the unlocked merge (see the module's docstring)
        yield True
        return
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)  # a link there: an OSError
    try:
        held = _acquire(fcntl, fd)
        yield held is not False
    finally:
        os.close(fd)  # releases the lock


Reduce = Callable[[Tensor], Tensor]  # the mean over the processes (every rank decides on the same numbers)


def time_shapes(shapes: Mapping[str, LayerShape], formats: Iterable[str], high: str, compiled: bool, timer: Timer,
                reduce: Reduce | None = None, cache: TimingCache | None = None) -> MeasuredSpeed:
    """Seconds per training step of each layer (``shapes``: path -> shape) in ``high`` and in each of ``formats``,
    each distinct shape timed once (or read from the cache), then averaged over the processes by ``reduce``."""
    high = high if high != HIGH else "bf16"
    dtype = DTYPE_OF_HIGH[high]
    cache = cache or TimingCache()
    kinds: list[str | None] = [None, *formats]
    distinct = list(dict.fromkeys(shapes.values()))
    found: dict[str, float] = {}
    new: dict[str, float] = {}
    for shape in distinct:
        for fmt in kinds:
            key = cache.key(timer.device, shape, high, fmt, compiled)
            seconds = cache.get(key)
            if seconds is None:
                seconds = new[key] = float(timer.seconds(shape, fmt, dtype, compiled))
            found[key] = seconds
    cache.put(new)
    values = torch.tensor([found[cache.key(timer.device, s, high, f, compiled)] for s in distinct for f in kinds],
                          dtype=torch.float64)
    if reduce is not None:
        values = reduce(values)
    by_shape = {(s, f): float(values[i * len(kinds) + j]) for i, s in enumerate(distinct) for j, f in enumerate(kinds)}
    return MeasuredSpeed(
        timer.device, high, compiled,
        {fqn: by_shape[(s, None)] for fqn, s in shapes.items()},
        {f: {fqn: by_shape[(s, f)] for fqn, s in shapes.items()} for f in kinds if f is not None})


def benchmark_saving(layer: nn.Linear, candidate: str, tokens: int, high: str = "bf16", steps: int = 20,
                     warmup: int = 5) -> float:
    """Seconds per training step the layer's shapes save in ``candidate`` (a torchao format) over ``high`` on this CUDA
    GPU, measured: a fresh linear layer of ``layer``'s shape in the high dtype, and one converted to the format, each
    run forward and backward on ``tokens`` random rows (CUDA events, median of ``steps`` after ``warmup``). Eager,
    without torch.compile: the casts run unfused, so the saving is below a compiled run's. ``layer`` itself is only
    read for its shape. Not cached (``time_shapes`` is)."""
    from lightning_precision.fp8._hardware import check_fp8_hardware

    if not torch.cuda.is_available():
        raise RuntimeError(f"benchmark_saving({candidate!r}): needs a CUDA GPU to time the layer's GEMMs; there is"
                           " none here. Use predicted_saving(...) for the model's prediction.")
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"benchmark_saving(layer={type(layer).__name__}): give the nn.Linear to time.")
    if candidate not in TORCHAO_RECIPES:
        raise ValueError(f"benchmark_saving(candidate={candidate!r}): times torchao formats; choose one of"
                         f" {', '.join(TORCHAO_RECIPES)}.")
    # This GPU's own capability, not the table's entry (a GPU missing from the table predicts as an H100).
    check_fp8_hardware("cuda", "torchao", candidate, emulate=False, owner="benchmark_saving")
    high = "bf16" if high == HIGH else high  # a plan's "high" (dtype unknown) counts as bf16, as the speed model's
    if high not in DTYPE_OF_HIGH:
        raise ValueError(f"benchmark_saving(high={high!r}): one of {', '.join(HIGH_LABELS)}.")
    for arg, value in (("tokens", tokens), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"benchmark_saving({arg}={value!r}): a whole number >= 1.")
    timer = CudaTimer(steps, warmup)
    shape = LayerShape(tokens, layer.in_features, layer.out_features, layer.bias is not None)
    dtype = DTYPE_OF_HIGH[high]
    return timer.seconds(shape, None, dtype, False) - timer.seconds(shape, candidate, dtype, False)
