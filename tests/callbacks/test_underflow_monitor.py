"""GradientUnderflowMonitor on real fits: logged numbers equal a direct computation on the same gradients."""

import json
import math
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision
from lightning_precision import fabric as lp_fabric
from lightning_precision.callbacks import GradientUnderflowMonitor
from lightning_precision.functional import exponent_histogram, recommend_loss_scale, underflow_stats
from tests.distributed import fit_spawned
from tests.helpers import LitNet, fp8_recipe, loader, make_data, make_net, trainer


class GradCapture(Callback):
    """Runs after the monitor (callbacks run in order) and keeps each step's gradients and loss scale."""

    def __init__(self):
        self.grads, self.scales = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # the plugin's GradScaler, if it scales the loss
        self.scales.append(None if scaler is None else scaler.get_scale())


class TinyGrads(LitNet):
    """Loss scaled down so that a good share of gradients sit below fp16's range: there is underflow to count."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-6


@pytest.mark.parametrize("plugin", [None, BF16MixedPrecision(), FP16MixedPrecision()], ids=["fp32", "bf16", "fp16"])
def test_logged_fractions_equal_a_direct_computation(plugin):
    monitor = GradientUnderflowMonitor(top_k=2, warn_threshold=1.0)
    capture = GradCapture()
    t = trainer(plugin, max_steps=4, log_every_n_steps=4, callbacks=[monitor, capture])
    t.fit(TinyGrads(), loader(make_data(4)))

    grads, scale = capture.grads[-1], capture.scales[-1]  # step 4 is the logging step
    logged = t.callback_metrics
    for fmt in ("fp16", "bf16", "e4m3fn", "e5m2"):
        direct = underflow_stats(grads, fmt).total
        assert float(logged[f"precision/underflow/{fmt}"]) == pytest.approx(float(direct.underflow_fraction))
        assert float(logged[f"precision/overflow/{fmt}"]) == pytest.approx(float(direct.overflow_fraction))
    assert float(logged["precision/underflow/fp16"]) > 0.01  # the case is not vacuous
    if scale is None:
        assert "precision/underflow/fp16/scaled" not in logged
    else:  # with a scaler, fp16 is also asked about g * S
        direct = underflow_stats(grads, "fp16", scale).total
        assert float(logged["precision/underflow/fp16/scaled"]) == pytest.approx(float(direct.underflow_fraction))
        assert float(logged["precision/underflow/fp16/scaled"]) < float(logged["precision/underflow/fp16"])
    per_layer = {k for k in logged
                 if k.startswith("precision/underflow/fp16/") and k.split("/")[-1] not in ("scaled", "lost")}
    assert len(per_layer) == 2  # top_k
    worst = max(
        ("net.0", "net.2", "net.4"),
        key=lambda m: float(underflow_stats({n: g for n, g in grads.items() if n.startswith(m + ".")},
                                            "fp16").total.underflow_fraction),
    )
    assert f"precision/underflow/fp16/{worst}" in per_layer


def test_measures_only_on_logging_steps_and_warns_once_with_advice():
    monitor = GradientUnderflowMonitor(warn_threshold=0.01)
    calls = []
    original = monitor.measure_gradients
    monitor.measure_gradients = lambda *a, **k: (calls.append(1), original(*a, **k))
    with pytest.warns(UserWarning,
                      match=r"flush to zero in fp16 without loss scaling.*FP16MixedPrecision\(init_scale="):
        trainer(None, max_steps=6, log_every_n_steps=3, callbacks=[monitor]).fit(TinyGrads(), loader(make_data(6)))
    assert len(calls) == 2  # steps 3 and 6 only
    scale, under, over = advice = monitor.recommend_loss_scale()
    assert scale > 1 and under <= monitor.target_underflow and over == 0
    assert (advice.scale, advice.underflow, advice.overflow) == (scale, under, over)


@pytest.mark.parametrize(("measure_every", "expected"), [(None, [3, 6]), (2, [2, 4, 6])])
def test_an_ordinary_step_costs_one_cadence_check(monkeypatch, measure_every, expected):
    """The step's decision is taken once, at its first batch, and the optimizer step reuses it (twice it asked again);
    with a cadence of its own the logging steps are still asked apart, and what is measured and logged is the same."""
    from lightning_precision.callbacks import underflow

    checks = []
    real = underflow.on_cadence
    monkeypatch.setattr(underflow, "on_cadence", lambda *a: (checks.append(1), real(*a))[1])
    monitor = GradientUnderflowMonitor(warn_threshold=1.0, measure_every_n_steps=measure_every)
    measured, logged = [], []
    original = monitor.measure_gradients
    monitor.measure_gradients = lambda *a, **k: (measured.append(len(checks)), original(*a, **k))
    original_compute = monitor.compute
    monitor.compute = lambda *a, **k: (logged.append(1), original_compute(*a, **k))[1]
    t = trainer(None, max_steps=6, log_every_n_steps=3, callbacks=[monitor])
    t.fit(TinyGrads(), loader(make_data(6)))
    assert len(measured) == len(expected) and len(logged) == 2
    assert len(checks) == (6 if measure_every is None else 12)


def test_activation_gradients_are_measured_scaled_under_fp16(tmp_path):
    monitor = GradientUnderflowMonitor(activations=True, plot_path=str(tmp_path / "hist.png"), warn_threshold=1.0)
    t = trainer(FP16MixedPrecision(), max_steps=2, log_every_n_steps=2, callbacks=[monitor])
    t.fit(TinyGrads(), loader(make_data(2)))
    logged = t.callback_metrics
    assert "precision/act_underflow/fp16/scaled" in logged and "precision/act_exact_zero" in logged
    # Activation gradients are the real fp16 tensors of the backward, already scaled: casting them to fp16 flushes
    # nothing more, while the unscaled parameter gradients would flush in fp16.
    assert float(logged["precision/act_underflow/fp16/scaled"]) == 0.0
    assert int(monitor.activation_histogram.sum()) > 0
    assert (tmp_path / "hist.png").stat().st_size > 10_000
    assert not monitor._hooks  # removed at teardown


def test_state_round_trips_through_a_checkpoint(tmp_path):
    monitor = GradientUnderflowMonitor(warn_threshold=1.0)
    t = trainer(None, max_steps=2, log_every_n_steps=1, callbacks=[monitor])
    t.fit(LitNet(), loader(make_data(2)))
    t.save_checkpoint(tmp_path / "c.ckpt")
    other = GradientUnderflowMonitor(warn_threshold=1.0)
    t2 = trainer(None, max_steps=3, log_every_n_steps=1, callbacks=[other])
    t2.fit(LitNet(), loader(make_data(2)), ckpt_path=tmp_path / "c.ckpt")
    assert int(other.histogram.sum()) > int(monitor.histogram.sum()) > 0  # resumed from, then added to


def test_block_scaled_what_if_on_a_bf16_fit():
    """A bf16 run asks "would MXFP8 or NVFP4 lose these gradients?": the logged fractions are the block casts' own
    counts on the same gradients (each block at its own scale), and NVFP4's 4-bit elements lose more than MXFP8's."""
    monitor = GradientUnderflowMonitor(formats=("bf16", "mxfp8", "nvfp4"), top_k=0, warn_threshold=1.0)
    capture = GradCapture()
    t = trainer(BF16MixedPrecision(), max_steps=2, log_every_n_steps=2, callbacks=[monitor, capture])
    t.fit(TinyGrads(), loader(make_data(2)))
    logged = t.callback_metrics
    for fmt in ("mxfp8", "nvfp4"):
        direct = underflow_stats(capture.grads[-1], fmt).total
        assert float(logged[f"precision/underflow/{fmt}"]) == pytest.approx(float(direct.underflow_fraction))
        assert float(logged[f"precision/overflow/{fmt}"]) == pytest.approx(float(direct.overflow_fraction))
    assert float(logged["precision/underflow/nvfp4"]) > float(logged["precision/underflow/mxfp8"])


def test_fabric_loop_uses_the_same_methods():
    plugin = L.fabric.plugins.precision.Precision()  # plain fp32 Fabric
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    monitor = GradientUnderflowMonitor(formats=("fp16", "e5m2"))
    x, y = make_data(1).tensors
    fabric.backward(torch.nn.functional.cross_entropy(model(x), y) * 1e-6)
    grads = {n: p.grad for n, p in net.named_parameters()}
    monitor.measure_gradients(grads)
    metrics = monitor.compute(reduce=lambda t: fabric.all_reduce(t, reduce_op="sum"))
    fabric.log_dict(metrics)
    direct = underflow_stats(grads, "fp16").total
    assert float(metrics["precision/underflow/fp16"]) == pytest.approx(float(direct.underflow_fraction))
    assert set(k.split("/")[2] for k in metrics if k.startswith("precision/underflow/")) == {"fp16", "e5m2"}
    assert monitor.compute() == {}  # compute() reset the counts


def _fabric_first_step(monitor):
    """The card's Fabric loop on the card's case (loss x 1e-5 at loss scale 1, first step): the probe runs through
    ``fabric.backward``, the only backward Fabric lets through its model's outputs when the plugin scales the loss."""
    plugin = lp_fabric.FP16MixedPrecision(init_scale=1.0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = make_data(1).tensors
    scale = plugin.loss_scale
    loss = torch.nn.functional.cross_entropy(model(x), y) * 1e-5
    monitor.probe_backward(loss, model.named_parameters(), scale, backward=fabric.backward)
    assert all(p.grad is None for p in net.parameters())  # the probe leaves no gradient behind
    fabric.backward(loss)
    monitor.measure_gradients({n: p.grad / scale for n, p in model.named_parameters()}, scale)
    return monitor.compute()


def test_the_probe_runs_under_fabric_and_gives_the_trainers_figures():
    trained = GradientUnderflowMonitor(formats="fp16", top_k=2, warn_threshold=1.0)
    logged = _first_step_metrics(FP16MixedPrecision(init_scale=1.0), trained)
    fabric = GradientUnderflowMonitor(formats="fp16", top_k=2, warn_threshold=1.0)
    metrics = _fabric_first_step(fabric)
    assert float(metrics["precision/underflow/fp16/lost"]) > 0.2  # the case is not vacuous
    # The same keys, per-layer ones included: they name the user's layers (`0`, `2` of the Sequential that the Trainer's
    # module holds as `net`), not Fabric's wrapper (`_forward_module.0`).
    expected = {k.replace("/net.", "/"): float(v) for k, v in logged.items()
                if k.startswith("precision/") and k not in ("precision/loss_scale", "precision/skipped_steps")}
    assert {k: float(v.float()) for k, v in metrics.items()} == expected  # logged as fp32
    assert torch.equal(fabric.histogram, trained.histogram)
    assert fabric.recommend_loss_scale() == trained.recommend_loss_scale()


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"Unknown number format 'fp7'"):
        GradientUnderflowMonitor(formats=("fp7",))
    with pytest.raises(ValueError, match=r"log_every_n_steps=0"):
        GradientUnderflowMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match=r"warn_threshold=2"):
        GradientUnderflowMonitor(warn_threshold=2)


