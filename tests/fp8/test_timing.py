"""The timing of layer shapes and its cache (``fp8/_timing.py``). There is no CUDA GPU here: what is mocked is a CUDA
GPU's timings (a fake ``Timer``); the cache, its file and its keys are real. One ``cuda`` test times for real."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import warnings
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest
import torch

from lightning_precision.fp8 import _timing
from lightning_precision.fp8._timing import CACHE_FORMAT, LayerShape, cache_path, time_shapes


class FakeTimer:
    """A CUDA GPU's timings, mocked: fp8 saves where K * N is large, costs on small layers; counts its calls."""

    device = "NVIDIA H200"

    def __init__(self) -> None:
        self.calls: list[tuple[LayerShape, str | None, bool]] = []

    def seconds(self, shape: LayerShape, fmt: str | None, dtype: torch.dtype, compiled: bool) -> float:
        self.calls.append((shape, fmt, compiled))
        size = shape.tokens * shape.in_features * shape.out_features * 1e-12
        return size if fmt is None else size * 0.5 + 2e-5  # fp8: half the GEMM, plus its casts


SHAPES = {"a": LayerShape(64, 256, 256, True), "b": LayerShape(64, 256, 256, True),  # one shape, two layers
          "c": LayerShape(4096, 4096, 4096, False)}


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LIGHTNING_PRECISION_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_timing, "_MEMORY", {})
    monkeypatch.setattr(_timing, "_SAID", set())
    return tmp_path


def test_each_distinct_shape_once_then_the_second_run_reads_the_cache(cache_dir: Path) -> None:
    timer = FakeTimer()
    speed = time_shapes(SHAPES, ("tensorwise",), "bf16", True, timer)
    assert len(timer.calls) == 4  # two distinct shapes, each in bf16 and tensorwise
    assert speed.saving("tensorwise", "a") < 0 < speed.saving("tensorwise", "c")
    assert speed.high_seconds["a"] == speed.high_seconds["b"]
    assert "measured slower on NVIDIA H200" in speed.said("tensorwise", "a")
    data = json.loads((cache_dir / "timings.json").read_text())
    assert data["format"] == CACHE_FORMAT and len(data["timings"]) == 4
    _timing._MEMORY.clear()  # a new process: the file alone
    again = FakeTimer()
    assert time_shapes(SHAPES, ("tensorwise",), "bf16", True, again) == speed
    assert again.calls == []
    time_shapes(SHAPES, ("tensorwise",), "bf16", False, again)  # eager is another key
    assert len(again.calls) == 4


