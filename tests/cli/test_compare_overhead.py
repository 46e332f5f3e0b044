"""`lightning-precision compare` made cheaper to start, with the same numbers: the FLOPs per step of each recipe's
embedded default, and the rows of a real comparison equal to those of each precision trained in a process spawned as
the comparison used to (importing torch and Lightning itself); each precision still in a process of its own."""

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_precision.cli as cli
from lightning_precision.cli.compare import child, runner
from lightning_precision.cli.compare.args import parse_args
from lightning_precision.cli.compare.main import measure_batch

ROOT = Path(__file__).resolve().parents[2]

# Counted with the code that counted them before the processes were forked from a preloaded server (same recipe, same
# batch shape): an integer each, the same on every machine, but not on every torch: torch's FlopCounterMode, which
# counts them, counts attention more from torch 2.15 (recorded on 2.7, 2.13 and 2.15).
FLOPS_UP_TO_2_13 = {
    ("distilbert", 32): (906_780_672, "tokens", 1536),
    ("vit", 8): (210_794_496, "images", 8),
    ("resnet50", 4): (118_555_648, "images", 4),
}
FLOPS_BY_TORCH = {
    **dict.fromkeys(("2.7", "2.13"), FLOPS_UP_TO_2_13),
    "2.15": {**FLOPS_UP_TO_2_13, ("distilbert", 32): (1_038_901_248, "tokens", 1536),
             ("vit", 8): (271_364_096, "images", 8)},
}

def flops_recorded(recipe: str, batch_size: int) -> tuple[int, str, int]:
    import torch

    torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if torch_minor not in FLOPS_BY_TORCH:
        pytest.skip(f"FLOPs recorded for torch {', '.join(FLOPS_BY_TORCH)}, not {torch_minor}: torch's FlopCounterMode"
                    " counts some ops differently between releases")
    return FLOPS_BY_TORCH[torch_minor][recipe, batch_size]


@pytest.mark.parametrize(("recipe", "batch_size"), list(FLOPS_UP_TO_2_13))
def test_the_flops_per_step_and_the_units_per_batch_are_todays(recipe, batch_size):
    flops, unit, units = flops_recorded(recipe, batch_size)
    measured = measure_batch(parse_args(["--recipe", recipe, "--batch-size", str(batch_size)]))
    assert measured == {"model_flops_per_step": flops, "unit": unit, "units_per_batch": units}


def _train_spawned(conn, recipe, precision, args):
    """The reference: ``child.train`` in a process that imports everything itself, as every run's process did."""
    losses = []
    result = child.train(recipe, precision, args, on_block=lambda times, block, peak: losses.extend(block))
    conn.send((result, losses))


# The figures of a row that do not depend on time or memory: what must not change when the processes start faster.
NUMBERS = ("losses", "val_acc", "val_samples", "grad_underflow_fp16", "grad_underflow_fp16_scaled", "skipped_steps",
           "steps_done", "compute_kind")


