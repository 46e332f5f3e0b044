"""MFUMonitor: real CPU fits. Where a figure must be exact, the callback's clock is a fake one that a callback listed
before it advances by a fixed time per batch (no assertion here depends on how fast this machine is)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import TensorDataset

import lightning_precision.callbacks.mfu as mfu_module
from lightning_precision import BF16MixedPrecision
from lightning_precision._mfu import choose_peak, mfu, model_flops_per_step, peak_device_name, plugin_compute_dtype
from lightning_precision._warnings import NoEffectWarning
from lightning_precision.callbacks import MFUMonitor
from tests.helpers import IN, OUT, LitNet, loader, make_data, trainer

FLOPS = 5_000_000  # per micro-batch, as a user would pass it


class Clock(Callback):
    """The monitor's ``perf_counter``: ``per_batch`` seconds pass in each training batch, ``per_val_batch`` in each
    validation batch. Listed before the monitor, so a batch's time has passed when the monitor reads the clock."""

    def __init__(self, per_batch: float = 0.5, per_val_batch: float = 0.0) -> None:
        self.now, self.per_batch, self.per_val_batch = 1000.0, per_batch, per_val_batch

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.now += self.per_batch

    def on_validation_batch_end(self, *args, **kwargs) -> None:
        self.now += self.per_val_batch


def fake_clock(monkeypatch, **kwargs) -> Clock:
    clock = Clock(**kwargs)
    monkeypatch.setattr(mfu_module, "perf_counter", clock)
    return clock


def csv_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def values(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    """The logged values of ``key`` by step."""
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def test_mfu_is_achieved_over_peak_logged_per_window_after_the_warmup(tmp_path, monkeypatch):
    syncs = []
    monkeypatch.setattr(mfu_module, "_synchronize", lambda device: syncs.append(device))
    monitor = MFUMonitor(flops_per_batch=FLOPS, peak_tflops=2.0)
    logger = CSVLogger(tmp_path)
    trainer(max_steps=6, log_every_n_steps=2, callbacks=[monitor], logger=logger).fit(LitNet(), loader(make_data(6)))

    rows = csv_rows(logger)
    achieved, utilisation = values(rows, "precision/achieved_tflops"), values(rows, "precision/mfu")
    windows = list(monitor.windows)
    # Logging steps 2, 4, 6 (the logger's steps 1, 3, 5); the first window, the warm-up, is not logged.
    assert [w.step for w in windows] == sorted(achieved) == sorted(utilisation) == [3, 5]
    for w in windows:
        assert (w.steps, w.batches, w.flops, w.paused) == (2, 2, 2 * FLOPS, 0.0)
        assert 0 < w.seconds == w.end - w.start
        assert achieved[w.step] == pytest.approx(2 * FLOPS / w.seconds / 1e12, rel=1e-6)
        assert utilisation[w.step] == pytest.approx(achieved[w.step] / 2.0, rel=1e-6)
        assert w.peak.tflops == 2.0 and w.mfu == pytest.approx(w.achieved_tflops / 2.0)
    assert windows[1].start >= windows[0].end  # windows follow each other, and do not overlap
    assert values(rows, "precision/peak_tflops") == {3: 2.0}  # once
    assert len(syncs) == 3  # once per window (the warm-up's included), not once per step


def test_gradient_accumulation_sums_the_flops_of_each_optimizer_steps_micro_batches(monkeypatch):
    """10 batches (the last of 4 samples, not 8) with ``accumulate_grad_batches=3``: optimizer steps of 3, 3, 3 and 1
    micro-batches (Lightning steps on the epoch's last batch). Each micro-batch takes 0.5 s and 1000 FLOPs per
    sample."""
    clock = fake_clock(monkeypatch, per_batch=0.5)  # listed first in the callbacks
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(76, IN, generator=g), torch.randint(0, OUT, (76,), generator=g))
    monitor = MFUMonitor(flops_per_batch=lambda batch: 1000 * len(batch[0]), peak_tflops=1.0, log_every_n_steps=1)
    t = trainer(max_epochs=1, accumulate_grad_batches=3, callbacks=[clock, monitor])
    t.fit(LitNet(), loader(data))

    assert t.global_step == 4
    windows = list(monitor.windows)  # step 1 is the warm-up
    assert [(w.step, w.steps, w.batches, w.flops, w.seconds) for w in windows] == [
        (1, 1, 3, 24_000, 1.5), (2, 1, 3, 24_000, 1.5), (3, 1, 1, 4_000, 0.5)]
    assert [w.achieved_tflops for w in windows] == pytest.approx([16_000 / 1e12, 16_000 / 1e12, 8_000 / 1e12])


