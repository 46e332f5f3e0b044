"""Block-scaled formats (MXFP8, NVFP4): the cast, and the statistics that count what it loses, against torchao's own
reference casts (``to_mx``, ``nvfp4_quantize``), which run on a CPU."""

from __future__ import annotations

import importlib

import pytest
import torch

from lightning_precision.formats import BLOCK_FORMATS, FORMATS, BlockFormat, get_format
from lightning_precision.functional import (
    CHUNK,
    multi_format_stats,
    multi_scale_stats,
    recommend_loss_scale,
    underflow_stats,
)

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")


def _torchao(*names: str):
    """torchao moved its fp4 helpers between releases (``custom_cast`` up to 0.11, ``kernels`` after)."""
    for module in ("torchao.prototype.mx_formats.kernels", "torchao.prototype.mx_formats.custom_cast"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if all(hasattr(mod, n) for n in names):
            return [getattr(mod, n) for n in names]
    pytest.skip(f"this torchao has none of {names}")


def _wide_rows(rows: int = 64, cols: int = 256) -> torch.Tensor:
    """Rows whose magnitudes span 2**-40 .. 2**20 with a spread of 2**+-9 inside each: many blocks flush some
    elements, some saturate under the floor rule."""
    g = torch.Generator().manual_seed(0)
    row_scale = torch.exp2(torch.randint(-40, 20, (rows, 1), generator=g).float())
    return torch.randn(rows, cols, generator=g) * row_scale * torch.exp2(torch.randn(rows, cols, generator=g) * 3)


@pytest.mark.parametrize(("name", "mode"), [("mxfp8", "RCEIL"), ("mxfp8_floor", "FLOOR")])
def test_mxfp8_equals_torchao_to_mx(name: str, mode: str) -> None:
    """The cast is torchao's element for element, and the counts are what that cast flushes and saturates."""
    x = _wide_rows()
    scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, getattr(mx_tensor.ScaleCalculationMode, mode))
    theirs = (data.float().view(-1, 32) * mx_tensor.get_fp_scale(scale).float().view(-1, 1)).view_as(x)
    assert torch.equal(get_format(name).cast(x), theirs)

    stats = underflow_stats(x, name).total
    assert stats.underflow.item() == ((theirs == 0) & (x != 0)).sum().item() > 0
    # Overflow: saturated with an error beyond rounding, |x * m| >= 464 before the clamp to 448.
    m = get_format(name).block_multipliers(x.abs().view(-1, 32).amax(-1))[:, None]
    assert stats.overflow.item() == ((x.abs().view(-1, 32) * m) >= 464).sum().item()
    if name == "mxfp8":
        assert stats.overflow.item() == 0  # rounding the scale up leaves every block's amax at most 448
    else:
        assert stats.overflow.item() > 0  # the OCP floor rule puts amax in [256, 512): the top saturates


def test_nvfp4_equals_torchao_nvfp4_quantize() -> None:
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor", reason="this torchao has no NVFP4")
    unpack_uint4, f4_unpacked_to_f32 = _torchao("unpack_uint4", "f4_unpacked_to_f32")
    x = _wide_rows()
    amax = x.abs().amax()
    _, packed = nvfp4.nvfp4_quantize(x, 16, nvfp4.per_tensor_amax_to_scale(amax))
    theirs = f4_unpacked_to_f32(unpack_uint4(packed.contiguous().view(torch.uint8))).view(-1, 16)

    f = get_format("nvfp4")
    blocks = x.view(-1, 16)
    ours = f.element.cast(blocks * f.block_multipliers(blocks.abs().amax(-1), amax)[:, None])
    assert torch.equal(ours, theirs)
    stats = underflow_stats(x, "nvfp4").total
    assert stats.underflow.item() == ((theirs == 0) & (blocks != 0)).sum().item() > 0
    assert stats.overflow.item() == 0


def test_e2m1_rounds_as_torchao() -> None:
    """fp4's grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6: ties go to the even code (0.25 -> 0, 0.75 -> 1, 5 -> 4), past 6 it
    saturates."""
    (f32_to_f4_unpacked, f4_unpacked_to_f32) = _torchao("f32_to_f4_unpacked", "f4_unpacked_to_f32")
    x = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.74, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 6.0, 6.9, 7.0, 1e9])
    x = torch.cat([x, -x])
    e2m1 = FORMATS["e2m1"]
    assert torch.equal(e2m1.cast(x), f4_unpacked_to_f32(f32_to_f4_unpacked(x)))
    assert e2m1.flush_bound == 0.25 and e2m1.overflow_bound == 7.0


def test_one_outlier_flushes_its_block_only() -> None:
    """What a block scale means: a 1000 in a block of 1e-3s sets the scale 2**-2 (rceil: 1000/448 -> 4), so the
    1e-3s fall to 2.5e-4, under e4m3's flush bound 2**-10; the next block, alone at 1e-3, keeps every value."""
    x = torch.full((64,), 1e-3)
    x[0] = 1000.0
    stats = underflow_stats(x, "mxfp8").total
    assert stats.underflow.item() == 31
    assert underflow_stats(x, "e4m3fn").total.underflow.item() == 0  # elementwise, unscaled: nothing flushes
    cast = get_format("mxfp8").cast(x)
    assert (cast[1:32] == 0).all() and (cast[32:] != 0).all()


def test_chunks_and_a_ragged_tail_count_as_one_tensor() -> None:
    """Blocks run in memory order across chunk boundaries (CHUNK is a multiple of every block size), and a tail shorter
    than a block is a block of its own."""
    n = CHUNK + 37
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * torch.exp2(torch.randint(-30, 30, (n,)).float())
    stats = multi_format_stats(x, ("mxfp8", "nvfp4"))
    for name, s in stats.items():
        f = get_format(name)
        pad = -n % f.block_size
        blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, f.block_size)
        amax = x.abs().amax() if f.tensor_scale else None
        scaled = (blocks.abs() * f.block_multipliers(blocks.abs().amax(-1), amax)[:, None]).view(-1)[:n]
        assert s.underflow.item() == ((scaled <= f.element.flush_bound) & (x != 0)).sum().item() > 0
        assert s.numel.item() == n


def test_non_finite_values_set_no_scale() -> None:
    """An inf is counted as non-finite, not as overflow, and does not drag its block's scale to nothing."""
    x = torch.ones(32)
    x[3] = float("inf")
    x[5] = float("nan")
    s = underflow_stats(x, "mxfp8").total
    assert (s.nonfinite.item(), s.underflow.item(), s.overflow.item()) == (2, 0, 0)


def test_block_formats_in_the_table_and_refused_where_one_scale_is_meant() -> None:
    assert isinstance(get_format("MXFP8"), BlockFormat) and set(BLOCK_FORMATS) == {"mxfp8", "mxfp8_floor", "nvfp4"}
    assert get_format("nvfp4").bits == 4.5 and get_format("mxfp8").bits == 8.25
    with pytest.raises(ValueError, match="scales each block of 32"):
        multi_scale_stats(torch.ones(4), "mxfp8", [1.0])
    with pytest.raises(ValueError, match="nvfp4"):
        recommend_loss_scale(torch.zeros(279, dtype=torch.int64), fmt="nvfp4")
    with pytest.raises(ValueError, match="multiple of 16"):
        get_format("nvfp4").cast(torch.ones(3, 8))