@pytest.mark.slow
def test_the_rows_of_the_embedded_default_are_those_of_a_spawned_run(tmp_path):
    """The embedded default (DistilBERT on generated reviews): every number of every row, and the FLOPs, are those of
    the same precision trained in a process spawned the old way."""
    out = tmp_path / "r"
    argv = ["--steps", "4", "--val-batches", "1", "--precisions", "32-true,bf16-mixed"]
    assert cli.main(["compare", *argv, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["model_flops_per_step"] == flops_recorded("distilbert", 32)[0]
    args = parse_args(argv)
    context = multiprocessing.get_context("spawn")
    for row in report["results"]:
        parent, end = context.Pipe()
        process = context.Process(target=_train_spawned, args=(end, "distilbert", row["precision"], args))
        process.start()
        assert parent.poll(300), row["precision"]
        result, losses = parent.recv()
        process.join(timeout=60)
        expected = {**{k: result[k] for k in NUMBERS if k in result}, "losses": losses, "steps_done": 4,
                    "compute_kind": "fp32" if result["compute_dtype"] == "torch.float32" else "bf16"}
        assert {k: row.get(k) for k in NUMBERS} == expected, row["precision"]


# ------------------------------------------------------------------------------------ the processes, forked from a server

PRELOAD_PROBE = """
import sys
import torch

called = []
# torch.cuda's functions (not its classes, not its private helpers such as _is_compiled, which reads how torch was
# built), and the one private function that starts CUDA
names = [n for n in dir(torch.cuda) if callable(getattr(torch.cuda, n)) and n[0].islower()] + ["_lazy_init"]
for name in names:
    def record(*args, _name=name, _real=getattr(torch.cuda, name), **kwargs):
        called.append(_name)
        return _real(*args, **kwargs)
    setattr(torch.cuda, name, record)
from lightning_precision.cli.compare.runner import PRELOAD
for module in PRELOAD:
    __import__(module)
print(sorted(set(called)), flush=True)
"""


@pytest.mark.slow
def test_the_fork_servers_imports_leave_cuda_alone():
    """A process forked from one in which CUDA started cannot use CUDA: what the server imports must not ask torch.cuda
    anything (transformers' import does: torchao asks ``torch.cuda.is_available()``). No GPU here: the calls into
    torch.cuda's functions are recorded instead of watching the driver."""
    done = subprocess.run([sys.executable, "-c", PRELOAD_PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def _precision_processes(monkeypatch):
    """Record each precision's process: its pid and its parent's, read while it runs."""
    seen = []
    real = runner.start

    def start(recipe, precision, args):
        run = real(recipe, precision, args)
        with open(f"/proc/{run.process.pid}/stat") as f:
            seen.append((run.process.pid, int(f.read().rsplit(")", 1)[1].split()[1])))
        return run

    monkeypatch.setattr(runner, "start", start)
    return seen


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the processes' parents from /proc")
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server: spawned")
def test_each_precision_is_a_process_of_its_own_forked_from_the_preloaded_server(tmp_path, monkeypatch):
    """Not the parent, not one another: each precision's process is forked from the one fork server, which has only
    imported (so nothing of one run is in another's process, and its memory and its crash are its own)."""
    seen = _precision_processes(monkeypatch)
    argv = ["compare", "--recipe", "vit", "--steps", "2", "--batch-size", "8", "--val-batches", "0"]
    runner.end_server()  # one another test left running: each comparison here starts its own
    for out in ("a", "b"):  # a second comparison in the same process forks from a server of its own (started anew)
        assert cli.main([*argv, "--precisions", "32-true,bf16-mixed", "--out", str(tmp_path / out)]) == 0
    pids, parents = zip(*seen, strict=True)
    assert len(set(pids)) == 4 and os.getpid() not in pids
    assert parents[0] == parents[1] and parents[2] == parents[3] and parents[0] != parents[2]
    assert not {os.getpid(), *pids} & set(parents)


def _environ_after_run_child(conn, args, environ):
    """A precision's process that fails at once (no such recipe): the environment it started with, and the one it ran
    in."""
    started = dict(os.environ)
    child.run_child(conn, "no-such-recipe", "32-true", args, environ)
    conn.send((started, dict(os.environ)))


@pytest.mark.slow
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server: spawned")
def test_a_precisions_process_runs_in_the_parents_environment_of_now(monkeypatch):
    """The fork server's environment is the parent's when the server started; a script that sets a variable between
    two comparisons (CUDA_VISIBLE_DEVICES) has its runs see it, as spawned processes did."""
    runner.preload()  # the server started before the variable is set (or earlier, by another test)
    monkeypatch.setenv("LIGHTNING_PRECISION_TEST_PROBE", "set after the server started")
    ctx = runner.context()
    parent, end = ctx.Pipe()
    args = argparse.Namespace(seed=0, batch_size=8, data_dir=None, steps=2, emulate=False, accelerator="cpu",
                              val_batches=0)
    process = ctx.Process(target=_environ_after_run_child, args=(end, args, dict(os.environ)), daemon=True)
    process.start()
    assert parent.poll(120)
    assert parent.recv()[0] == "threads"  # what each process says first
    assert parent.recv()[0] == "error"  # the run failed, as asked
    started, ran = parent.recv()
    process.join(timeout=60)
    assert "LIGHTNING_PRECISION_TEST_PROBE" not in started  # forked from the server: its environment
    assert {name: ran.get(name) for name in os.environ} == dict(os.environ)  # and what seed_everything added


def _where_am_i(conn):
    from lightning_precision.cli.compare import preload

    conn.send(preload.in_fork_server())


@pytest.mark.slow
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server: spawned")
def test_the_fork_server_is_recognised_so_that_it_ends_without_tearing_down():
    """The server ends with ``os._exit`` (seconds of torch's and Lightning's teardown saved, during which the output it
    shares with the command stayed open): only there, never in the command (whose output must be flushed)."""
    from lightning_precision.cli.compare import preload

    runner.preload()
    ctx = runner.context()
    parent, end = ctx.Pipe()
    process = ctx.Process(target=_where_am_i, args=(end,), daemon=True)
    process.start()
    assert parent.poll(120) and parent.recv() is True  # forked from the server: its __main__
    process.join(timeout=60)
    assert not preload.in_fork_server()


def _servers_of(pid: int) -> list[int]:
    """The fork servers that process ``pid`` started and that still run (a zombie has ended)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"multiprocessing.forkserver" in command:
            found.append(int(stat.parent.name))
    return found


# Run in a process of its own (no server of another test's): compare refused after its fork server started (the data
# folder holds no data set, found as the batch is measured), then the servers of this process still running.
REFUSED = """
import os, sys
import lightning_precision.cli as cli
from tests.cli.test_compare_overhead import _servers_of
print(cli.main(sys.argv[1:]), _servers_of(os.getpid()))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the processes' parents from /proc")
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server: spawned")
def test_a_refused_comparison_leaves_no_fork_server_running(tmp_path):
    """The server outlived the refusal (still importing torch, then idle until the Python process ended): in a script
    that goes on, a process left behind; on the command line, the output it shares held open (`compare | tee` waited
    for the rest of its imports)."""
    (tmp_path / "empty").mkdir()
    argv = ["compare", "--recipe", "vit", "--steps", "2", "--batch-size", "8", "--data-dir", str(tmp_path / "empty"),
            "--out", str(tmp_path / "r")]
    done = subprocess.run([sys.executable, "-c", REFUSED, *argv], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.splitlines()[-1] == "2 []", done.stdout + done.stderr
    assert "first batch cannot be made" in done.stderr


# Two comparisons in one Python process, the second asked for another thread count; each run records the thread count
# it trains with (``child.train`` wrapped at the top level: each precision's process imports this script as it starts).
THREADS = """
import os, sys
import torch
from lightning_precision.cli.compare import child

real = child.train

def train(*args, **kwargs):
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.environ['OMP_NUM_THREADS']}:{torch.get_num_threads()} ")
    return real(*args, **kwargs)

child.train = train
if __name__ == "__main__":
    import lightning_precision.cli as cli

    for threads in ("1", "2"):
        os.environ["OMP_NUM_THREADS"] = threads
        assert cli.main(sys.argv[2:] + ["--out", "r" + threads]) == 0
"""


@pytest.mark.slow
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server: spawned")
def test_each_comparison_trains_with_the_thread_count_asked_for_then(tmp_path):
    """OpenMP reads OMP_NUM_THREADS once, as torch loads: in the fork server. A second comparison in one process forked
    from the first one's server, and trained with 1 thread where 2 were asked for (its timings silently those of
    another setting); spawned processes had read it anew."""
    script, seen = tmp_path / "threads.py", tmp_path / "seen.txt"
    script.write_text(THREADS)
    argv = ["compare", "--recipe", "vit", "--steps", "2", "--batch-size", "8", "--val-batches", "0", "--precisions",
            "32-true"]
    done = subprocess.run([sys.executable, str(script), str(seen), *argv], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert seen.read_text().split() == ["1:1", "2:2"]