def test_validation_inside_a_window_is_not_counted_as_training_time(monkeypatch):
    clock = fake_clock(monkeypatch, per_batch=0.5, per_val_batch=10.0)
    monitor = MFUMonitor(flops_per_batch=FLOPS, peak_tflops=1.0)
    t = trainer(max_steps=8, log_every_n_steps=4, val_check_interval=2, limit_val_batches=2, callbacks=[clock, monitor])
    t.fit(LitNet(), loader(make_data(8)), loader(make_data(2)))
    (window,) = monitor.windows  # steps 5-8; validation ran after steps 2, 4, 6 and 8, once inside it (after 6)
    assert (window.steps, window.paused, window.seconds) == (4, 20.0, 2.0)
    assert window.achieved_tflops == pytest.approx(4 * FLOPS / 2.0 / 1e12)


class Noisy(LitNet):
    """Dropout and BatchNorm: an extra forward would change the random stream and the running statistics."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(IN, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, OUT))


def loss_fn(module, batch):
    x, y = batch
    return nn.functional.cross_entropy(module(x), y)


def test_loss_fn_counts_the_flops_of_model_flops_per_step_and_leaves_the_run_unchanged():
    def fit(callbacks):
        model = Noisy()
        torch.manual_seed(1)
        trainer(max_steps=4, log_every_n_steps=2, callbacks=callbacks).fit(model, loader(make_data(4)))
        return model

    monitor = MFUMonitor(loss_fn=loss_fn, peak_tflops=1.0)
    measured, plain = fit([monitor]), fit([])
    first_batch = next(iter(loader(make_data(4))))
    by_hand = model_flops_per_step(Noisy(), first_batch, loss_fn)
    assert monitor.measured_flops == by_hand > 0
    (window,) = monitor.windows
    assert window.flops == 2 * by_hand
    # The count's forward changed no weight, running statistic or dropout mask of the run.
    for (name, a), b in zip(measured.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_on_a_cpu_without_a_peak_it_warns_once_and_logs_achieved_tflops_only(tmp_path):
    monitor = MFUMonitor(flops_per_batch=FLOPS)
    logger = CSVLogger(tmp_path)
    with pytest.warns(NoEffectWarning, match=r"precision/mfu is n/a \(n/a on a CPU") as record:
        trainer(max_steps=6, log_every_n_steps=2, callbacks=[monitor], logger=logger).fit(LitNet(),
                                                                                          loader(make_data(6)))
    assert sum("MFUMonitor" in str(w.message) for w in record) == 1
    rows = csv_rows(logger)
    assert sorted(values(rows, "precision/achieved_tflops")) == [3, 5]
    assert not any(r.get("precision/mfu") or r.get("precision/peak_tflops") for r in rows)
    assert all(w.mfu is None and w.achieved_tflops > 0 for w in monitor.windows)


@pytest.mark.parametrize("precision", ["ours", "lightning"])
def test_a_bf16_run_counts_against_the_bf16_peak(precision):
    monitor = MFUMonitor(flops_per_batch=FLOPS, peak_tflops={"fp32": 1.0, "bf16": 100.0})
    setup = {"plugin": BF16MixedPrecision()} if precision == "ours" else {"precision": "bf16-mixed"}
    trainer(max_steps=4, log_every_n_steps=2, callbacks=[monitor], **setup).fit(LitNet(), loader(make_data(4)))
    (window,) = monitor.windows
    assert (window.peak.kind, window.peak.tflops) == ("bf16", 100.0)
    assert monitor.last_metrics["precision/mfu"] == pytest.approx(window.achieved_tflops / 100.0)
    assert monitor.last_metrics["precision/peak_tflops"] == 100.0


def test_a_bf16_run_given_only_an_fp32_peak_has_no_mfu():
    monitor = MFUMonitor(flops_per_batch=FLOPS, peak_tflops={"fp32": 5.0})
    with pytest.warns(NoEffectWarning, match="names no bf16 peak"):
        trainer(BF16MixedPrecision(), max_steps=4, log_every_n_steps=2, callbacks=[monitor]).fit(
            LitNet(), loader(make_data(4)))
    (window,) = monitor.windows
    assert window.peak.kind == "bf16" and window.mfu is None
    assert set(monitor.last_metrics) == {"precision/achieved_tflops"}


class Switching(BF16MixedPrecision):
    """A plugin whose compute kind changes during the fit, as FP8Precision's does when ``layers="auto"`` has chosen
    fp8 layers (its ``peak_flops_dtype`` turns from the compute dtype to ``torch.int8``)."""

    peak_flops_dtype = torch.bfloat16


class SwitchAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.precision_plugin.peak_flops_dtype = torch.int8


def test_the_peak_follows_the_plugins_compute_kind_and_is_logged_again_when_it_changes(tmp_path):
    monitor = MFUMonitor(flops_per_batch=FLOPS, peak_tflops="bf16=100,fp8=200")
    logger = CSVLogger(tmp_path)
    # After the monitor: the window that ends at step 4 still ran in bf16.
    trainer(Switching(), max_steps=8, log_every_n_steps=2, callbacks=[monitor, SwitchAt(4)], logger=logger).fit(
        LitNet(), loader(make_data(8)))
    assert [(w.step, w.peak.kind, w.peak.tflops) for w in monitor.windows] == [
        (3, "bf16", 100.0), (5, "fp8", 200.0), (7, "fp8", 200.0)]
    rows = csv_rows(logger)
    assert values(rows, "precision/peak_tflops") == {3: 100.0, 5: 200.0}
    assert values(rows, "precision/mfu")[5] == pytest.approx(values(rows, "precision/achieved_tflops")[5] / 200.0)


def test_the_plugins_compute_dtype_for_ours_lightnings_and_unknown_plugins():
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

    assert plugin_compute_dtype(BF16MixedPrecision()) == torch.bfloat16
    assert plugin_compute_dtype(MixedPrecision("bf16-mixed", "cpu")) == torch.bfloat16
    assert plugin_compute_dtype(MixedPrecision("16-mixed", "cpu")) == torch.float16
    assert plugin_compute_dtype(HalfPrecision("bf16-true")) == torch.bfloat16
    assert plugin_compute_dtype(HalfPrecision("16-true")) == torch.float16
    assert plugin_compute_dtype(Precision()) == torch.float32
    assert plugin_compute_dtype(object()) == torch.float32
    # fp64 has no peak in the table: n/a, not the fp32 peak
    choice = MFUMonitor(flops_per_batch=FLOPS, peak_tflops=1.0).peak(DoublePrecision())
    assert choice.tflops is None and "float64" in choice.source


def test_a_cuda_device_is_looked_up_by_its_name(monkeypatch):
    """No GPU here: ``torch.cuda.get_device_name`` is stubbed, the one thing read of the device."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    name = peak_device_name(torch.device("cuda", 0))
    assert name == "NVIDIA L40S" and choose_peak(name, "bf16").tflops == 362.05  # not the L4's 121
    assert peak_device_name(torch.device("cpu")) == "cpu"


