"""Number formats and underflow_stats against hand-computed cases: underflow is the real cast."""

import math

import pytest
import torch

from lightning_precision.formats import FORMATS, format_table, get_format
from lightning_precision.functional import (
    HIST_MIN,
    LossScaleAdvice,
    exponent_histogram,
    recommend_loss_scale,
    underflow_stats,
)


@pytest.mark.parametrize(
    ("name", "exp", "man", "max_", "normal", "subnormal"),
    [
        ("fp32", 8, 23, torch.finfo(torch.float32).max, 2.0**-126, 2.0**-149),
        ("tf32", 8, 10, (2 - 2.0**-10) * 2.0**127, 2.0**-126, 2.0**-136),
        ("bf16", 8, 7, torch.finfo(torch.bfloat16).max, 2.0**-126, 2.0**-133),
        ("fp16", 5, 10, 65504.0, 2.0**-14, 2.0**-24),
        ("e4m3fn", 4, 3, 448.0, 2.0**-6, 2.0**-9),
        ("e5m2", 5, 2, 57344.0, 2.0**-14, 2.0**-16),
    ],
)
def test_format_table(name, exp, man, max_, normal, subnormal):
    f = FORMATS[name]
    assert (f.exponent_bits, f.mantissa_bits, f.max, f.smallest_normal, f.smallest_subnormal) == (exp, man, max_, normal, subnormal)
    assert f.eps == 2.0**-man
    assert f.bits == (torch.finfo(f.dtype).bits if f.dtype is not None else 19)
    if f.dtype is not None:  # the smallest subnormal really is the last non-zero value of the cast
        assert torch.tensor(subnormal).to(f.dtype).float().item() == subnormal
        assert torch.tensor(subnormal / 2).to(f.dtype).float().item() == 0.0  # a tie, to even: zero


def test_get_format_accepts_names_aliases_and_dtypes():
    assert get_format("half") is get_format(torch.float16) is FORMATS["fp16"]
    assert get_format("fp8_e4m3") is FORMATS["e4m3fn"]
    with pytest.raises(ValueError, match=r"Unknown number format 'fp12'.*fp16"):
        get_format("fp12")
    assert "| e5m2 | 8 | 5 | 2 | 57344 |" in format_table()


def test_tf32_cast_rounds_to_10_mantissa_bits():
    x = torch.tensor([1 + 2.0**-10, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-12, -(1 + 2.0**-10)])
    # 1+2^-11 is a tie between 1 and 1+2^-10: to even (1); 1+3*2^-11 ties up to 1+2^-9.
    expected = torch.tensor([1 + 2.0**-10, 1.0, 1 + 2.0**-9, 1.0, -(1 + 2.0**-10)])
    assert torch.equal(FORMATS["tf32"].cast(x), expected)


def _counts(values, fmt, scale=1.0):
    t = underflow_stats(torch.tensor(values, dtype=torch.float32), fmt, scale).total
    return int(t.numel), int(t.exact_zero), int(t.underflow), int(t.overflow), int(t.nonfinite)


def test_fp16_underflow_is_the_real_cast_not_a_threshold():
    values = [
        0.0,  # exact zero: not underflow
        2.0**-26,  # flushes
        2.0**-25,  # exactly half the smallest subnormal: ties to even, flushes
        1.5 * 2.0**-25,  # between 2^-25 and 2^-24: rounds UP to 2^-24, a "< 2^-24" threshold would wrongly count it
        2.0**-24,  # smallest subnormal: survives
        2.0**-20,  # subnormal: survives
        -(2.0**-30),  # negative, flushes
        70000.0,  # overflows to inf
        65510.0,  # rounds to 65504: not overflow
        float("inf"),
        float("nan"),
    ]
    assert _counts(values, "fp16") == (11, 1, 3, 1, 2)


def test_loss_scale_is_applied_before_the_cast():
    values = [2.0**-26, 2.0**-30, 2.0**-40, 1000.0]
    assert _counts(values, "fp16") == (4, 0, 3, 0, 0)
    # x 2^10: 2^-16 and 2^-20 survive, 2^-30 still flushes; 1000 * 1024 overflows.
    assert _counts(values, "fp16", scale=2.0**10) == (4, 0, 1, 1, 0)
    # a device tensor works as the scale (no synchronisation)
    assert _counts(values, "fp16", scale=torch.tensor(2.0**10)) == (4, 0, 1, 1, 0)


