"""``compare --threads N``: the CPU threads each precision's process may use, on a machine shared with other work.
Bounded in the process before torch does any work there, and counted back, so the report says what ran."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["THREAD_VARIABLES", "bound_threads", "threads_bounded", "usable_cpus"]

# Read by the OpenMP and MKL runtimes as they load, in this process and in any it starts (a DataLoader's workers).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cpus() -> int:
    """The logical CPUs this process may run on: its affinity where the platform says (a container's or ``taskset``'s
    share), else every CPU of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def bound_threads(threads: int) -> None:
    """This process's torch to ``threads`` intra-op and inter-op threads, and the runtimes' variables to match. For a
    precision's own process, at its start: for good, and the variables are that process's own copy."""
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    torch.set_num_threads(threads)
    # Settable once, before any inter-op work: a process fresh from the fork server has done none. Elsewhere (a test's
    # process) the pool keeps its size; inter-op threads run only torch.jit's forks, not a training step's kernels.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(threads)


@contextlib.contextmanager
def threads_bounded(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for a block of the calling process (the parent's one measured step),
    then as they were: the caller's process is the user's. ``None``: as they are."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
