"""Whether a GPU step is launch-bound: the host issues its kernels more slowly than the GPU runs them.

On a GPU every aten op is at least one kernel launch, a few microseconds of host time, and a step whose kernels are
short waits on the host: its time then measures launches, not arithmetic, and varies with the host's jitter. Counted
(``DispatchCounter``, one untimed step) and timed (``host_launch_us``: the host's cost of one trivial launch here),
the launches put a floor under the step; a step within ``LAUNCH_BOUND`` of that floor is launch-bound.
"""

from __future__ import annotations

import time

import torch

__all__ = ["LAUNCH_BOUND", "host_launch_us", "launch_bound", "launch_floor_ms", "ops_are_cheap"]

# A step whose launches alone take at least this share of it is launch-bound. The floor counts the cheapest launch
# only (a matmul's costs the host more, and Python around each op more still), so at half the step the host is the
# bottleneck already.
LAUNCH_BOUND = 0.5


def host_launch_us(device: torch.device | str, launches: int = 200) -> float:
    """The host's time to launch one trivial kernel on ``device`` (a CUDA device), in microseconds: ``launches`` adds
    to a one-element tensor, timed without waiting for them (a queue of a few hundred never fills)."""
    x = torch.zeros(1, device=device)
    for _ in range(20):  # the first launches load the kernel
        x.add_(1)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize(device)
    return elapsed / launches * 1e6


def launch_floor_ms(ops: int, launch_us: float) -> float:
    """The host time of launching ``ops`` kernels at ``launch_us`` each: less than no step of ``ops`` ops can take."""
    return ops * launch_us / 1e3


def launch_bound(ops: int, launch_us: float, step_ms: float) -> bool:
    """Whether a step of ``ops`` aten ops taking ``step_ms`` is launch-bound (``LAUNCH_BOUND``).

    >>> launch_bound(700, 5.0, 5.0), launch_bound(700, 5.0, 50.0)
    (True, False)
    """
    return launch_floor_ms(ops, launch_us) >= LAUNCH_BOUND * step_ms


def ops_are_cheap(device: torch.device) -> bool:
    """Whether an aten op on ``device`` costs only its arithmetic (on a CPU an op is a function call), not a kernel
    launch (an accelerator). Where ops are cheap, a loop of single-pass reductions beats a fused list op that writes a
    temporary: on a CPU ``torch._foreach_norm(inf)`` writes |x| first, 20x the time of ``torch.aminmax`` per tensor."""
    return device.type == "cpu"