def test_the_pure_function():
    assert mfu(2e12, 0.5, 4.0) == (4.0, 1.0)
    assert mfu(1e12, 2.0, None) == (0.5, None)
    for args in [(0, 1.0, 1.0), (1e9, 0.0, 1.0), (-1, 1.0, None), (1e9, math.inf, None), (1e9, 1.0, 0.0),
                 (1e9, 1.0, -3.0), (True, 1.0, None), ("1e9", 1.0, None)]:
        with pytest.raises(ValueError, match="mfu: "):
            mfu(*args)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, r"flops_per_batch=.*loss_fn="),
    ({"peak_tflops": 1.0}, r"flops_per_batch=.*loss_fn="),
    ({"flops_per_batch": 1, "loss_fn": loss_fn}, "pass one"),
    ({"flops_per_batch": 0}, r"flops_per_batch=0\)"),
    ({"flops_per_batch": -5}, "positive, finite number of FLOPs"),
    ({"flops_per_batch": math.nan}, "positive, finite"),
    ({"flops_per_batch": True}, "flops_per_batch=True"),
    ({"flops_per_batch": "1e9"}, "flops_per_batch='1e9'"),
    ({"loss_fn": "mse"}, r"loss_fn='mse'\)`: a function"),
    ({"flops_per_batch": 1, "peak_tflops": 0}, "peak_tflops=0"),
    ({"flops_per_batch": 1, "peak_tflops": -1.0}, "positive, finite number"),
    ({"flops_per_batch": 1, "peak_tflops": math.inf}, "peak_tflops=inf"),
    ({"flops_per_batch": 1, "peak_tflops": True}, "peak_tflops=True"),
    ({"flops_per_batch": 1, "peak_tflops": [989.0]}, r"peak_tflops=\[989.0\]"),
    ({"flops_per_batch": 1, "peak_tflops": {"fp4": 1.0}}, "name kinds from fp32, tf32, bf16, fp16, fp8"),
    ({"flops_per_batch": 1, "peak_tflops": {"bf16": -1.0}}, "positive, finite TFLOP/s"),
    ({"flops_per_batch": 1, "peak_tflops": {}}, "name kinds"),
    ({"flops_per_batch": 1, "peak_tflops": "bf16=fast"}, r"peak_tflops='bf16=fast'\)`: could not convert"),
    # Issue 36: a device's name is not a peak, and the error speaks of the argument, not of a command-line flag.
    ({"flops_per_batch": 1, "peak_tflops": "H100"},
     r"^`MFUMonitor\(peak_tflops='H100'\)`: could not convert[^-]*a device's name is not a peak"),
    ({"flops_per_batch": 1, "log_every_n_steps": 0}, "log_every_n_steps=0"),
    ({"flops_per_batch": 1, "keep_windows": 0}, "keep_windows=0"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MFUMonitor(**kwargs)


def test_a_flops_function_that_returns_nonsense_stops_the_fit_with_a_clear_error():
    monitor = MFUMonitor(flops_per_batch=lambda batch: -1, peak_tflops=1.0)
    with pytest.raises(ValueError, match=r"returned -1 for a batch"):
        trainer(max_steps=1, callbacks=[monitor]).fit(LitNet(), loader(make_data(1)))
