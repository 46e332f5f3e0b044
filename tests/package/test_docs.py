"""Every ```python block of the README and of docs/ runs as a user would paste it.

Each block runs on its own: a fresh namespace (a block defines everything it uses), a fresh temporary working
directory (files it writes land there), under a time bound. A block that needs hardware this machine lacks starts
with a marker comment and is skipped with the reason, where the hardware is missing only:

    # requires: cuda                 a CUDA GPU
    # requires: fp8-gpu              a CUDA GPU with fp8 tensor cores (compute capability >= 8.9)
    # requires: transformer_engine   NVIDIA Transformer Engine (installs only with CUDA) and a CUDA GPU
    # requires: xpu                  an Intel GPU visible to torch.xpu

A block that is deliberately a fragment starts with ``# not run: <reason>`` (use ```text for what is not Python).
"""

from __future__ import annotations

import importlib.util
import re
import signal
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Seconds one block may take on a shared 2-core CPU (the slowest, the README's 3-step fit, takes a few when the
# machine is idle; other jobs on the same cores can make it several times slower).
TIME_LIMIT_S = 60


def _cuda() -> bool:
    return torch.cuda.is_available()


def _fp8_gpu() -> bool:
    return _cuda() and torch.cuda.get_device_capability() >= (8, 9)


def _transformer_engine() -> bool:
    return _cuda() and importlib.util.find_spec("transformer_engine") is not None


def _xpu() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def _torchao_mxfp8() -> bool:
    from lightning_precision.fp8._torchao import mxfp8_linear_module

    try:
        mxfp8_linear_module()
    except ImportError:
        return False
    return True


# marker -> (is it here?, what is missing when it is not)
REQUIRES = {
    "cuda": (_cuda, "needs a CUDA GPU"),
    "fp8-gpu": (_fp8_gpu, "needs a CUDA GPU with fp8 tensor cores (compute capability >= 8.9)"),
    "transformer_engine": (_transformer_engine, "needs NVIDIA Transformer Engine and a CUDA GPU"),
    "xpu": (_xpu, "needs an Intel GPU (torch.xpu)"),
    "torchao-mxfp8": (_torchao_mxfp8, "needs torchao's MXFP8 training layer (torchao.prototype.moe_training, after 0.11)"),
}
REQUIRES_RE = re.compile(r"#\s*requires:\s*(.+)")
NOT_RUN_RE = re.compile(r"#\s*not run:\s*(.+)")
# A fence may be indented (inside a list item); its body is dedented as Markdown renders it.
FENCE_RE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.S | re.M)


def _blocks() -> list:
    params = []
    for path in DOC_FILES:
        text = path.read_text()
        for match in FENCE_RE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            name = f"{path.relative_to(ROOT)}:{line}"
            code = textwrap.dedent(match.group(2))
            params.append(pytest.param(str(path.relative_to(ROOT)), line + 1, code, id=name))
    return params


BLOCKS = _blocks()


def test_blocks_were_found():
    # The README's Trainer and Fabric examples at least: a broken fence pattern would silently test nothing.
    readme = [p for p in BLOCKS if p.id.startswith("README.md:")]
    assert len(readme) >= 3, [p.id for p in readme]


def _first_line(code: str) -> str:
    return code.lstrip().splitlines()[0] if code.strip() else ""


def test_markers_are_known():
    for param in BLOCKS:
        match = REQUIRES_RE.fullmatch(_first_line(param.values[2]).strip())
        if match:
            unknown = {m.strip() for m in match.group(1).split(",")} - REQUIRES.keys()
            assert not unknown, f"{param.id}: unknown `# requires:` marker {unknown}; known: {sorted(REQUIRES)}"


class _TimedOut(BaseException):
    """Not an ``Exception``: code under test that catches ``Exception`` must not swallow the time limit."""


def _on_alarm(signum, frame):
    raise _TimedOut


@pytest.mark.parametrize(("doc", "first_line", "code"), BLOCKS)
def test_doc_block_runs(doc: str, first_line: int, code: str, tmp_path, monkeypatch):
    first = _first_line(code).strip()
    if match := NOT_RUN_RE.fullmatch(first):
        pytest.skip(f"{doc}:{first_line - 1}: not run: {match.group(1)}")
    if match := REQUIRES_RE.fullmatch(first):
        missing = [REQUIRES[m.strip()][1] for m in match.group(1).split(",") if not REQUIRES[m.strip()][0]()]
        if missing:
            pytest.skip(f"{doc}:{first_line - 1}: " + "; ".join(missing))
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(TIME_LIMIT_S)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on workers, loggers, ...: not what is tested here
            # Padded so that a traceback names the line of the Markdown file.
            exec(compile("\n" * (first_line - 1) + code, doc, "exec"), namespace)
    except _TimedOut:
        pytest.fail(f"the block ran past {TIME_LIMIT_S} s: make it cheaper (fewer steps, a smaller model)")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _readme_block(heading: str) -> pytest.param:
    """The python block under a README heading, e.g. "## Trainer"."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"{heading}\n")
    return next(p for p in BLOCKS if p.id.startswith("README.md:") and int(p.id.split(":")[1]) > text.count("\n", 0, start))


SWAPS = {  # each plugin as a user would swap it into the README's examples (fp8 emulated: no fp8 GPU here)
    "BF16MixedPrecision": "BF16MixedPrecision()",
    "FP16MixedPrecision": "FP16MixedPrecision()",
    "FP8Precision": "FP8Precision(emulate=True, skip_small_layers=False)",
}


@pytest.mark.parametrize("heading", ["## Trainer", "## Fabric"])
@pytest.mark.parametrize("plugin", list(SWAPS))
def test_readme_examples_run_with_each_plugin_swapped_in(heading, plugin, tmp_path, monkeypatch):
    """The README's Trainer and Fabric examples, with every plugin in place of the one they show: the same code
    (metrics(), loss_scale, skipped_steps, the checkpoint) must run, whichever plugin a user chose."""
    param = _readme_block(heading)
    doc, first_line, code = param.values
    calls = re.findall(r"\bFP16MixedPrecision\([^)]*\)", code)
    assert calls, "the example no longer constructs FP16MixedPrecision: update this test's swap"
    for call in calls:
        code = code.replace(call, SWAPS[plugin])
    module = "lightning_precision.fabric" if heading == "## Fabric" else "lightning_precision"
    code = f"from {module} import {plugin}\n" + code
    test_doc_block_runs(doc, first_line - 1, code, tmp_path, monkeypatch)


def test_each_readme_block_builds_one_trainer_or_fabric():
    """A block that builds two Trainers leaves whoever pastes it with the last one, whatever its comments say: the
    README's Trainer example once fitted with its second Trainer (fp16) under a line that showed bf16 first."""
    for param in (p for p in BLOCKS if p.id.startswith("README.md:")):
        built = re.findall(r"\b(?:Trainer|Fabric)\(", param.values[2])
        assert len(built) <= 1, f"{param.id} builds {len(built)} Trainers/Fabrics: show one, name the others in a comment"


def test_readme_fabric_example_prints_the_plugins_metrics(tmp_path, monkeypatch, capsys):
    """The Fabric example shows what the plugin reports on the terminal, not only through `log_dict`, which writes
    nothing without a logger."""
    doc, first_line, code = _readme_block("## Fabric").values
    test_doc_block_runs(doc, first_line, code, tmp_path, monkeypatch)
    assert "0 {'precision/loss_scale': 65536.0, 'precision/skipped_steps': 0.0}" in capsys.readouterr().out