def test_bf16_and_fp8_cases():
    assert _counts([2.0**-133, 2.0**-134, 2.0**-135, 1e38], "bf16") == (4, 0, 2, 0, 0)
    # e4m3fn has no inf: 450 rounds to 448 (rounding, not overflow); 464 (the tie above 448) and 500 saturate to 448:
    # overflow. 2^-10 ties to zero, 2^-9 survives.
    assert _counts([2.0**-9, 2.0**-10, 2.0**-12, 448.0, 450.0, 464.0, 500.0], "e4m3fn") == (7, 0, 2, 2, 0)
    # e5m2: 60000 rounds to 57344 (not overflow), 70000 is inf; 2^-17 ties to zero.
    assert _counts([2.0**-16, 2.0**-17, 60000.0, 70000.0], "e5m2") == (4, 0, 1, 1, 0)


def test_per_tensor_and_total_with_names_and_fractions():
    report = underflow_stats({"a": torch.tensor([0.0, 2.0**-30]), "b": torch.tensor([1.0, 2.0, 3.0, 2.0**-40])}, "fp16")
    assert set(report.per_tensor) == {"a", "b"}
    assert int(report.per_tensor["a"].underflow) == 1 and int(report.per_tensor["b"].underflow) == 1
    assert float(report.total.underflow_fraction) == pytest.approx(2 / 6)
    assert float(report.total.exact_zero_fraction) == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match=r"scale=0.*> 0"):
        underflow_stats(torch.ones(2), "fp16", scale=0)


def test_exponent_histogram_and_recommendation():
    g = torch.tensor([2.0**-30] * 10 + [2.0**-10] * 90 + [0.0, float("inf")])
    hist = exponent_histogram(g)
    assert int(hist.sum()) == 100  # zeros and inf are not in it
    assert int(hist[-30 - HIST_MIN]) == 10 and int(hist[-10 - HIST_MIN]) == 90
    # 2^-30 needs x 2^5 to reach 2^-25 (whose bin rounds up to 2^-24) in fp16; 2^-10 * 2^5 is far from overflow.
    scale, under, over = recommend_loss_scale(hist, target_underflow=0.0)
    assert (scale, under, over) == (2.0**5, 0.0, 0.0)
    # allowing 10% to flush, the scale only has to keep 2^-10 alive: 2^-10 * 2^-15 = 2^-25 rounds up to 2^-24
    assert recommend_loss_scale(hist, target_underflow=0.2)[:2] == (2.0**-15, 0.1)
    assert math.isclose(recommend_loss_scale(hist, target_underflow=0.0, fmt="bf16")[0], 2.0**-24)


def test_recommend_loss_scale_names_its_fields_and_still_unpacks():
    hist = exponent_histogram(torch.tensor([2.0**-30] * 10 + [2.0**-10] * 90))
    advice = recommend_loss_scale(hist, target_underflow=0.2)
    assert isinstance(advice, LossScaleAdvice) and LossScaleAdvice._fields == ("scale", "underflow", "overflow")
    assert (advice.scale, advice.underflow, advice.overflow) == (2.0**-15, 0.1, 0.0)
    scale, underflow, overflow = advice  # callers that unpacked the plain tuple keep working
    assert (scale, underflow, overflow) == advice == (2.0**-15, 0.1, 0.0)
    assert recommend_loss_scale(torch.zeros_like(hist)) == LossScaleAdvice(scale=1.0, underflow=0.0, overflow=0.0)


