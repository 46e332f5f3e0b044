"""The counting path's numbers against a straightforward reference: one compare per count over the whole tensor, as
the chunked compare-and-count passes computed them before the single-pass histogram. Counts equal, histograms equal,
fractions the same float, on edge tensors (zeros, subnormals of every format, values at and beside each flush and
overflow bound and max, inf, -inf, nan, empty) in bf16, fp16, fp32 and fp64, unscaled, at float and tensor scales."""

import math

import pytest
import torch

from lightning_precision import _single_pass, functional
from lightning_precision.formats import FORMATS
from lightning_precision.functional import (
    HIST_MAX,
    HIST_MIN,
    exponent_histogram,
    gradient_stats,
    multi_format_stats,
    underflow_stats,
)

ELEMENTWISE = ("fp32", "tf32", "bf16", "fp16", "e4m3fn", "e5m2", "e2m1")


def _reference(x: torch.Tensor, fmt: str, scale=None) -> tuple[int, int, int, int, int]:
    """(numel, exact_zero, underflow, overflow, nonfinite) of ``x * scale`` cast to ``fmt``: at least fp32, |x|, the
    scale multiplied in the magnitudes' dtype, the format's bounds compared as Python floats."""
    a = x.detach().reshape(-1)
    a = a.float().abs() if a.element_size() < 4 else a.abs()
    if scale is not None:
        a = a * scale
    f = FORMATS[fmt]
    zeros = int((a == 0).sum())
    finite = int((a <= torch.finfo(a.dtype).max).sum())
    inf = int((a == math.inf).sum())
    under = int((a <= f.flush_bound).sum()) - zeros
    over = int((a >= f.overflow_bound).sum()) - inf
    return a.numel(), zeros, under, over, a.numel() - finite


def _reference_histogram(x: torch.Tensor, scale=1.0) -> torch.Tensor:
    a = x.detach().reshape(-1)
    a = a.float().abs() if a.element_size() < 4 else a.abs()
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        a = a * scale
    a = a[(a != 0) & (a <= torch.finfo(a.dtype).max)].double()
    exponent = torch.frexp(a)[1].long() - 1
    return torch.bincount(exponent.clamp(HIST_MIN, HIST_MAX - 1) - HIST_MIN, minlength=HIST_MAX - HIST_MIN)


def _tuple(s) -> tuple[int, int, int, int, int]:
    return int(s.numel), int(s.exact_zero), int(s.underflow), int(s.overflow), int(s.nonfinite)


def _edge_values() -> list[float]:
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 0.75, 3.0]
    f32 = torch.finfo(torch.float32)
    values += [f32.max, f32.tiny, 2.0**-149, 3 * 2.0**-149, 2.0**-140, 2.0**-127, 2.0**-126 * (1 - 2.0**-23)]
    for name in ELEMENTWISE:
        f = FORMATS[name]
        for v in (f.flush_bound, f.smallest_subnormal, f.smallest_normal, f.max, f.overflow_bound):
            v32 = torch.tensor(v, dtype=torch.float32)
            for near in (v32, torch.nextafter(v32, torch.tensor(0.0)), torch.nextafter(v32, torch.tensor(math.inf))):
                values += [float(near), -float(near), float(near) * 3 / 4, float(near) * 3 / 2]
    # around the fp16 bounds divided by the loss scales below (what `g * S` flushes or overflows)
    for s in (2.0**16, 1000.0, 2.0**-3, 3.0):
        for v in (FORMATS["fp16"].flush_bound / s, FORMATS["fp16"].overflow_bound / s, f32.max / s, 2.0**-149 / s):
            v32 = torch.tensor(v, dtype=torch.float32)
            for k in range(-3, 4):
                near = v32
                for _ in range(abs(k)):
                    near = torch.nextafter(near, torch.tensor(math.inf if k > 0 else 0.0))
                values.append(float(near))
    return values


def _edge(dtype: torch.dtype) -> torch.Tensor:
    x = torch.tensor(_edge_values(), dtype=torch.float64).to(dtype)
    g = torch.Generator().manual_seed(0)
    spread = torch.exp2(torch.empty(3000, dtype=torch.float64).uniform_(-160, 130, generator=g))
    spread *= torch.randint(0, 2, (3000,), generator=g) * 2 - 1
    return torch.cat([x, spread.to(dtype)])


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SCALES = (None, 1.0, 2.0**16, 1000.0, 2.0**-3, torch.tensor(2.0**16), torch.tensor(1000.0), torch.tensor(3.0),
          torch.tensor(2.0**-3), torch.tensor(2.0**100))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=repr)