class RankActivations(TinyGrads):
    """Each rank gets different data, so activation gradients (local, never all-reduced) differ between ranks."""

    def __init__(self, out_dir):
        super().__init__()
        self.out_dir = out_dir

    def on_train_end(self):
        monitor = next(c for c in self.trainer.callbacks if isinstance(c, GradientUnderflowMonitor))
        local = monitor._last_local
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            logged = float(self.trainer.callback_metrics["precision/act_underflow/fp16"])
            json.dump({"local": local, "logged": logged}, f)


class RecordingMonitor(GradientUnderflowMonitor):
    """Keeps the local (pre-all-reduce) counts of the logging step, to compare with the global fraction logged."""

    def compute(self, reduce=None):
        numel, _, underflow, _, _ = self.state["count/act/fp16"].tolist()  # CastStats' fields, in order
        self._last_local = [underflow, numel]
        return super().compute(reduce)


def test_ddp_logs_the_global_fraction_of_the_union(tmp_path):
    monitor = RecordingMonitor(formats=("fp16",), activations=True, warn_threshold=1.0)
    t = trainer(None, strategy="ddp_spawn", devices=2, max_steps=2, log_every_n_steps=2, callbacks=[monitor])
    reports = fit_spawned(t, RankActivations(str(tmp_path)), loader(make_data(4)), tmp_path)
    (u0, n0), (u1, n1) = reports[0]["local"], reports[1]["local"]
    union = (u0 + u1) / (n0 + n1)
    assert u0 / n0 != u1 / n1  # the ranks really saw different values
    assert reports[0]["logged"] == reports[1]["logged"] == pytest.approx(union)


