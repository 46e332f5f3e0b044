"""`lightning-precision compare` loses nothing and claims nothing false: the report
folder is replaced whole (a full disk mid-write keeps the previous report, files that are not the report's are never
touched), one run holds a folder at a time, SIGTERM and a second Ctrl-C end the run within seconds with what finished
written and no process left behind, arguments that every run would refuse are refused first, and report.json is
strict JSON."""

import errno
import json
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import lightning_precision.cli as cli
from lightning_precision.cli import stop as lp_stop
from lightning_precision.cli.compare import main as compare
from lightning_precision.cli.compare import outdir as lp_outdir
from lightning_precision.cli.compare import report as lp_report
from lightning_precision.cli.compare import runner
from lightning_precision.cli.compare.rows import Row
from tests.helpers import communicate

pytestmark = pytest.mark.slow  # the command line's own machinery: CI runs it on one torch (pyproject.toml)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--recipe", "vit", "--steps", "6", "--batch-size", "8", "--val-batches", "1"]
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc, sends POSIX signals to process groups")


def _report_of(loss: float, steps: int = 12) -> tuple[list, dict]:
    """The rows and meta of a two-precision report, as ``compare`` makes them, without training."""
    meta = {"recipe": "vit", "task": "gratings", "chance": 0.1, "steps": steps, "batch_size": 8, "seed": 0,
            "val_batches": 1, "quick": False, "device": "cpu", "machine_line": "a CPU",
            "machine": {"packages": {"torch": "2"}}, "notes": [], "schedule": "interleaved", "interrupted": False,
            "verdict": "No precision was measurably faster.", "unit": "images"}
    rows = [Row(p, median_step_ms=10.0, step_ms_q1=9.0, step_ms_q3=11.0, spread=0.2, samples_per_s=800.0,
                final_loss=loss, val_acc=0.5, peak_memory_mb=5.0, grad_underflow_fp16=0.0, skipped_steps=0,
                steps_done=steps, losses=[loss] * steps)
            for p in ("32-true", "bf16-mixed")]
    return rows, meta


def _write(folder: Path, loss: float) -> tuple:
    rows, meta = _report_of(loss)
    return lp_report.write_reports(rows, folder, meta)