def test_gradient_stats_equal_the_reference_on_edge_tensors(dtype, scale):
    x = _edge(dtype)
    per_format, scaled, hist = gradient_stats(x, ELEMENTWISE, scale)
    for name in ELEMENTWISE:
        assert _tuple(per_format[name]) == _reference(x, name), name
        ref = _reference(x, name)
        assert per_format[name].underflow_fraction.item() == (ref[2] / max(ref[0], 1))
    if scale is None:
        assert scaled is None
    else:
        assert _tuple(scaled) == _reference(x, "fp16", scale)
    assert torch.equal(hist, _reference_histogram(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", (1.0, 2.0**16, 1000.0, torch.tensor(2.0**16), torch.tensor(1000.0)), ids=repr)
def test_multi_format_stats_and_the_histogram_equal_the_reference(dtype, scale):
    x = _edge(dtype)
    stats = multi_format_stats(x, ELEMENTWISE, scale)
    for name in ELEMENTWISE:
        assert _tuple(stats[name]) == _reference(x, name, scale), name
    for name in ("fp16", "bf16"):
        assert _tuple(underflow_stats({"a": x, "b": x[:7]}, name, scale).per_tensor["a"]) == _reference(x, name, scale)
    assert torch.equal(exponent_histogram(x, scale), _reference_histogram(x, scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_empty_tensor_counts_nothing(dtype):
    x = torch.empty(0, dtype=dtype)
    per_format, scaled, hist = gradient_stats(x, ELEMENTWISE, torch.tensor(2.0**16))
    for name in ELEMENTWISE:
        assert _tuple(per_format[name]) == (0, 0, 0, 0, 0)
        assert per_format[name].underflow_fraction.item() == 0.0
    assert scaled is None  # as before: nothing was scaled
    assert torch.equal(hist, torch.zeros(HIST_MAX - HIST_MIN, dtype=torch.int64))
    assert torch.equal(exponent_histogram(x), hist)


def test_chunks_add_up_to_the_whole(monkeypatch):
    """Counted in chunks smaller than the tensor (a tail shorter than one), the sums are the whole tensor's."""
    monkeypatch.setattr(functional, "CHUNK", 1000)
    for dtype in (torch.float32, torch.bfloat16):
        x = _edge(dtype)
        per_format, scaled, hist = gradient_stats(x, ("fp16", "bf16", "e4m3fn", "e5m2"), torch.tensor(2.0**16))
        for name in ("fp16", "bf16", "e4m3fn", "e5m2"):
            assert _tuple(per_format[name]) == _reference(x, name)
        assert _tuple(scaled) == _reference(x, "fp16", torch.tensor(2.0**16))
        assert torch.equal(hist, _reference_histogram(x))


def test_layouts_and_block_formats_keep_their_numbers():
    """A transposed gradient, a complex one, a sparse one, and a block format beside the elementwise ones."""
    x = _edge(torch.float32)[:3000].reshape(60, 50)
    for t, flat in ((x.t(), x.t().contiguous().reshape(-1)), (torch.complex(x, -x), torch.cat([x, -x], 0)),
                    (x.to_sparse(), x[x != 0])):
        per_format, _, hist = gradient_stats(t, ("fp16", "e4m3fn"))
        assert _tuple(per_format["fp16"]) == _reference(flat, "fp16")
        assert _tuple(per_format["e4m3fn"]) == _reference(flat, "e4m3fn")
        assert torch.equal(hist, _reference_histogram(flat))
    mixed = multi_format_stats(x, ("fp16", "mxfp8"))
    assert _tuple(mixed["fp16"]) == _reference(x, "fp16")
    assert _tuple(mixed["mxfp8"]) == _tuple(multi_format_stats(x, ("mxfp8",))["mxfp8"])


@pytest.mark.parametrize("scale", (torch.tensor(2.0**16), torch.tensor(1000.0), torch.tensor(2.0**-3)), ids=repr)
def test_a_scale_read_only_on_the_device_gives_the_same_numbers(monkeypatch, scale):
    """On a GPU a tensor scale is not read on the host: its bounds stay on the device, each a cut of its own (the path
    run here on the CPU by declaring every tensor scale unreadable)."""
    real = _single_pass._scale_key
    monkeypatch.setattr(_single_pass, "_scale_key", lambda s, d: None if isinstance(s, torch.Tensor) else real(s, d))
    x = _edge(torch.float32)
    per_format, scaled, hist = gradient_stats(x, ELEMENTWISE, scale)
    assert _tuple(scaled) == _reference(x, "fp16", scale)
    assert all(_tuple(per_format[name]) == _reference(x, name) for name in ELEMENTWISE)
    assert torch.equal(hist, _reference_histogram(x))


@pytest.mark.parametrize("scale", (None, 2.0**16, 1000.0, torch.tensor(3.0)), ids=repr)
def test_the_key_steps_at_every_bound_and_power_of_two(scale):
    """The invariant the counts rest on: below each bit pattern asked (a bound, a power of two) the key is smaller."""
    fmts = [FORMATS[n] for n in ELEMENTWISE]
    bounds, plan, keys = _single_pass._plan_for([(fmts, None), ([FORMATS["fp16"]], scale)], torch.device("cpu"))
    queries = torch.cat([bounds.flatten(), _single_pass._POWER_BITS])
    asked = queries[(queries > 0) & (queries <= _single_pass.INF_BITS + 1)]
    assert torch.all(plan.key(asked - 1) < plan.key(asked))
    assert torch.equal(plan.key(queries), keys.int())
    every = torch.arange(0, 2**31 - 1, 4099, dtype=torch.int32)  # and it never decreases
    assert torch.all(plan.key(every)[1:] >= plan.key(every)[:-1])


def test_a_scale_per_element_is_multiplied_in_as_before():
    x = _edge(torch.float32)[:500]
    scale = torch.exp2(torch.arange(500, dtype=torch.float32) % 40 - 20)
    stats = multi_format_stats(x, ("fp16", "e4m3fn"), scale)
    assert _tuple(stats["fp16"]) == _reference(x, "fp16", scale)
    assert _tuple(stats["e4m3fn"]) == _reference(x, "e4m3fn", scale)
