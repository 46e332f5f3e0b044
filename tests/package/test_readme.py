"""The README's two set-up commands are the ones CI runs, so they stay true: `.ci/run` reads them from the README."""

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ci_in(tmp_path: Path, readme: str) -> Path:
    """A copy of `.ci/run` beside `readme`: whatever it does, it does in `tmp_path`, never in the checkout."""
    (tmp_path / ".ci").mkdir()
    shutil.copy2(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(readme)
    return tmp_path / ".ci" / "run"


def _run(ci: Path, *args: str) -> subprocess.CompletedProcess:
    """`ci` with a `python3` that fails at once: a leg that starts by mistake creates no environment, installs
    nothing and leaves no background install behind."""
    stubs = ci.parent.parent / "stubs"
    stubs.mkdir(exist_ok=True)
    (stubs / "python3").write_text("#!/bin/sh\nexit 97\n")
    (stubs / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(ci), *args], capture_output=True, text=True, timeout=60, env=env)


def test_ci_runs_the_readme_commands_verbatim(tmp_path):
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    assert len(commands) == 2, "the README has exactly two set-up commands: install + main job, tests"
    proc = _run(_ci_in(tmp_path, readme), "--readme-commands")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == commands


def test_ci_refuses_a_readme_command_it_would_half_run(tmp_path):
    """A command that spans lines, or a missing one, stops CI before anything is installed or removed."""
    (tmp_path / ".venv").mkdir()
    two_lines = "## Set up on a fresh machine\n\n```bash\npip install torch==2.13.0\nlightning-precision compare\n```\n"
    proc = _run(_ci_in(tmp_path, two_lines), "lint")
    assert proc.returncode == 1 and "a README command spans lines" in proc.stderr
    one = "## Set up on a fresh machine\n\n```bash\npip install torch==2.13.0\n```\n\n## Next\n\n```bash\nls\n```\n"
    (tmp_path / "README.md").write_text(one)
    proc = _run(tmp_path / ".ci" / "run", "lint")
    assert proc.returncode == 1 and "expected two one-line bash commands" in proc.stderr and "found 1" in proc.stderr
    assert (tmp_path / ".venv").is_dir()


def test_ci_names_its_legs_and_refuses_others(tmp_path):
    (tmp_path / ".venv").mkdir()
    ci = _ci_in(tmp_path, (ROOT / "README.md").read_text())
    proc = _run(ci, "lint", "tests")
    assert proc.returncode == 2 and "no leg 'tests'" in proc.stderr and "usage: .ci/run [lint] [readme]" in proc.stderr
    assert _run(ci, "--help").stdout.startswith("usage: .ci/run")
    assert (tmp_path / ".venv").is_dir()  # nothing was removed