def test_a_key_of_another_torch_version_is_not_reused(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    time_shapes(SHAPES, ("tensorwise",), "bf16", True, FakeTimer())
    _timing._MEMORY.clear()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    timer = FakeTimer()
    time_shapes(SHAPES, ("tensorwise",), "bf16", True, timer)
    assert len(timer.calls) == 4
    assert len(json.loads((cache_dir / "timings.json").read_text())["timings"]) == 8  # merged, both kept


def test_a_corrupt_or_foreign_file_is_said_once_and_never_overwritten(cache_dir: Path) -> None:
    for text in ("{not json", json.dumps({"format": "someone else's", "timings": {}})):
        _timing._SAID.clear()
        _timing._MEMORY.clear()
        path = cache_dir / "timings.json"
        path.write_text(text)
        with pytest.warns(UserWarning, match="never overwritten") as seen:
            time_shapes(SHAPES, ("tensorwise",), "bf16", True, FakeTimer())
            time_shapes({"d": LayerShape(8, 512, 512, True)}, ("tensorwise",), "bf16", True, FakeTimer())
        assert len([w for w in seen if "timing cache" in str(w.message)]) == 1
        assert path.read_text() == text


@pytest.mark.parametrize("value", ["NaN", "-5.0", "1e999", "0.0"])
def test_a_timing_that_is_not_a_positive_finite_number_makes_the_file_corrupt(cache_dir: Path, value: str) -> None:
    """A negative fp8 time would read as faster and convert the layer: the file is not trusted, nor overwritten."""
    key = _timing.TimingCache.key(FakeTimer.device, SHAPES["a"], "bf16", "tensorwise", True)
    path = cache_dir / "timings.json"
    path.write_text(f'{{"format": "{CACHE_FORMAT}", "version": 1, "timings": {{{json.dumps(key)}: {value}}}}}')
    text = path.read_text()
    timer = FakeTimer()
    with pytest.warns(UserWarning, match="not a positive finite number.*never overwritten"):
        speed = time_shapes({"a": SHAPES["a"]}, ("tensorwise",), "bf16", True, timer)
    assert len(timer.calls) == 2 and speed.saving("tensorwise", "a") < 0  # timed, not read
    assert path.read_text() == text


def _put_many(folder: str, name: str, start: Barrier) -> None:
    cache = _timing.TimingCache(Path(folder) / "timings.json")
    start.wait()
    for i in range(50):
        cache.put({f"{name}-{i}": i + 1.0})


@pytest.mark.skipif(sys.platform == "win32", reason="the lock is fcntl.flock (POSIX); Windows merges unlocked")
def test_two_processes_writing_at_once_keep_each_others_timings(cache_dir: Path) -> None:
    """Each put reads, merges and replaces the file under the lock: none of the 100 timings is lost."""
    ctx = multiprocessing.get_context("fork")  # no torch work in the children: fork is safe and starts in ms
    start = ctx.Barrier(2)
    workers = [ctx.Process(target=_put_many, args=(str(cache_dir), name, start)) for name in ("p", "q")]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    for w in workers:
        if w.is_alive():
            w.kill()  # a stuck child fails the test, never hangs it
    assert [w.exitcode for w in workers] == [0, 0]
    timings = json.loads((cache_dir / "timings.json").read_text())["timings"]
    assert len(timings) == 100


def test_a_lock_held_too_long_writes_nothing_and_is_said_once(cache_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fcntl = pytest.importorskip("fcntl", reason="the lock is fcntl.flock (POSIX)")
    monkeypatch.setattr(_timing, "LOCK_WAIT_S", 0.02)
    with open(cache_dir / "timings.json.lock", "w") as other:  # another process's lock (flock: per open file)
        fcntl.flock(other, fcntl.LOCK_EX)
        with pytest.warns(UserWarning, match="held its lock for 0.02 s; nothing was written") as seen:
            time_shapes(SHAPES, ("tensorwise",), "bf16", True, FakeTimer())
            time_shapes({"d": LayerShape(8, 512, 512, True)}, ("tensorwise",), "bf16", True, FakeTimer())
    assert len([w for w in seen if "timing cache" in str(w.message)]) == 1
    assert not (cache_dir / "timings.json").exists()
    timer = FakeTimer()
    time_shapes(SHAPES, ("tensorwise",), "bf16", True, timer)
    assert timer.calls == []  # kept in memory
    time_shapes({"e": LayerShape(8, 64, 64, True)}, ("tensorwise",), "bf16", True, timer)  # the lock is free again
    assert len(json.loads((cache_dir / "timings.json").read_text())["timings"]) == 2


def test_a_cache_dir_that_is_a_file_is_said_once_by_name(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notes = cache_dir / "notes"
    notes.write_text("user data")
    monkeypatch.setenv("LIGHTNING_PRECISION_CACHE_DIR", str(notes))
    with pytest.warns(UserWarning) as seen:
        time_shapes(SHAPES, ("tensorwise",), "bf16", True, FakeTimer())
    said = [str(w.message) for w in seen if "timing cache" in str(w.message)]
    assert len(said) == 1 and f"LIGHTNING_PRECISION_CACHE_DIR={str(notes)!r} points to a file, not a folder" in said[0]
    assert notes.read_text() == "user data"


@pytest.mark.parametrize(("blocker", "said"), [("file/sub", "is inside a file"), ("lock", "cannot be written")])
def test_an_unwritable_folder_keeps_the_timings_in_memory(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          blocker: str, said: str) -> None:
    if blocker == "lock":  # the lock file cannot be opened: nothing written (root writes in any folder, so not chmod)
        (cache_dir / "timings.json.lock").mkdir()
    else:  # a folder under a file: no mkdir
        (cache_dir / "file").write_text("")
        monkeypatch.setenv("LIGHTNING_PRECISION_CACHE_DIR", str(cache_dir / blocker))
    with pytest.warns(UserWarning, match=said) as seen:
        time_shapes(SHAPES, ("tensorwise",), "bf16", True, FakeTimer())
    assert len([w for w in seen if "timing cache" in str(w.message)]) == 1
    timer = FakeTimer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        time_shapes(SHAPES, ("tensorwise",), "bf16", True, timer)
    assert timer.calls == []  # from memory


def test_a_symlinked_cache_file_is_not_followed(cache_dir: Path) -> None:
    mine = cache_dir / "my_notes.json"
    mine.write_text(json.dumps({"format": CACHE_FORMAT, "version": 1, "timings": {}}))
    os.symlink(mine, cache_dir / "timings.json")
    with pytest.warns(UserWarning, match="symbolic link"):
        time_shapes(SHAPES, ("tensorwise",), "bf16", True, FakeTimer())
    assert json.loads(mine.read_text())["timings"] == {}
    assert (cache_dir / "timings.json").is_symlink()


def test_the_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LIGHTNING_PRECISION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path() == tmp_path / "lightning-precision" / "timings.json"
    monkeypatch.setenv("LIGHTNING_PRECISION_CACHE_DIR", str(tmp_path / "c"))
    assert cache_path() == tmp_path / "c" / "timings.json"


def test_ranks_decide_on_the_mean_of_their_timings(cache_dir: Path) -> None:
    """Every rank times on its own GPU; the reduction (the mean over ranks, all-reduced) gives one decision."""
    other_rank = lambda t: (t + t * 3) / 2  # noqa: E731  (a second rank that measured 3x as long)
    speed = time_shapes(SHAPES, ("tensorwise",), "bf16", True, FakeTimer(), reduce=other_rank)
    assert speed.high_seconds["c"] == pytest.approx(2 * 4096**3 * 1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="times fp8 GEMMs on a real CUDA GPU of compute capability >= 8.9")
def test_real_timing_on_a_cuda_gpu(cache_dir: Path) -> None:
    pytest.importorskip("torchao")
    timer = _timing.CudaTimer(steps=5, warmup=2)
    speed = time_shapes({"big": LayerShape(8192, 4096, 4096, False)}, ("tensorwise",), "bf16", False, timer)
    assert speed.high_seconds["big"] > 0 and speed.low_seconds["tensorwise"]["big"] > 0
    assert speed.device == torch.cuda.get_device_name()


def test_benchmark_saving_needs_cuda() -> None:
    from torch import nn

    with pytest.raises(RuntimeError, match=r"benchmark_saving\('tensorwise'\): needs a CUDA GPU.*predicted_saving"):
        _timing.benchmark_saving(nn.Linear(64, 64), "tensorwise", 64)


def test_the_cache_writer_replaces_a_link_made_after_its_check_and_never_writes_through_it(tmp_path: Path) -> None:
    """The cache's write (``_io.atomic_write_text(..., follow_links=False)``): a link that appears at the path after the
    reader refused links (another process, a user) is replaced by the cache file; what it pointed to stays as it was.
    The default (``follow_links=True``) keeps a user's link and writes its target, as the report files do."""
    from lightning_precision._io import atomic_write_text

    mine = tmp_path / "mine.txt"
    mine.write_text("the user's")
    link = tmp_path / "timings.json"
    os.symlink(mine, link)
    atomic_write_text(link, "{}", follow_links=False)
    assert not link.is_symlink() and link.read_text() == "{}" and mine.read_text() == "the user's"
    link.unlink()
    os.symlink(mine, link)
    atomic_write_text(link, "theirs")
    assert link.is_symlink() and mine.read_text() == "theirs"
