"""Run code on several ranks (gloo, CPU): one process per rank, started here, bounded in time. The one launcher of the
FSDP2 tests (``run_scenarios``) and of ``benchmarks/fsdp_bytes.py`` (``start_ranks``).

Each rank is an ordinary Python process with the environment a cluster launcher gives (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port), so Lightning uses it as it is instead of re-launching
the script. Every rank gets its own process group: on a timeout or a failed rank, all of them and their children are
killed, and the caller gets each rank's output.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:  # the rank and whatever it started
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def start_ranks(argv: list[str], out_dir: Path, world_size: int = 2, timeout: float = TIMEOUT_S) -> str | None:
    """Run ``python <argv>`` on ``world_size`` ranks, each logging to ``out_dir/rank<r>.log``. Returns None when every
    rank exited 0, else a report of each rank's exit code and log tail (and whether the time ran out)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
               "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        with open(out_dir / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        _kill(procs)
    codes = [p.returncode for p in procs]
    if codes == [0] * world_size:
        return None
    timed_out = " (timed out)" if time.monotonic() > deadline else ""
    return f"a rank failed{timed_out}:\n" + "\n".join(
        f"--- rank {r} (exit {c}) ---\n{(out_dir / f'rank{r}.log').read_text()[-6000:]}" for r, c in enumerate(codes))


def finish() -> None:
    """End a rank once its results are written: all ranks meet, then leave without tearing gloo down. A rank that
    destroys its process group (or lets the interpreter do it at exit) while another still holds a connection
    sometimes aborts in gloo's threads ("terminate called without an active exception"), after its work is done; the
    operating system closes the sockets as cleanly."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_scenarios(scenarios: dict[str, dict[str, Any]], out_dir: Path, world_size: int = 2,
                  timeout: float | None = None, worker: str = "tests.fsdp_worker") -> dict[str, list[dict] | str]:
    """Run ``scenarios`` one after the other in one launch of ``worker`` on ``world_size`` ranks (the
    processes' start and the process group are paid once, not once per scenario). Returns, for each scenario, each
    rank's ``<out_dir>/<name>/rank{r}.json``, or for one that did not finish, why: its ranks' exit codes and log tails
    (the traceback), or the name of the scenario that failed before it in the same launch."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scenarios.json").write_text(json.dumps(scenarios))
    timeout = TIMEOUT_S + 30 * (len(scenarios) - 1) if timeout is None else timeout
    failed = start_ranks(["-m", worker, str(out_dir)], out_dir, world_size, timeout)
    results: dict[str, list[dict] | str] = {}
    first_failure = None
    for name, scenario in scenarios.items():
        files = [out_dir / name / f"rank{r}.json" for r in range(world_size)]
        if first_failure is None and all(f.exists() for f in files):
            results[name] = [json.loads(f.read_text()) for f in files]
        elif first_failure is None:
            first_failure = name
            results[name] = f"scenario {name} {scenario}: {failed}"
        else:
            results[name] = f"scenario {name} did not run: scenario {first_failure} failed before it in the same launch"
    if failed and first_failure is None:  # every scenario finished, then a rank failed: the last one's test says so
        results[name] = f"scenario {name} {scenario} finished, then: {failed}"
    return results


def run_ranks(scenario: dict[str, Any], out_dir: Path, world_size: int = 2, timeout: float = TIMEOUT_S) -> list[dict]:
    """Run one ``scenario`` (``run_scenarios``); return each rank's results, its files in ``out_dir/run``."""
    result = run_scenarios({"run": scenario}, out_dir, world_size, timeout)["run"]
    if isinstance(result, str):
        raise AssertionError(result)
    return result


def fit_spawned(trainer: Any, module: Any, data: Any, out_dir: Path, world_size: int = 2) -> list[dict]:
    """``trainer.fit`` under ``ddp_spawn``, whose ranks write ``out_dir/rank<r>.json`` in ``on_train_end``; returns
    those reports.

    torch's gloo sometimes aborts a process at exit ("terminate called without an active exception", SIGABRT) after
    all its work is done: measured in 3 of 25 runs of a plain-torch FSDP2 script on gloo, torch 2.13, with neither
    Lightning nor this package. Such an abort is tolerated only when every rank has written its report, i.e. finished
    training; any other failure is raised as it is.
    """
    from torch.multiprocessing.spawn import ProcessExitedException

    try:
        trainer.fit(module, data)
    except ProcessExitedException as err:
        written = all((out_dir / f"rank{r}.json").exists() for r in range(world_size))
        if err.signal_name != "SIGABRT" or not written:
            raise
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
