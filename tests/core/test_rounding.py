"""The rounding functions of the true-precision step (lightning_precision/_core/true/rounding.py), on plain tensors."""

import pytest
import torch

from lightning_precision._core.true.rounding import join_remainder, split_remainder, stochastic_round

DTYPES = [torch.bfloat16, torch.float16]
DRAWS = 200_000


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [1 + 1e-4, -(1 + 1e-4), 3.3e-3, -777.7, 3.13e-6, -7.7e-8, 7e-5],
                         ids=lambda v: f"{v:g}")
def test_stochastic_round_is_unbiased(dtype, value):
    # 1 + 1e-4 is far under half an ulp of 1.0 in both formats (bf16: 2**-8, fp16: 2**-11): rounded to nearest it is
    # 1.0, stochastically it lands above 1.0 in proportion, so the mean of many draws is the value.
    x = torch.full((DRAWS,), value, dtype=torch.float32)
    rounded = stochastic_round(x, dtype, _gen())
    assert rounded.dtype == dtype
    lower, upper = rounded.float().min(), rounded.float().max()
    assert lower < value < upper  # the two neighbours, and only those
    assert set(rounded.float().unique().tolist()) == {lower.item(), upper.item()}
    gap = (upper - lower).item()
    p = (value - lower.item()) / gap
    # The mean of DRAWS Bernoulli(p) draws times the gap: within 5 standard deviations of the value.
    tolerance = 5 * gap * (p * (1 - p) / DRAWS) ** 0.5
    mean = rounded.double().mean().item()
    assert abs(mean - value) < tolerance, (mean, value, tolerance)
    nearest = torch.tensor(value).to(dtype).double().item()
    assert abs(nearest - value) > 10 * tolerance  # what rounding to nearest would give is far off


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stochastic_round_keeps_exact_values_and_non_finite_ones(dtype):
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 0.125, 1024.0, 2.0**-14, 2.0**-24, -3 * 2.0**-24, 65504.0]).to(dtype)
    many = exact.float().repeat(1000)
    assert torch.equal(stochastic_round(many, dtype, _gen()), exact.repeat(1000))
    special = torch.tensor([float("inf"), -float("inf"), float("nan")]).repeat(100)
    out = stochastic_round(special, dtype, _gen()).float()
    assert torch.isposinf(out[0::3]).all() and torch.isneginf(out[1::3]).all() and torch.isnan(out[2::3]).all()


def test_stochastic_round_is_reproducible_from_its_generator():
    x = torch.randn(1000) * 1e-3 + 1
    for dtype in DTYPES:
        a, b = stochastic_round(x, dtype, _gen(3)), stochastic_round(x, dtype, _gen(3))
        assert torch.equal(a, b)
        assert not torch.equal(a, stochastic_round(x, dtype, _gen(4)))


def test_fp16_stochastic_round_beyond_the_largest_value_stays_finite_or_overflows_honestly():
    # Between 65504 (fp16's largest) and inf: rounds to one of them, never NaN.
    x = torch.full((10_000,), 65504.0 + 8.0)
    out = stochastic_round(x, torch.float16, _gen()).float()
    assert not torch.isnan(out).any()
    assert set(out.unique().tolist()) <= {65504.0, float("inf")}


def _over_many_decades(n: int = 200_000) -> torch.Tensor:
    g = _gen(5)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return sign * torch.exp2(torch.empty(n).uniform_(-120, 120, generator=g)) * (1 + torch.rand(n, generator=g))


def test_bf16_split_and_join_give_back_fp32_exactly():
    x = torch.cat([_over_many_decades(), torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-45, 1.17549435e-38])])
    weight, remainder = split_remainder(x, torch.bfloat16)
    assert weight.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_remainder(weight, remainder).view(torch.int32), x.view(torch.int32))  # every bit
    # The weight is a nearest bf16 (a tie may go the other way than torch's cast): as close as torch's own rounding.
    finite = x.abs() < 3e38
    error = (weight.float() - x).abs()[finite]
    assert (error <= (x.bfloat16().float() - x).abs()[finite]).all()
    assert (weight != x.bfloat16())[finite].float().mean() < 1e-3  # ties only


def test_fp16_join_within_2_pow_minus_18_relative_in_the_normal_range():
    g = _gen(6)
    n = 200_000
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = sign * torch.exp2(torch.empty(n).uniform_(-14, 15, generator=g)) * (1 + torch.rand(n, generator=g) * 0.99)
    x = x[x.abs() < 65000]
    weight, remainder = split_remainder(x, torch.float16)
    assert weight.dtype == torch.float16 and remainder.dtype == torch.int16
    assert torch.equal(weight, x.half())  # the weight is fp16's own nearest
    relative = ((join_remainder(weight, remainder) - x).abs() / x.abs()).max().item()
    assert relative <= 2**-18, relative
    plain = ((x.half().float() - x).abs() / x.abs()).max().item()
    assert plain > 2**-12  # without the remainder: fp16's 11 bits
