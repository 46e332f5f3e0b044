"""GradientUnderflowMonitor under the true-precision plugins, on real fits: gradients that are already 16-bit (and, in
fp16, still at the loss scale when the hooks see them), and what rounding the new weights loses."""

import pytest
import torch

from lightning_precision import BF16TruePrecision, FP16TruePrecision
from lightning_precision.callbacks import GradientUnderflowMonitor
from lightning_precision.functional import underflow_stats
from tests.helpers import LitNet, loader, make_data, trainer
from tests.test_underflow_monitor import GradCapture, TinyGrads


@pytest.mark.parametrize("plugin", [FP16TruePrecision, BF16TruePrecision], ids=["fp16", "bf16"])
def test_true_gradients_are_measured_unscaled(plugin):
    """fp16 gradients at the loss scale S: the figures are those of g / S (in fp32), the fp16 question of g / S * S (the
    gradients as they are, which no fp16 cast flushes), never of g * S * S. bf16 gradients are bf16 already: casting
    them to bf16 flushes nothing; what the bf16 backward flushed is an exact zero."""
    monitor = GradientUnderflowMonitor(top_k=0, warn_threshold=1.0, probe_factor=None)
    capture = GradCapture()
    t = trainer(plugin(), max_steps=4, log_every_n_steps=4, callbacks=[monitor, capture])
    t.fit(TinyGrads(), loader(make_data(4)))

    grads, scale = capture.grads[-1], capture.scales[-1]  # step 4 is the logging step
    assert all(g.dtype == (torch.float16 if plugin is FP16TruePrecision else torch.bfloat16) for g in grads.values())
    unscaled = {n: g.float() / (scale or 1.0) for n, g in grads.items()}
    logged = t.callback_metrics
    for fmt in ("fp16", "bf16", "e4m3fn", "e5m2"):
        direct = underflow_stats(unscaled, fmt).total
        assert float(logged[f"precision/underflow/{fmt}"]) == pytest.approx(float(direct.underflow_fraction))
        assert float(logged[f"precision/overflow/{fmt}"]) == pytest.approx(float(direct.overflow_fraction))
    assert float(logged["precision/exact_zero"]) == pytest.approx(float(underflow_stats(unscaled, "fp16").total
                                                                        .exact_zero_fraction))
    # The case is not vacuous: unscaled, a good share of these gradients would flush in fp16.
    assert float(logged["precision/underflow/fp16"]) > 0.01
    assert float(logged["precision/underflow/bf16"]) == 0.0
    if plugin is FP16TruePrecision:
        assert scale is not None and scale > 1
        # At the scale they carry, the fp16 gradients are what they are: nothing flushes, nothing overflows.
        assert float(logged["precision/underflow/fp16/scaled"]) == 0.0
        assert float(logged["precision/overflow/fp16/scaled"]) == 0.0
    else:
        assert scale is None and "precision/underflow/fp16/scaled" not in logged


class SmallLoss(LitNet):
    """The loss times 1e-5: at a loss scale of 1, fp16's backward flushes about 30% of the gradients."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-5


def test_fp16_true_flushed_gradients_are_underflow_not_exact_zeros():
    """The loss of a true fp16 model is fp16 itself: the probe's scale must fit fp16 at the root (2**16 is inf there),
    or every probe overflows, what the backward flushed counts as exact zeros and the advice lowers the scale."""
    figures = {}
    for name, plugin in (("fp32", None), ("fp16", FP16TruePrecision(init_scale=1.0))):
        monitor = GradientUnderflowMonitor(top_k=0, warn_threshold=1.0)
        t = trainer(plugin, max_steps=1, log_every_n_steps=1, callbacks=[monitor])
        t.fit(SmallLoss(), loader(make_data(1)))
        figures[name] = ({k: float(v) for k, v in t.callback_metrics.items()}, monitor.recommend_loss_scale().scale)
    (fp32, _), (fp16, advice) = figures["fp32"], figures["fp16"]
    assert fp16["precision/underflow/fp16/lost"] > 0.2
    assert fp16["precision/underflow/fp16/scaled"] >= fp16["precision/underflow/fp16/lost"]
    assert fp16["precision/exact_zero"] == pytest.approx(fp32["precision/exact_zero"], abs=0.01)
    assert advice > 1  # raise the scale, not lower it


def test_fp16_true_probe_without_headroom_reports_no_loss():
    """At a loss scale of 2**15 no larger probe fits an fp16 loss: what was lost is unknown (not logged, not 0), and
    that is no overflow (the probe factor stays)."""
    monitor = GradientUnderflowMonitor(top_k=0, warn_threshold=1.0)
    t = trainer(FP16TruePrecision(init_scale=2.0**15), max_steps=2, log_every_n_steps=1, callbacks=[monitor])
    t.fit(TinyGrads(), loader(make_data(2)))
    assert "precision/underflow/fp16/scaled" in t.callback_metrics
    assert "precision/underflow/fp16/lost" not in t.callback_metrics
    assert monitor.probe_factor == 2.0**16