@pytest.mark.parametrize("name", ["fp16", "bf16", "e4m3fn", "e5m2", "tf32"])
def test_counts_equal_the_real_cast_element_for_element(name):
    """underflow_stats uses the cast's rounding boundaries for speed: they must agree with the real cast everywhere,
    above all at the boundaries (ties, the values just beside them) and across the whole exponent range."""
    f = FORMATS[name]
    edges = [f.flush_bound, f.smallest_subnormal, f.overflow_bound, f.max]
    around = [torch.tensor(e, dtype=torch.float32) for e in edges]
    near = torch.cat([torch.stack([torch.nextafter(t, torch.tensor(0.0)), t, torch.nextafter(t, torch.tensor(float("inf")))]) for t in around])
    g = torch.Generator().manual_seed(0)
    sweep = torch.exp2(torch.empty(200_000).uniform_(-150, 128, generator=g)) * torch.empty(200_000).uniform_(1, 2, generator=g)
    x = torch.cat([near, -near, sweep, -sweep, torch.tensor([0.0, float("inf"), float("nan")])])
    x = x[torch.isfinite(x) | torch.isnan(x) | torch.isinf(x)]
    cast = f.cast(x)
    finite = torch.isfinite(x)
    real_under = int((finite & (x != 0) & (cast == 0)).sum())
    if f.has_inf:
        real_over = int((finite & ~torch.isfinite(cast)).sum())
    else:  # saturation (the cast lands on max with an error of half an ulp or more), or nan on older torch (2.7)
        half_ulp = 2.0 ** (f.max_exponent - f.mantissa_bits) / 2
        saturated = (cast.abs() == f.max) & ((x - cast).abs() >= half_ulp)
        real_over = int((finite & (saturated | torch.isnan(cast))).sum())
    stats = underflow_stats(x, f).total
    assert (int(stats.underflow), int(stats.overflow)) == (real_under, real_over)
    assert real_under > 0 and real_over > 0  # the sweep reaches both sides


def test_fp64_values_beyond_fp32_land_in_their_own_exponent_bin():
    """fp64 gradients are histogrammed in fp64: 1e-60 lies below fp32's range and once landed in the bin of [0.5, 1)."""
    from lightning_precision.functional import HIST_MIN, gradient_stats

    tiny = torch.tensor([1e-60, 0.75], dtype=torch.float64)
    hist = gradient_stats(tiny, ("fp16",))[2]
    expected = torch.zeros_like(hist)
    expected[max(0, math.floor(math.log2(1e-60)) - HIST_MIN)] += 1  # clamped into the first bin if below the range
    expected[-1 - HIST_MIN] += 1  # 0.75 in [0.5, 1)
    assert torch.equal(hist, expected)
    assert torch.equal(exponent_histogram(tiny), hist)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda h: recommend_loss_scale(h, target_underflow=-1), r"target_underflow=-1\).*\[0, 1\]"),
        (lambda h: recommend_loss_scale(h, target_underflow=1.5), r"target_underflow=1\.5\).*\[0, 1\]"),
        (lambda h: recommend_loss_scale(h, target_underflow=float("nan")), r"target_underflow=nan\)"),
        (lambda h: recommend_loss_scale(h, max_log2_scale=200), r"max_log2_scale=200\).*2\*\*126.*\[0, 126\]"),
        (lambda h: recommend_loss_scale(h, max_log2_scale=-3), r"max_log2_scale=-3\).*\[0, 126\]"),
        (lambda h: recommend_loss_scale(h, max_log2_scale=2.5), r"max_log2_scale=2\.5\).*an int"),
    ],
)
def test_recommend_loss_scale_refuses_arguments_it_cannot_honour(call, match):
    # Before: -1 recommended the largest safe scale as if nothing fit; 200 recommended 2**200-sized scales the loss
    # scaler refuses (its bounds are 2**+-126); -3 failed with an IndexError.
    with pytest.raises(ValueError, match=match):
        call(exponent_histogram(torch.tensor([2.0**-40, 2.0**-10])))


def test_delayed_scale_and_roll_amax_history_refuse_what_has_no_meaning():
    from lightning_precision.functional import delayed_scale, roll_amax_history

    for margin in (-1, float("nan"), None):  # -1 doubled the scale past fp8_max: every amax value saturated
        with pytest.raises(ValueError, match=rf"delayed_scale\(margin={margin!r}\).*>= 0"):
            delayed_scale(torch.tensor([14.0]), 448.0, margin=margin)
    assert delayed_scale(torch.tensor([14.0]), 448.0, margin=1).tolist() == [16.0]
    for empty in (torch.zeros(0, 3), torch.tensor(1.0)):  # amax over no step: a raw reduction error before
        with pytest.raises(ValueError, match=r"roll_amax_history\(history of shape .*at least one row"):
            roll_amax_history(empty)
    rolled, amax = roll_amax_history(torch.zeros(4, 0))  # no GEMMs yet: nothing to reduce, nothing refused
    assert rolled.shape == (4, 0) and amax.shape == (0,)