def test_writes_to_a_real_logger(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    t = trainer(None, max_steps=4, log_every_n_steps=2, logger=CSVLogger(tmp_path, name="run"),
                callbacks=[GradientUnderflowMonitor(formats=("fp16",), warn_threshold=1.0)])
    t.fit(TinyGrads(), loader(make_data(4)))
    rows = [r for r in csv.DictReader(open(t.logger.experiment.metrics_file_path)) if r.get("precision/underflow/fp16")]
    assert [int(r["step"]) for r in rows] == [1, 3]
    assert all(0 < float(r["precision/underflow/fp16"]) < 1 for r in rows)


class TinyLoss(LitNet):
    """The card's case: a loss scaled by 1e-5 under fp16 at loss scale 1, so the fp16 backward flushes gradients."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-5


def _first_step_metrics(plugin, monitor):
    t = trainer(plugin, max_steps=1, log_every_n_steps=1, callbacks=[monitor])
    t.fit(TinyLoss(), loader(make_data(1)))
    return t.callback_metrics


@pytest.mark.parametrize("make", [lambda: FP16MixedPrecision(init_scale=1.0),
                                  lambda: MixedPrecision("16-mixed", "cpu",
                                                         torch.amp.GradScaler("cpu", init_scale=1.0))],
                         ids=["ours", "lightning"])
def test_what_fp16_already_flushed_is_underflow_not_exact_zero(make):
    """Parameter gradients are measured after the fp16 backward flushed them: without a reference, the loss reads as
    exact zeros. The probe backward finds them: what remains as exact zero equals the fp32 run's true zeros."""
    true_zero = float(_first_step_metrics(None, GradientUnderflowMonitor(formats="fp16", warn_threshold=1.0))
                      ["precision/exact_zero"])
    monitor = GradientUnderflowMonitor(formats="fp16", top_k=0)
    with pytest.warns(UserWarning, match=r"flush to zero in fp16 at loss scale 1 .*A loss scale of \d+ would leave"):
        logged = _first_step_metrics(make(), monitor)
    lost = float(logged["precision/underflow/fp16/lost"])
    assert lost > 0.2  # the case is not vacuous
    assert float(logged["precision/underflow/fp16/scaled"]) >= lost
    assert float(logged["precision/exact_zero"]) == pytest.approx(true_zero)
    scale, under, over = monitor.recommend_loss_scale()
    assert scale > 1 and over == 0  # raise the scale, never lower it


def test_the_advice_in_the_issues_case_is_the_smallest_scale_that_meets_the_target_and_the_card_says_so():
    """The card's worked case: the advice is a scale the real fp16 backward loses at most ``target_underflow`` at,
    half of it loses more, and the card quotes the figure the code gives."""
    import re
    from pathlib import Path

    monitor = GradientUnderflowMonitor(formats="fp16", top_k=0, warn_threshold=1.0)
    _first_step_metrics(FP16MixedPrecision(init_scale=1.0), monitor)
    advice = monitor.recommend_loss_scale()
    assert advice.scale == 256.0 and advice.underflow <= monitor.target_underflow

    def lost_at(scale):
        logged = _first_step_metrics(FP16MixedPrecision(init_scale=scale),
                                     GradientUnderflowMonitor(formats="fp16", top_k=0, warn_threshold=1.0))
        return float(logged["precision/underflow/fp16/lost"])

    assert lost_at(advice.scale) <= monitor.target_underflow < lost_at(advice.scale / 2)
    card = (Path(__file__).parents[2] / "docs/callbacks/gradient_underflow_monitor.md").read_text()
    assert re.findall(r"the advice is a scale of (\d+)", card) == [f"{advice.scale:g}"]


def test_the_probe_can_be_turned_off_and_an_overflowing_probe_is_discarded():
    off = GradientUnderflowMonitor(formats="fp16", warn_threshold=1.0, probe_factor=None)
    assert "precision/underflow/fp16/lost" not in _first_step_metrics(FP16MixedPrecision(init_scale=1.0), off)
    # at 2**16 x 2**16 an ordinary loss's gradients overflow fp16: the probe says nothing (no key: unknown is not 0),
    # and the next one is smaller
    big = GradientUnderflowMonitor(formats="fp16", warn_threshold=1.0)
    t = trainer(FP16MixedPrecision(), max_steps=1, log_every_n_steps=1, callbacks=[big])
    t.fit(LitNet(), loader(make_data(1)))
    assert "precision/underflow/fp16/lost" not in t.callback_metrics
    assert "precision/underflow/fp16/scaled" in t.callback_metrics
    assert big.probe_factor == 2.0**8


def test_recommendation_never_overflows_what_it_saw():
    hist = exponent_histogram(torch.full((100,), 2.0**40))
    scale, under, over = recommend_loss_scale(hist)
    assert 2.0**40 * scale < 65504 and over == 0.0  # fp16 overflows every value at scale 1
    assert scale == 2.0**-26
    mixed = exponent_histogram(torch.tensor([2.0**-30, 2.0**14]))  # the large one leaves room for scale 1 only
    assert recommend_loss_scale(mixed, target_underflow=0.0)[0] == 1.0


class OddGradients(LitNet):
    """A sparse embedding (sparse gradient) and a complex parameter."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 16, sparse=True)
        self.phase = torch.nn.Parameter(torch.randn(4, dtype=torch.cfloat))

    def forward(self, x):
        phase = (self.phase * self.phase.conj()).real.sum()
        return super().forward(x + self.emb(torch.arange(x.shape[0]) % 10)) + phase


class CountingMonitor(GradientUnderflowMonitor):
    def compute(self, reduce=None):
        self.numel = int(self.state["count/param/fp16"][0])  # CastStats' first field
        return super().compute(reduce)


def test_sparse_and_complex_gradients_are_measured_not_fatal():
    monitor = CountingMonitor(formats="fp16", warn_threshold=1.0, top_k=2)
    model = OddGradients()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(None, max_steps=1, log_every_n_steps=1, callbacks=[monitor]).fit(model, loader(make_data(1)))
    assert not [w for w in caught if "cannot measure" in str(w.message)]
    dense = sum(p.numel() for n, p in model.named_parameters() if n.startswith("net."))
    assert monitor.numel == dense + 8 * 16 + 4 * 2  # 8 embedding rows looked up; real and imaginary parts


def test_a_gradient_that_cannot_be_measured_is_skipped_with_one_warning():
    monitor = GradientUnderflowMonitor(formats="fp16")
    grads = {"ok": torch.tensor([1.0, 2.0**-30]), "ids": torch.tensor([1, 2])}
    with pytest.warns(UserWarning, match=r"cannot measure `ids`.*left out"):
        monitor.measure_gradients(grads)
    monitor.measure_gradients(grads)  # once only: no second warning (pytest would fail on an unexpected one below)
    assert float(monitor.compute()["precision/underflow/fp16"]) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": "3"}, r"top_k='3'.*whole number"),
        ({"top_k": None}, r"top_k=None.*whole number"),
        ({"top_k": 2.5}, r"top_k=2\.5.*whole number"),
        ({"top_k": True}, r"top_k=True.*whole number"),
        ({"warn_threshold": "0.1"}, r"warn_threshold='0.1'.*fraction"),
        ({"warn_threshold": None}, r"warn_threshold=None.*fraction"),
        ({"target_underflow": None}, r"target_underflow=None.*fraction"),
        ({"target_underflow": "1e-3"}, r"target_underflow='1e-3'.*fraction"),
        ({"probe_factor": 3.0}, r"probe_factor=3\.0.*power of two"),
        ({"probe_factor": 1.0}, r"probe_factor=1\.0.*power of two > 1"),
        ({"formats": ()}, r"formats=\(\).*at least one format"),
    ],
)
def test_more_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientUnderflowMonitor(**kwargs)


def test_one_format_may_be_given_as_a_string():
    assert GradientUnderflowMonitor(formats="fp16").formats == ("fp16",)  # not ('f', 'p', '1', '6')
    assert GradientUnderflowMonitor(formats=torch.bfloat16).formats == ("bf16",)


def test_a_probe_that_saw_other_values_costs_only_the_lost_count():
    """A sparse gradient can store other values in the probe than in the real backward: that tensor then adds nothing
    to the lost count, and its own statistics stand (no "cannot measure", nothing dropped)."""
    monitor = GradientUnderflowMonitor(formats="fp16", top_k=0)
    w = torch.nn.Parameter(torch.ones(6))
    monitor.probe_backward((w * 1e-3).sum(), [("w", w)], loss_scale=1.0)
    real = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([2.0**-30, 1.0]), (6,),  # 2 stored values
                                   check_invariants=True)  # checked: torch warns when the check is left implicit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor.measure_gradients({"w": real}, loss_scale=1.0)
    metrics = monitor.compute()
    assert float(metrics["precision/underflow/fp16"]) == pytest.approx(0.5)  # the stored values were measured
    assert "precision/underflow/fp16/lost" not in metrics  # nothing comparable: unknown, not 0


def test_activation_gradients_are_counted_once_and_the_probe_feeds_their_histogram():
    """With ``activations=True`` the activation hooks also fire in the probe's backward. They used to count the step
    twice, putting the probe's gradients (scaled by loss scale x probe factor) in the histogram as if scaled by the
    loss scale alone, beside the real backward's flushed ones: the card's case was advised a scale of 0.5. Now the
    histogram holds one backward's values, the probe's (it holds what fp16 flushed), and the advice matches an fp32
    run's to one power of two."""
    def first_step(plugin):
        monitor = GradientUnderflowMonitor(formats="fp16", top_k=0, warn_threshold=1.0, activations=True)
        _first_step_metrics(plugin, monitor)
        return monitor

    fp32, fp16 = first_step(None), first_step(FP16MixedPrecision(init_scale=1.0))
    assert int(fp16.activation_histogram.sum()) == pytest.approx(int(fp32.activation_histogram.sum()), rel=0.02)
    truth, advice = fp32.recommend_loss_scale().scale, fp16.recommend_loss_scale().scale
    assert truth / 2 <= advice <= truth * 2, (advice, truth)


class CountSteps(LitNet):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


def test_a_plot_path_that_cannot_be_written_fails_at_setup_before_any_step(tmp_path):
    """A bad ``plot_path`` used to surface when the plot was drawn, after the whole fit."""
    (tmp_path / "a_file").write_text("")
    for path, why in [(tmp_path / "a_file" / "hist.png", "not a folder"), (tmp_path, "is a folder"),
                      (tmp_path / "hist.xyz", "matplotlib writes no 'xyz' images")]:
        module = CountSteps()
        with pytest.raises(ValueError, match=rf"GradientUnderflowMonitor\(plot_path=.*{why}"):
            trainer(None, max_steps=2, callbacks=[GradientUnderflowMonitor(plot_path=str(path))]).fit(
                module, loader(make_data(2)))
        assert module.steps == 0


@pytest.mark.slow  # a child process (torch, matplotlib): file safety, the same on every torch version
def test_the_plot_replaces_the_previous_one_whole(tmp_path):
    """Written to a temporary file beside it and renamed: a link to the plot stays a link, and no temporary is left.
    A write that fails midway (here the file-size limit, as a full disk would, in a child process) leaves the previous
    plot whole instead of a truncated one."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "real.png").write_bytes(b"old")
    (tmp_path / "hist.png").symlink_to(tmp_path / "real.png")
    monitor = GradientUnderflowMonitor(plot_path=str(tmp_path / "hist.png"), warn_threshold=1.0)
    trainer(None, max_steps=2, log_every_n_steps=1, callbacks=[monitor]).fit(LitNet(), loader(make_data(2)))
    assert (tmp_path / "hist.png").is_symlink() and (tmp_path / "real.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hist.png", "real.png"]

    before = (tmp_path / "real.png").read_bytes()
    child = textwrap.dedent(f"""
        import resource, signal, torch
        from lightning_precision.callbacks import GradientUnderflowMonitor
        monitor = GradientUnderflowMonitor()
        monitor.measure_gradients({{"w": torch.randn(1000) * 1e-3}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        monitor.save_plot({str(tmp_path / "hist.png")!r})
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "real.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hist.png", "real.png"]


# ---- under an fp8 plugin, fp8 is measured at the scale the plugin casts at --------------------------


def _torchao_underflow(grads: dict, dtype: torch.dtype, rowwise: bool = False) -> float:
    """What torchao's own cast (``tensor_to_scale`` then ``to_fp8_saturated``, per tensor or per row with scales
    rounded to powers of two, as its rowwise recipe) flushes of these gradients, over all of them."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    flushed = total = 0
    for g in grads.values():
        kwargs = {"scaling_granularity": ScalingGranularity.AXISWISE, "axiswise_dim": -1,
                  "round_scales_to_power_of_2": True} if rowwise and g.dim() > 1 else {}
        q = to_fp8_saturated(g.float() * tensor_to_scale(g.float(), dtype, **kwargs), dtype)
        flushed += int(((g != 0) & (q.float() == 0)).sum())
        total += g.numel()
    return flushed / total


@pytest.mark.parametrize("recipe", [fp8_recipe(r) for r in ("tensorwise", "rowwise")])
def test_under_an_fp8_plugin_fp8_is_measured_at_the_plugins_dynamic_scale(recipe):
    """Unscaled, e4m3fn flushed most of these gradients (0.63-0.82 on real models): no fp8 cast of the run
    does that, since torchao scales each tensor first. Under FP8Precision the fp8 figures are taken at the plugin's
    scale and keyed `/dynamic`, equal to what torchao's own cast flushes; the unscaled fp8 keys are not logged; fp16 and
    bf16 are as before."""
    pytest.importorskip("torchao")
    from lightning_precision import FP8Precision

    monitor, capture = GradientUnderflowMonitor(top_k=1, warn_threshold=1.0), GradCapture()
    plugin = FP8Precision(recipe=recipe, emulate=True, skip_small_layers=False, skip_first_last=False)
    t = trainer(plugin, max_steps=4, log_every_n_steps=4, callbacks=[monitor, capture])
    t.fit(TinyGrads(), loader(make_data(4)))
    grads, logged = capture.grads[-1], t.callback_metrics
    for fmt, dtype in (("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        assert f"precision/underflow/{fmt}" not in logged and f"precision/overflow/{fmt}" not in logged
        expected = _torchao_underflow(grads, dtype, rowwise=recipe == "rowwise")
        assert float(logged[f"precision/underflow/{fmt}/dynamic"]) == pytest.approx(expected)
        assert float(logged[f"precision/overflow/{fmt}/dynamic"]) == 0  # a dynamic scale saturates nothing
        unscaled = float(underflow_stats(grads, fmt).total.underflow_fraction)
        assert unscaled > 0.5 and expected < unscaled / 2, (unscaled, expected)  # the figure it replaces misled
    for fmt in ("fp16", "bf16"):
        assert float(logged[f"precision/underflow/{fmt}"]) == pytest.approx(
            float(underflow_stats(grads, fmt).total.underflow_fraction))
    assert len([k for k in logged if k.startswith("precision/underflow/fp16/net")]) == 1  # top_k of formats[0]


def test_fp8_scaling_keys_activations_and_layers_and_stays_unscaled_elsewhere():
    """Activation gradients (the fp8 layers' output gradients are what the backward casts) and the per-module keys
    follow the same rule; under a bf16 plugin, or with ``fp8_scaling=None``, fp8 stays unscaled under its old keys."""
    pytest.importorskip("torchao")
    from lightning_precision import FP8Precision

    monitor = GradientUnderflowMonitor(formats=("e5m2", "bf16"), activations=True, top_k=1)
    t = trainer(FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False), max_steps=2,
                log_every_n_steps=2, callbacks=[monitor])
    t.fit(TinyGrads(), loader(make_data(2)))
    keys = set(t.callback_metrics)
    assert {"precision/act_underflow/e5m2/dynamic", "precision/act_underflow/bf16"} <= keys
    assert [k.rsplit("/", 1)[0] for k in keys if k.startswith("precision/underflow/e5m2/dynamic/")] == \
        ["precision/underflow/e5m2/dynamic"]
    assert not any(k.startswith("precision/underflow/e5m2") and "/dynamic" not in k for k in keys)
    for plugin, kwargs in ((BF16MixedPrecision(), {}), (FP8Precision(emulate=True, skip_small_layers=False), {
            "fp8_scaling": None})):
        t = trainer(plugin, max_steps=2, log_every_n_steps=2, callbacks=[GradientUnderflowMonitor(**kwargs)])
        with pytest.warns(UserWarning, match="of gradients flush to zero in fp16 without loss scaling"):  # TinyGrads'
            t.fit(TinyGrads(), loader(make_data(2)))
        assert "precision/underflow/e4m3fn" in t.callback_metrics
        assert not any("/dynamic" in k for k in t.callback_metrics)
    with pytest.raises(ValueError, match=r"fp8_scaling='per-tensor'.*'auto'.*None.*scaling_family"):
        GradientUnderflowMonitor(fp8_scaling="per-tensor")


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_dynamic_scale_stats_count_what_torchaos_own_cast_flushes(rowwise, monkeypatch):
    """Magnitudes spread over 2**-40 .. 1, rows of very different sizes, an inf, a nan and exact zeros; counted in
    chunks smaller than a row and than the tensor (as on large gradients)."""
    pytest.importorskip("torchao")
    from lightning_precision import functional

    g = torch.Generator().manual_seed(0)
    x = torch.exp2(-40 * torch.rand(64, 96, generator=g)) * torch.randn(64, 96, generator=g).sign()
    x *= torch.exp2(-20 * torch.rand(64, 1, generator=g))
    x[0, :5] = 0.0
    finite = x.clone()
    x[1, 1], x[2, 2] = math.inf, math.nan
    monkeypatch.setattr(functional, "CHUNK", 40)
    for fmt, dtype in (("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        stats = functional.dynamic_scale_stats(x, [fmt], "rowwise" if rowwise else "tensorwise", pow2=rowwise)[fmt]
        # torchao's reference on the finite values (its amax would take the inf); inf and nan are counted apart
        finite[1, 1] = finite[2, 2] = 0.0
        expected = _torchao_underflow({"x": finite}, dtype, rowwise) * x.numel()
        assert int(stats.underflow) == round(expected) > 0
        assert (int(stats.exact_zero), int(stats.nonfinite), int(stats.overflow)) == (5, 2, 0)