def _contents(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _fail_if_trained(monkeypatch):
    monkeypatch.setattr(runner, "start", lambda *a: pytest.fail("refused arguments must cost no training"))


# ------------------------------------------------------------------------------------ the folder, whole


def test_a_full_disk_mid_report_keeps_the_previous_report_whole(tmp_path, monkeypatch):
    """The disk fills while loss.png is written (our plot writer stands in for the disk: it writes a cut-short PNG
    and raises ENOSPC, as savefig does): the folder keeps the previous report byte for byte (not the new JSON and CSV
    beside a truncated plot and the old report.md), and no temporary folder is left."""
    from lightning_precision.cli.compare import plots as lp_plots

    out = tmp_path / "report"
    _write(out, loss=1.0)
    before = _contents(out)
    assert set(before) == set(lp_report.FILES)

    def full_disk(rows, folder, meta):
        (Path(folder) / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(folder) / "loss.png"))

    monkeypatch.setattr(lp_plots, "plot_compare", full_disk)
    rows, meta = _report_of(loss=2.0)
    with pytest.raises(OSError, match="No space left on device"):
        lp_report.write_reports(rows, out, meta)
    assert _contents(out) == before
    assert os.listdir(tmp_path) == ["report"]


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_real_write_failure_mid_report_keeps_the_previous_report_whole(tmp_path):
    """A real condition, nothing patched: a file-size limit (RLIMIT_FSIZE) that the plots exceed but the JSON and CSV
    do not, so the kernel refuses the write (EFBIG) in the middle of the report, as a full disk would."""
    out = tmp_path / "report"
    script = textwrap.dedent(f"""
        import errno, resource, signal, sys
        from pathlib import Path
        from lightning_precision.cli.compare import report as lp_report
        from tests.cli.test_compare_safety import _report_of
        out = Path({str(out)!r})
        rows, meta = _report_of(loss=1.0)
        lp_report.write_reports(rows, out, meta)
        print(max(p.stat().st_size for p in out.glob("*.json")), min(p.stat().st_size for p in out.glob("*.png")))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (12_000, 12_000))
        rows, meta = _report_of(loss=2.0)
        try:
            lp_report.write_reports(rows, out, meta)
        except OSError as err:
            sys.exit(0 if err.errno == errno.EFBIG else 3)
        sys.exit(4)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    json_size, png_size = map(int, done.stdout.split())
    assert json_size < 12_000 < png_size  # the limit falls between them: the failure comes mid-report
    report = json.loads((out / "report.json").read_text())
    assert report["results"][0]["final_loss"] == 1.0 and "final loss 1.000" not in (out / "report.md").read_text()
    assert all(r["losses"] == [1.0] * 12 for r in report["results"])  # the previous report, whole
    assert sorted(os.listdir(out)) == sorted(lp_report.FILES) and os.listdir(tmp_path) == ["report"]


def test_a_folder_holding_files_not_of_the_report_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """The folder is replaced whole, so a folder holding a file of the user's is refused up front, with the file named:
    it is never moved or deleted."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "report.md").write_text("a previous report")
    _fail_if_trained(monkeypatch)
    assert cli.main(["compare", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "notes.txt" in err and "choose a new or empty folder" in err
    assert _contents(out) == {"notes.txt": b"mine", "report.md": b"a previous report"}


def test_compare_called_in_process_leaves_lightnings_loggers_and_warning_filters_as_they_were(tmp_path):
    """``compare.main`` quiets Lightning's loggers (WARNING) and some warnings for its own table. Called from Python (a
    script, a notebook, a test) it left them so for the rest of the process: the caller's next Trainer printed no info
    line, and a later test's ``caplog`` read nothing (what failed CI). ``--accelerator cpu`` builds a Trainer to check
    it, quieted, before the run is refused for the user's file."""
    import logging
    import warnings

    out = tmp_path / "r"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    filters = list(warnings.filters)
    assert cli.main(["compare", *TINY, "--accelerator", "cpu", "--out", str(out)]) == 2
    assert logging.getLogger("lightning.pytorch").level == logging.INFO
    assert warnings.filters == filters


def test_a_file_that_appears_during_the_run_is_left_and_the_report_written_beside(tmp_path):
    out = tmp_path / "r"
    with lp_outdir.claim_folder(out, "--out", lp_report.FILES) as folder:
        _write(folder, loss=1.0)
        (out / "notes.txt").write_text("written during the run")
        where, names, note = _write(folder, loss=2.0)
    assert where != out and where.parent == tmp_path and where.name.startswith("r.new-")
    assert "notes.txt" in note and str(where) in note
    assert sorted(os.listdir(where)) == sorted(lp_report.FILES) == sorted(names)
    assert json.loads((where / "report.json").read_text())["results"][0]["final_loss"] == 2.0
    assert (out / "notes.txt").read_text() == "written during the run"  # the folder as it was, the old report too
    assert json.loads((out / "report.json").read_text())["results"][0]["final_loss"] == 1.0


def test_the_swap_in_two_steps_and_what_a_killed_run_left_behind(tmp_path, monkeypatch):
    """Where the system cannot exchange two folders in one step (not Linux, or a filesystem without
    RENAME_EXCHANGE; our exchange function stands in for such a system), the old folder moves aside, then the new one
    in. A run killed between the two finds the old report moved back at the next start, and the temporary folders of
    a run killed while writing are cleared."""
    monkeypatch.setattr(lp_outdir, "exchange", lambda a, b: False)
    out = tmp_path / "r"
    with lp_outdir.claim_folder(out, "--out", lp_report.FILES) as folder:
        _write(folder, loss=1.0)
        _write(folder, loss=2.0)
    assert os.listdir(tmp_path) == ["r"]
    assert json.loads((out / "report.json").read_text())["results"][0]["final_loss"] == 2.0
    report = _contents(out)
    # killed between the two steps: the report waits in ".r.old-..." and "r" is missing (or empty, as --out's check
    # makes it); killed while writing: an unfinished ".r.new-..."
    os.rename(out, tmp_path / ".r.old-0badf00d")
    out.mkdir()
    (tmp_path / ".r.new-1badf00d").mkdir()
    (tmp_path / ".r.new-1badf00d" / "report.json").write_text("{")
    with lp_outdir.claim_folder(out, "--out", lp_report.FILES):
        assert _contents(out) == report
    assert os.listdir(tmp_path) == ["r"]


def test_a_symbolic_link_to_the_folder_stays_a_link(tmp_path):
    real = tmp_path / "reports" / "today"
    real.mkdir(parents=True)
    link = tmp_path / "latest"
    link.symlink_to(real, target_is_directory=True)
    with lp_outdir.claim_folder(link, "--out", lp_report.FILES) as folder:
        assert folder == real
        _write(folder, loss=1.0)
    assert link.is_symlink() and sorted(os.listdir(link)) == sorted(lp_report.FILES)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_a_private_folder_stays_private(tmp_path):
    out = tmp_path / "r"
    _write(out, loss=1.0)
    out.chmod(0o700)
    with lp_outdir.claim_folder(out, "--out", lp_report.FILES) as folder:
        _write(folder, loss=2.0)
    assert out.stat().st_mode & 0o777 == 0o700
    assert json.loads((out / "report.json").read_text())["results"][0]["final_loss"] == 2.0


@pytest.mark.parametrize("out", [".", "{tmp}"])
def test_the_current_folder_is_not_replaced(out, tmp_path, monkeypatch, capsys):
    """Replacing the folder one works in (or one holding it) would leave the shell in a deleted folder."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    _fail_if_trained(monkeypatch)
    assert cli.main(["compare", *TINY, "--out", out.format(tmp=tmp_path)]) == 2
    assert "holds the current folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- one run per folder


def test_a_folder_another_run_holds_is_refused(tmp_path, capsys, monkeypatch):
    """The lock is the one a running comparison holds (claim_folder, as main takes it); the second run is refused in
    one line that names the folder, the holder and the fix, and the first run's folder is untouched."""
    out = tmp_path / "r"
    _fail_if_trained(monkeypatch)
    with lp_outdir.claim_folder(out, "--out", lp_report.FILES):
        assert cli.main(["compare", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{str(out)!r} is in use by another run (pid {os.getpid()})" in err and "choose another folder" in err
    assert not (tmp_path / ".r.lock").exists()  # released on the way out


def test_a_folder_inside_one_another_run_holds_is_refused(tmp_path, capsys, monkeypatch):
    """A second comparison with `--out` inside the first one's folder took its own lock there, and wrote its folder and
    its lock file into the report folder being replaced whole: the first run then found them there and left its report
    beside the folder, exit 1, and every later run on that folder was refused for them. It is refused, as the folder
    itself is; a folder beside it is not."""
    out = tmp_path / "r"
    _fail_if_trained(monkeypatch)
    with lp_outdir.claim_folder(out, "--out", lp_report.FILES):
        assert cli.main(["compare", *TINY, "--out", str(out / "sub" / "deeper")]) == 2
        assert os.listdir(out) == []  # nothing written into the folder held
        with lp_outdir.claim_folder(tmp_path / "beside", "--out", lp_report.FILES):
            pass
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"is inside {str(out)!r}, which another run (pid {os.getpid()}) is writing" in err


def test_a_killed_runs_lock_does_not_block(tmp_path):
    """flock ends with its process: a run killed with SIGKILL (no cleanup at all) leaves its lock file, which does not
    block the next run."""
    out = tmp_path / "r"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom lightning_precision.cli.compare import outdir as lp_outdir\n"
         f"with lp_outdir.claim_folder({str(out)!r}, '--out', ['report.md']):\n"
         "    print('held', flush=True)\n    time.sleep(600)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"in use by another run \(pid {holder.pid}\)"):
            with lp_outdir.claim_folder(out, "--out", lp_report.FILES):
                pass
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert (tmp_path / ".r.lock").exists()  # left behind by the killed run
    with lp_outdir.claim_folder(out, "--out", lp_report.FILES) as folder:
        assert folder == out


# ---------------------------------------------------------------------- what every run would refuse


@pytest.mark.parametrize(("args", "message"), [
    (["--seed", "-1"], r"--seed -1 is out of range: seeds go from 0 to 4294967295"),
    (["--seed", str(2**32)], r"--seed 4294967296 is out of range"),
    (["--accelerator", "nonsense"], r"--accelerator 'nonsense': .*invalid accelerator name"),
    (["--out", ""], r"--out: an empty path names no folder"),
    (["--recipe", "resnet50", "--batch-size", "1"],
     r"--recipe resnet50 --batch-size 1: one training step fails in fp32 .*Expected more than 1 value per channel"),
    (["--data-dir", "{tmp}/empty"], r"--data-dir .*first batch cannot be made \(FileNotFoundError: No class folders"),
])
def test_arguments_every_run_would_refuse_are_refused_first(args, message, tmp_path, capsys, monkeypatch):
    _fail_if_trained(monkeypatch)
    (tmp_path / "empty").mkdir()  # a folder, but no data set in it
    argv = ["compare", *TINY, "--out", str(tmp_path / "r"), *[a.format(tmp=tmp_path) for a in args]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


# ------------------------------------------------------------------------------------- strict JSON


def test_report_json_is_strict_json_and_says_nan_as_the_csv_does(tmp_path):
    """A diverged run's NaN and infinite figures: report.json parses as strict JSON (no bare NaN or Infinity), where
    they are the strings "nan", "inf" and "-inf", as in report.csv; the plots are still drawn."""
    rows, meta = _report_of(loss=1.0)
    rows[1].update(dict(final_loss=math.nan, grad_underflow_fp16=math.inf, losses=[1.0, math.inf, math.nan, -math.inf],
                        speedup=math.nan))
    meta["model_flops_per_step"] = math.inf
    lp_report.write_reports(rows, tmp_path / "r", meta)
    text = (tmp_path / "r" / "report.json").read_text()

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    report = json.loads(text, parse_constant=refuse)
    bf16 = report["results"][1]
    assert (bf16["final_loss"], bf16["grad_underflow_fp16"], bf16["speedup"]) == ("nan", "inf", "nan")
    assert bf16["losses"] == [1.0, "inf", "nan", "-inf"] and report["meta"]["model_flops_per_step"] == "inf"
    csv_row = (tmp_path / "r" / "report.csv").read_text().splitlines()[2].split(",")
    header = (tmp_path / "r" / "report.csv").read_text().splitlines()[0].split(",")
    assert csv_row[header.index("final_loss")] == "nan" and csv_row[header.index("grad_underflow_fp16")] == "inf"
    assert (tmp_path / "r" / "loss.png").stat().st_size > 5_000


# ------------------------------------------------------------------------------------- signals


def _processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found.append((int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def _children(pid: int) -> list[int]:
    return [p for p, _, parent, _ in _processes() if parent == pid]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except OSError:
        return True


# Run by the tests below in a process of its own: compare as the console script runs it, and a file made once both
# precisions have reported steps (our progress function is wrapped for that; nothing else is changed).
DRIVER = """
import signal, sys
from pathlib import Path
import lightning_precision.cli as cli
from lightning_precision.cli.compare import runner

# As a command started in a terminal: SIGHUP at its default, also where the tests run under nohup (which compare
# honours by running on)
signal.signal(signal.SIGHUP, signal.SIG_DFL)

ready, real = Path(sys.argv[1]), runner.advance

def advance(progress, task, steps):
    real(progress, task, steps)
    # After bf16-mixed's second block (turns go A B, B A, ...), so that the signals come as 32-true's turn begins:
    # one precision running, the other waiting for its turn
    if progress.tasks[1].completed >= 20 and not ready.exists():
        ready.write_text("")

runner.advance = advance
sys.exit(cli.main(sys.argv[2:]))
"""


@linux_only
@pytest.mark.parametrize(("signals", "to_group", "code", "name"), [
    pytest.param([signal.SIGTERM], False, 143, "SIGTERM", id="SIGTERM-to-compare-alone-as-Kubernetes"),
    pytest.param([signal.SIGTERM], True, 143, "SIGTERM", id="SIGTERM-to-the-group-as-timeout-and-SLURM"),
    pytest.param([signal.SIGINT, signal.SIGINT], True, 130, "Ctrl-C", id="Ctrl-C-twice-in-a-terminal"),
])
def test_signals_end_the_run_with_what_finished_written_and_no_process_left(signals, to_group, code, name, tmp_path,
                                                                           capsys, monkeypatch):
    """A real comparison in its own process group, stopped by real signals once every precision has reported a block:
    it exits with 128 + the signal, the report holds every step reported, marked interrupted, and no process of it
    is left. A second Ctrl-C comes while the running precision is mid-block: it is killed at once instead of being
    waited for (before, the parent hung forever: Lightning's handler swallowed the SIGTERM multiprocessing's exit
    sends to a worker). While it runs, a second comparison on its folder is refused."""
    out, ready = tmp_path / "r", tmp_path / "ready"
    argv = ["compare", "--recipe", "vit", "--steps", "100", "--batch-size", "8", "--val-batches", "1",
            "--precisions", "32-true,bf16-mixed", "--out", str(out)]
    log = open(tmp_path / "log.txt", "w")
    run = subprocess.Popen([sys.executable, "-c", DRIVER, str(ready), *argv], cwd=tmp_path, stdout=log,
                           stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()
            time.sleep(0.1)
        workers = _children(run.pid)
        assert len(workers) >= 2  # a process per precision (and multiprocessing's resource tracker)

        _fail_if_trained(monkeypatch)  # the folder is held by the run under way
        assert cli.main(argv) == 2
        assert f"is in use by another run (pid {run.pid})" in capsys.readouterr().err

        for i, signum in enumerate(signals):
            if i:
                time.sleep(0.2)
            os.killpg(run.pid, signum) if to_group else os.kill(run.pid, signum)
        assert run.wait(timeout=120) == code, (tmp_path / "log.txt").read_text()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        log.close()
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in workers if not _gone(pid)] == []

    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["interrupted"] is True and report["meta"]["signal"] == signal.Signals(signals[0]).name
    for row in report["results"]:
        assert row["error"] == f"interrupted ({name}) after {row['steps_done']} of 100 steps"
        assert 10 <= row["steps_done"] < 100 and len(row["losses"]) == row["steps_done"]
    assert "INTERRUPTED" in (tmp_path / "log.txt").read_text() and "wrote " in (tmp_path / "log.txt").read_text()
    assert sorted(os.listdir(out)) == sorted(lp_report.FILES)
    assert sorted(os.listdir(tmp_path)) == ["log.txt", "r", "ready"]  # no lock, no temporary folder


@pytest.mark.parametrize("when", ["measure_batch", "start"])
def test_a_signal_before_any_step_keeps_the_previous_report(when, tmp_path, capsys, monkeypatch):
    """A SIGTERM that comes before any step is reported, while the parent measures the recipe's batch (nothing runs:
    it stops there at once) or as the first precision's process starts (a real one, stopped before its first step);
    our function is wrapped to send it then. A report of nothing does not replace the previous one."""
    out = tmp_path / "r"
    _write(out, loss=1.0)
    before = _contents(out)
    part = compare if when == "measure_batch" else runner
    real = getattr(part, when)

    def then_sigterm(*args):
        done = real(*args)
        os.kill(os.getpid(), signal.SIGTERM)  # compare's handler takes it
        return done

    monkeypatch.setattr(part, when, then_sigterm)
    previous = signal.getsignal(signal.SIGTERM)
    assert cli.main(["compare", *TINY, "--precisions", "32-true", "--out", str(out)]) == 143
    assert f"nothing written, {str(out)!r} keeps what it held" in capsys.readouterr().err
    assert _contents(out) == before and signal.getsignal(signal.SIGTERM) is previous
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("compare-")]


def _stubborn() -> None:
    """A process that answers no message and ignores SIGINT and SIGTERM (as a worker inside Lightning's fit does)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def test_a_process_that_does_not_answer_is_killed_after_the_grace_period():
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_stubborn, daemon=True)
    process.start()
    run = runner.Run("32-true", process, parent)
    runner.stop_all([run], lp_stop.Stop(), grace=1.0)
    assert not process.is_alive() and process.exitcode == -signal.SIGKILL


# ---------------------------------------------------------------- a signal at any moment of a run

# Run by the tests below in a process group of its own: compare as the console script runs it, with real signals sent
# to the whole group (as a terminal's Ctrl-C, timeout and SLURM do) at one moment of the run: while the command imports
# torch and Lightning ("import"), as the first precision's process starts ("start"), or while the report is written
# ("write": the plot function waits for the test's signal, then draws). Nothing else is changed.
DRIVER_AT = """
import importlib.abc, os, signal, sys, time
from pathlib import Path

when, names, ignore, state = sys.argv[1], sys.argv[2], sys.argv[3] == "1", Path(sys.argv[4])
signals = [getattr(signal, name) for name in names.split(",") if name]
if ignore:  # as a shell starts a job with "&": SIGINT ignored from the start
    signal.signal(signal.SIGINT, signal.SIG_IGN)

def send():
    for signum in signals:
        os.killpg(os.getpgid(0), signum)

if when == "import":
    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "lightning_precision.cli.compare.main":
                sys.meta_path.remove(self)
                send()
            return None
    sys.meta_path.insert(0, Finder())

import lightning_precision.cli as cli

if when == "start":
    from lightning_precision.cli.compare import runner
    real_start = runner.start

    def start(*args):
        run = real_start(*args)
        send()
        return run
    runner.start = start
elif when == "write":
    from lightning_precision.cli.compare import plots as lp_plots
    real_plot = lp_plots.plot_compare

    def plot(*args):
        (state / "ready").write_text("")
        deadline = time.monotonic() + 300
        while not (state / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return real_plot(*args)
    lp_plots.plot_compare = plot
sys.exit(cli.main(sys.argv[5:]))
"""


def _group_left(pgid: int) -> list[int]:
    """The processes of a process group still running (zombies have ended)."""
    return [p for p, state, _, group in _processes() if group == pgid and state != "Z"]


def _run_at(tmp_path: Path, when: str, signals: str, argv: list, ignore: bool = False):
    """Start DRIVER_AT in a new process group; returns the process and the paths of its stdout and stderr."""
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    out, err = open(tmp_path / "stdout.txt", "w"), open(tmp_path / "stderr.txt", "w")
    run = subprocess.Popen([sys.executable, "-c", DRIVER_AT, when, signals, "1" if ignore else "0", str(state),
                            "compare", *argv], cwd=tmp_path, stdout=out, stderr=err,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    out.close(), err.close()
    return run, tmp_path / "stdout.txt", tmp_path / "stderr.txt"


def _finish(run, timeout: float = 300) -> int:
    try:
        return run.wait(timeout=timeout)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        deadline = time.monotonic() + 30
        while _group_left(run.pid) and time.monotonic() < deadline:
            time.sleep(0.1)


@linux_only
@pytest.mark.parametrize(("signals", "ignore", "code", "name"), [
    pytest.param("SIGINT", True, 130, "Ctrl-C", id="Ctrl-C-where-SIGINT-was-ignored-at-start-as-in-a-job-started-with-&"),
    pytest.param("SIGINT", False, 130, "Ctrl-C", id="Ctrl-C-in-a-terminal"),
    pytest.param("SIGTERM", False, 143, "SIGTERM", id="SIGTERM"),
])
def test_a_signal_while_the_command_imports_ends_it_in_one_line(signals, ignore, code, name, tmp_path):
    """A Ctrl-C 4-5 s after `compare` starts came while it imported torch and Lightning, before
    any handler of compare's: where SIGINT was ignored at start (a job started with `&`) it vanished and the whole
    comparison ran (exit 0, "interrupted": false); in a terminal it printed a 20-100 line traceback. Now the command
    takes SIGINT and SIGTERM before those imports: one line, 128 + the signal, nothing written, no folder made."""
    out = tmp_path / "r"
    run, stdout, stderr = _run_at(tmp_path, "import", signals, [*TINY, "--precisions", "32-true", "--out", str(out)],
                                  ignore=ignore)
    assert _finish(run) == code, stdout.read_text() + stderr.read_text()
    assert stderr.read_text() == f"lightning-precision compare: interrupted ({name}) before any precision reported a" \
                                 " step: nothing written.\n"
    assert stdout.read_text() == "" and not out.exists() and _group_left(run.pid) == []


@linux_only
def test_ctrl_c_while_the_workers_start_prints_one_line_and_no_traceback(tmp_path):
    """A Ctrl-C to the whole process group as the precisions' processes start (they import torch):
    the workers, born with SIGINT and SIGTERM blocked, print no traceback (there were ~80 interleaved lines); the
    comparison stops, says in one line that nothing was written (no table of empty rows), keeps the previous report,
    and leaves no process behind."""
    out = tmp_path / "r"
    _write(out, loss=1.0)
    before = _contents(out)
    run, stdout, stderr = _run_at(tmp_path, "start", "SIGINT", [*TINY, "--precisions", "32-true,bf16-mixed",
                                                                "--out", str(out)])
    assert _finish(run) == 130, stdout.read_text() + stderr.read_text()
    printed = stdout.read_text() + stderr.read_text()
    assert "Traceback" not in printed and "Error" not in printed and "speedup" not in printed, printed
    assert stderr.read_text() == f"lightning-precision compare: interrupted (Ctrl-C) before any precision reported a" \
                                 f" step: nothing written, {str(out)!r} keeps what it held.\n"
    assert _contents(out) == before and _group_left(run.pid) == []
    assert sorted(os.listdir(tmp_path)) == ["r", "state", "stderr.txt", "stdout.txt"]  # no lock, no temporary folder


@linux_only
@pytest.mark.parametrize(("signals", "code"), [
    pytest.param("SIGINT", 130, id="Ctrl-C"),
    pytest.param("SIGTERM,SIGINT", 143, id="SIGTERM-then-Ctrl-C"),
])
def test_a_signal_while_the_report_is_written_leaves_the_new_report_whole(signals, code, tmp_path):
    """A Ctrl-C while the report was written left no report.md. Real signals to the process group
    while the report is being written (the plot function waits for them): every precision had finished, so the new
    report is written whole, and says it is complete ("interrupted": false); the exit code says a signal came. The
    folder held a previous report: it is replaced whole, nothing of it is left, no temporary folder either."""
    out = tmp_path / "r"
    _write(out, loss=1.0)
    run, stdout, stderr = _run_at(tmp_path, "write", "", [*TINY, "--precisions", "32-true,bf16-mixed",
                                                          "--out", str(out)])
    state = tmp_path / "state"
    try:
        deadline = time.monotonic() + 300
        while not (state / "ready").exists():
            assert run.poll() is None and time.monotonic() < deadline, stdout.read_text() + stderr.read_text()
            time.sleep(0.1)
        for i, name in enumerate(signals.split(",")):
            time.sleep(0.2 if i else 0)
            os.killpg(run.pid, getattr(signal, name))
        time.sleep(0.5)  # the signals are in before the writing goes on
        (state / "go").write_text("")
    finally:
        code_seen = _finish(run)
    assert code_seen == code, stdout.read_text() + stderr.read_text()
    assert sorted(os.listdir(out)) == sorted(lp_report.FILES)
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["interrupted"] is False and all(r["steps_done"] == 6 for r in report["results"])
    assert all("error" not in r for r in report["results"]) and report["results"][0]["final_loss"] != 1.0
    md = (out / "report.md").read_text()
    assert report["meta"]["verdict"] in md and "![loss](loss.png)" in md
    assert "Traceback" not in stdout.read_text() + stderr.read_text()
    assert sorted(os.listdir(tmp_path)) == ["r", "state", "stderr.txt", "stdout.txt"]


# --------------------------------------------------- a terminal that closes, stderr that is gone

# The terminal of a session: compare's stdout and stderr are the slave side of a pseudo-terminal. Closing the master
# side is what sshd does when the connection drops (and a terminal emulator when its window closes): writes to the slave
# then fail with EIO; the shell, told by the kernel, sends SIGHUP to every job, the comparison's whole process group.
@linux_only
def test_a_terminal_that_closes_stops_the_run_with_what_finished_written(tmp_path):
    """An ssh connection that drops mid-comparison: SIGHUP's default ended compare and every precision's process at
    once, with no report and nothing said (every finished step lost). Now SIGHUP stops it as SIGTERM does: the report
    holds every step reported, marked interrupted by SIGHUP, the exit code is 129, no process or lock is left; the
    table printed to a terminal that is gone (EIO) does not end it before the files are written."""
    import pty
    import threading

    out, ready = tmp_path / "r", tmp_path / "ready"
    argv = ["compare", "--recipe", "vit", "--steps", "100", "--batch-size", "8", "--val-batches", "1",
            "--precisions", "32-true,bf16-mixed", "--out", str(out)]
    master, slave = pty.openpty()
    run = subprocess.Popen([sys.executable, "-c", DRIVER, str(ready), *argv], cwd=tmp_path, stdin=subprocess.DEVNULL,
                           stdout=slave, stderr=slave, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           start_new_session=True)
    os.close(slave)
    shown = bytearray()

    def read() -> None:  # the terminal shows what comes (a full pty buffer would block the run)
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            shown.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert run.poll() is None and time.monotonic() < deadline, shown.decode(errors="replace")
            time.sleep(0.1)
        workers = _children(run.pid)
        os.close(master)  # the connection drops: the terminal hangs up
        master = -1
        os.killpg(run.pid, signal.SIGHUP)  # the shell passes the hangup to the job
        assert run.wait(timeout=120) == 129, shown.decode(errors="replace")
    finally:
        if master >= 0:
            os.close(master)
        code = _finish(run)
    assert code == 129
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in workers if not _gone(pid)] == []
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["interrupted"] is True and report["meta"]["signal"] == "SIGHUP"
    for row in report["results"]:
        assert row["error"] == f"interrupted (SIGHUP) after {row['steps_done']} of 100 steps"
        assert 10 <= row["steps_done"] < 100 and len(row["losses"]) == row["steps_done"]
    assert sorted(os.listdir(out)) == sorted(lp_report.FILES)
    assert sorted(os.listdir(tmp_path)) == ["r", "ready"]  # no lock, no temporary folder


def test_nohup_keeps_sighup_ignored():
    """Started under `nohup` (SIGHUP ignored), the comparison is asked to outlive the terminal: it stays ignored while
    compare runs, and SIGINT and SIGTERM are taken as always."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with lp_stop.Stop() as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stop._on_signal
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize(("argv", "stderr"), [
    (["compare", "--recipe", "nope"], "closed-pipe"),
    (["compare", "--recipe", "nope"], "closed"),
    (["plan", "--recipe", "vit", "--out", "plan.txt"], "closed-pipe"),
    (["fit", "--config", "nope"], "closed-pipe"),
    (["nope"], "closed-pipe"),
])
def test_a_refusal_with_stderr_gone_still_exits_2(argv, stderr, tmp_path):
    """`compare ... 2>&1 | head -1` (stderr a pipe whose reader has gone): the one-line refusal raised BrokenPipeError
    (a traceback nobody sees, exit 1). Now it goes nowhere, quietly: the exit code is still the refusal's, 2, and
    stdout stays clean. The same for every command's one-line errors, and with stderr closed (`2>&-`)."""
    command = [sys.executable, "-m", "lightning_precision.cli", *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if stderr == "closed":
        run = subprocess.Popen(["sh", "-c", 'exec "$@" 2>&-', "sh", *command], cwd=tmp_path, stdout=subprocess.PIPE,
                               env=env)
    else:
        run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        run.stderr.close()  # the reader goes away before the command says anything
    printed, _ = communicate(run)
    assert run.returncode == 2 and printed == b"", printed
    assert os.listdir(tmp_path) == []


# -------------------------------------------- what every run would refuse, through the real command

# The command as the console script runs it, with a tripwire on the start of a precision's process (nothing else
# changed): a refused argument must cost no run.
TRIPWIRE = """
import sys
import lightning_precision.cli as cli
from lightning_precision.cli.compare import runner

def start(*args):
    print("a precision's process was started", file=sys.stderr)
    sys.exit(99)

runner.start = start
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [
    pytest.param(["--accelerator", "cuda"], id="accelerator-cuda-without-a-GPU",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU is present")),
    pytest.param(["--data-dir", "{tmp}/not-imdb"], id="data-dir-that-is-not-the-dataset"),
])
def test_arguments_every_run_would_refuse_are_one_line_and_exit_2_through_the_command(argv, tmp_path):
    """`compare --accelerator cuda` on a machine without a GPU, and
    `compare --data-dir` naming a folder that holds something other than the dataset (the default recipe, DistilBERT,
    reads aclImdb). Each started every run and ended with failed rows, exit 1 and a matplotlib warning; now: one line
    on stderr and nothing else (nothing on stdout before it), exit 2, no precision started, no report folder made."""
    (tmp_path / "not-imdb" / "photos").mkdir(parents=True)
    (tmp_path / "not-imdb" / "notes.txt").write_text("not a data set")
    done = subprocess.run([sys.executable, "-c", TRIPWIRE, "compare", *[a.format(tmp=tmp_path) for a in argv]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stdout + done.stderr
    line = done.stderr.strip()
    assert line.startswith("lightning-precision compare: error: ") and "warning" not in line.lower()
    if argv[0] == "--accelerator":
        assert "--accelerator 'cuda': `CUDAAccelerator` can not run on your system" in line
    else:
        assert "--data-dir" in line and "first batch cannot be made" in line and "aclImdb" in line
    assert sorted(os.listdir(tmp_path)) == ["not-imdb"]  # no compare-report folder, no lock


def test_a_report_where_no_precision_reported_a_step_draws_without_warnings(tmp_path):
    """Such a report (every precision failed as it started, e.g. a data set every run refused)
    printed matplotlib's "No artists with labels found to put in legend" under the table. The plots say in words that
    there is nothing to draw, and nothing warns."""
    import warnings

    rows, meta = _report_of(loss=1.0)
    rows = [Row(r.precision, error="its process ended before finishing: exit code 1") for r in rows]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lp_report.write_reports(rows, tmp_path / "r", meta)
    assert [str(w.message) for w in caught] == []
    assert sorted(os.listdir(tmp_path / "r")) == sorted(lp_report.FILES)


def test_a_claim_that_writes_nothing_leaves_no_folder_it_made(tmp_path):
    """A refused or interrupted run made `--out` (and its missing parents) to check it can be written: with nothing
    written, they are removed again; a folder that held a report, or that existed before, stays."""
    out = tmp_path / "a" / "b" / "r"
    with pytest.raises(RuntimeError):
        with lp_outdir.claim_folder(out, "--out", lp_report.FILES) as folder:
            assert folder.is_dir()
            raise RuntimeError("refused after the claim")
    assert os.listdir(tmp_path) == []
    with lp_outdir.claim_folder(out, "--out", lp_report.FILES) as folder:
        _write(folder, loss=1.0)
    assert sorted(os.listdir(out)) == sorted(lp_report.FILES)
    (tmp_path / "empty").mkdir()
    with lp_outdir.claim_folder(tmp_path / "empty", "--out", lp_report.FILES):
        pass
    assert sorted(os.listdir(tmp_path)) == ["a", "empty"]


def _when_opening(monkeypatch, name: str, then) -> None:
    """Run ``then()`` once, just before ``claim_folder`` opens the lock file ``name``: another run's step, at the one
    moment a race needs (a window of microseconds that two real processes rarely hit; the claims are real)."""
    real_open, done = os.open, []

    def open_(path, *args, **kwargs):
        if Path(path).name == name and not done:
            done.append(True)
            then()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(lp_outdir.os, "open", open_)


def test_a_run_leaving_the_parents_it_made_does_not_refuse_a_run_beside_it(tmp_path, monkeypatch):
    """Two runs on new folders `a/b/c` and `a/b/d`. The first, leaving with nothing written,
    removes the parents it made (`a/b`, `a`); if that came between the second's making them and its opening its lock
    file beside `d`, the second was refused ("cannot create the lock file ... No such file or directory") though
    nothing held its folder. Now the parents are made again and the second run goes on; leaving with nothing written,
    it too leaves nothing behind."""
    first = lp_outdir.claim_folder(tmp_path / "a" / "b" / "c", "--out", lp_report.FILES)
    first.__enter__()
    _when_opening(monkeypatch, ".d.lock", lambda: first.__exit__(None, None, None))
    with lp_outdir.claim_folder(tmp_path / "a" / "b" / "d", "--out", lp_report.FILES) as folder:
        assert folder.is_dir() and not (tmp_path / "a" / "b" / "c").exists()
        _write(folder, loss=1.0)
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["d"]
    with lp_outdir.claim_folder(tmp_path / "a" / "b" / "e", "--out", lp_report.FILES):
        pass
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["d"]


def test_a_run_refused_for_a_held_folder_removes_nothing_the_other_run_made(tmp_path, monkeypatch):
    """Two runs on the same new folder `a/b/c`: the second counted `a`, `b` and `c` as its own to remove (none existed
    as it began); the first claimed them meanwhile. The second is refused, and removes nothing: the first run's folder
    and lock stay, and its report is written."""
    out = tmp_path / "a" / "b" / "c"
    first = lp_outdir.claim_folder(out, "--out", lp_report.FILES)
    _when_opening(monkeypatch, ".c.lock", first.__enter__)
    with pytest.raises(ValueError, match=r"is in use by another run \(pid \d+\)"):
        with lp_outdir.claim_folder(out, "--out", lp_report.FILES):
            pass
    assert out.is_dir() and (tmp_path / "a" / "b" / ".c.lock").exists()
    _write(out, loss=1.0)
    first.__exit__(None, None, None)
    assert sorted(os.listdir(out)) == sorted(lp_report.FILES) and os.listdir(tmp_path / "a" / "b") == ["c"]


# Run by the test below in a process group of its own: a fork server whose imports take until the test releases them
# (a module of the test's added to what it imports); a file made as the first precision's process starts.
SLOW_SERVER = """
import sys
from pathlib import Path
import lightning_precision.cli as cli
from lightning_precision.cli.compare import runner

runner.PRELOAD = (*runner.PRELOAD, "slow_import")
starting, real_start = Path(sys.argv[1]), runner.start

def start(*args):
    starting.write_text("")
    return real_start(*args)

runner.start = start
sys.exit(cli.main(sys.argv[2:]))
"""


@linux_only
def test_ctrl_c_while_the_fork_server_still_imports_ends_the_command_at_once(tmp_path):
    """The first precision's process starts once the fork server has finished importing torch and Lightning (seconds,
    more on a network file system): a Ctrl-C then, even a second one, waited for those imports, signals blocked. Here
    the server's imports last until the test releases them (at most 300 s): the command ends on the Ctrl-C, with its
    one line, and leaves no process, the server included."""
    out, release = tmp_path / "r", tmp_path / "release"
    (tmp_path / "slow_import.py").write_text(
        "import os, time\n"
        f"deadline = time.monotonic() + 300\n"
        f"while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.1)\n")
    log = open(tmp_path / "log.txt", "w")
    starting = tmp_path / "starting"
    run = subprocess.Popen([sys.executable, "-c", SLOW_SERVER, str(starting), "compare", *TINY, "--precisions",
                            "32-true", "--out", str(out)], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not starting.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # well into the wait for the server
        os.killpg(run.pid, signal.SIGINT)  # as a terminal sends Ctrl-C
        code = _finish(run, timeout=60)  # the server's imports last 300 s unless released
    finally:
        release.write_text("")
        log.close()
    printed = (tmp_path / "log.txt").read_text()
    assert code == 130, printed
    assert printed.endswith("lightning-precision compare: interrupted (Ctrl-C) before any precision reported a step:"
                            f" nothing written, {str(out)!r} keeps what it held.\n"), printed
    assert "Traceback" not in printed and _group_left(run.pid) == [] and not out.exists()
