"""Run a test scenario in real processes (gloo, CPU): one process per rank, started here, bounded in time.

Each rank is an ordinary ``python -m tests.fsdp_worker`` process with the environment a cluster launcher gives
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port), so Lightning uses it as
it is instead of re-launching the script. Every rank gets its own process group: on a timeout or a failed rank, all of
them and their children are killed, and the test fails with each rank's output.
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
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_ranks(scenario: dict[str, Any], out_dir: Path, world_size: int = 2, timeout: float = TIMEOUT_S) -> list[dict]:
    """Run ``scenario`` on ``world_size`` ranks; return each rank's ``rank{r}.json`` (written by the worker)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scenario.json").write_text(json.dumps(scenario))
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
               "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1"}
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.fsdp_worker", str(out_dir)], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        _kill(procs)
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if codes != [0] * world_size:
        outputs = "\n".join(f"--- rank {r} (exit {c}) ---\n{(out_dir / f'rank{r}.log').read_text()[-6000:]}"
                            for r, c in enumerate(codes))
        timed_out = " (timed out)" if time.monotonic() > deadline else ""
        raise AssertionError(f"scenario {scenario} failed{timed_out}:\n{outputs}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
