"""The probe measures every candidate format: block formats (MXFP8, NVFP4, Transformer Engine's 1x128 / 128x128 blocks)
with their real casts, several formats in one pass (``MultiProbe``, ``measure_candidates``) each giving the numbers it
gives alone, and the tokens a layer processed per batch (the speed model's M). Real torchao (emulated) for the
per-tensor and per-row formats; the block casts are ``lightning_precision.formats``' own.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

from lightning_precision.formats import get_format
from lightning_precision.fp8 import MXFP8Recipe
from lightning_precision.fp8._sensitivity import (
    MultiProbe,
    SensitivityProbe,
    fp8_sensitivity,
    measure_candidates,
    probe_config,
)
from tests.fp8.test_sensitivity_equal import Routed, edge_batches, figures, loss_of

pytest.importorskip("torchao")

ALL = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "current", "mxfp8", "nvfp4", "block")


# ---- the block casts, against a straightforward reference --------------------------------------------------------------


def te_block_cast(t: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """Transformer Engine's Float8BlockScaling cast written out tile by tile: e4m3, scale 448 / amax rounded down to a
    power of two (1 for an all-zero tile), tiles of ``tile_rows`` x 128, partial at the edges."""
    out = torch.empty_like(t)
    for i in range(0, t.shape[0], tile_rows):
        for j in range(0, t.shape[1], 128):
            tile = t[i : i + tile_rows, j : j + 128]
            amax = tile.abs().max().item()
            scale = 2.0 ** math.floor(math.log2(448.0 / amax)) if amax > 0 else 1.0
            out[i : i + tile_rows, j : j + 128] = (tile * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale
    return out


def casts_of(name: str):
    """(input cast, weight cast for the output, weight cast for the input gradient, output-gradient cast) of a format,
    each on 2-d fp32 tensors: for the output the weight is cast along K, for the input gradient ``w.t()`` along N."""
    if name == "block":
        return (lambda x: te_block_cast(x, 1), lambda w: te_block_cast(w, 128), lambda w: te_block_cast(w, 128),
                lambda g: te_block_cast(g, 1))
    cast = get_format(name).cast
    return cast, cast, lambda w: cast(w.t().contiguous()).t(), cast


def fields(t: torch.Tensor, cast) -> tuple[float, float, float]:
    """(SQNR dB, underflow fraction, overflow fraction) of a cast, the plain way."""
    x = t.detach().float().reshape(-1, t.shape[-1])
    finite = torch.isfinite(x)
    x = torch.where(finite, x, torch.zeros_like(x))
    q = cast(x)
    signal, noise = x.double().pow(2).sum().item(), (q - x).double().pow(2).sum().item()
    nonzero = x != 0
    return (10 * math.log10(signal / noise), (nonzero & (q == 0)).sum().item() / nonzero.sum().item(),
            (~finite).sum().item() / x.numel())


def relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return math.sqrt((a.float() - ref).double().pow(2).sum().item() / ref.double().pow(2).sum().item())


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "block"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_block_casts_measure_what_the_format_casts_and_a_plain_matmul_give(name, autocast):
    """One layer, one batch of (batch, tokens, features) inputs, a known output gradient: every figure is the one the
    formats' casts and ``F.linear`` give written out (TE's blocks: tile by tile, dims 128 does not divide)."""
    torch.manual_seed(0)
    layer = nn.Linear(192, 96) if name == "block" else nn.Linear(64, 96)
    x = torch.randn(2, 5, layer.in_features) * torch.logspace(-3, 2, layer.in_features)  # a spread of magnitudes
    x[0, 0, :7] = 0.0
    x[1, 2, 5] = 3e5  # an outlier: its block's small values flush
    r = torch.randn(2, 5, layer.out_features)
    probe = SensitivityProbe({"l": layer}, name)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = layer(x)
    (y.float() * r).sum().backward()
    probe.close()
    s = probe.result()["l"]

    dtype = y.dtype
    g = r.to(dtype).float().reshape(-1, layer.out_features)  # the gradient the layer's output received
    xin = x.to(dtype).float().reshape(-1, layer.in_features)  # what its GEMM reads (bf16 under autocast)
    w, b = layer.weight.detach(), layer.bias.detach()
    cast_x, cast_w, cast_wt, cast_g = casts_of(name)
    out = nn.functional.linear(cast_x(xin), cast_w(w), b).to(dtype)
    gin = (cast_g(g) @ cast_wt(w)).to(dtype)
    ref = nn.functional.linear(x.reshape(-1, layer.in_features), w, b)  # fp32, from the input the layer was given
    assert s.output_error == pytest.approx(relative(out, ref), rel=1e-9)
    assert s.grad_input_error == pytest.approx(relative(gin, g @ w), rel=1e-9)
    for measured, tensor, cast in ((s.input, xin, cast_x), (s.weight, w, cast_w), (s.grad_output, g, cast_g)):
        sqnr, under, over = fields(tensor, cast)
        assert measured.sqnr_db == pytest.approx(sqnr, rel=1e-9)
        assert (measured.underflow, measured.overflow) == (pytest.approx(under, rel=1e-12), over)
    assert s.batches == 1 and s.tokens == 10.0
    assert s.input.underflow > 0  # the edge is exercised


def test_mxfp8_recipe_mxfp8_name_and_probe_config_measure_the_same():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    data = [torch.randn(8, 64) for _ in range(2)]
    loss = lambda m, b: m(b).float().pow(2).mean()  # noqa: E731
    assert isinstance(probe_config("mxfp8"), MXFP8Recipe)
    by_name = fp8_sensitivity(model, data, "mxfp8", loss_fn=loss)
    assert by_name == fp8_sensitivity(model, data, MXFP8Recipe(), loss_fn=loss)
    assert by_name == measure_candidates(model, data, ("mxfp8",), loss_fn=loss)["mxfp8"]
    # A format's name measures as its config does (what FP8Guard passes per layer format).
    for name, config in (("tensorwise", probe_config("tensorwise")), ("mxfp8", MXFP8Recipe())):
        probes = [SensitivityProbe({"0": model[0]}, c) for c in (name, config)]
        loss(model, data[0]).backward()
        for probe in probes:
            probe.close()
        assert probes[0].result() == probes[1].result() != {}
    assert set(by_name) == {"0", "2"}


# ---- several formats in one pass ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_multiprobe_gives_each_candidate_the_numbers_it_gets_alone(autocast):
    """Routed's layers (outlier channels, a 3-d input, an expert idle in one batch, batches with inf and nan) under a
    ``MultiProbe`` of every candidate and, on the same passes, one ``SensitivityProbe`` per format: the same floats,
    the same batches kept and dropped (the non-finite ones, for every candidate)."""
    from tests.fp8.test_sensitivity_equal import skip_where_torchao_rowwise_cannot_autocast

    candidates = ALL
    if autocast is not None:
        try:
            skip_where_torchao_rowwise_cannot_autocast()
        except pytest.skip.Exception:
            candidates = tuple(c for c in ALL if not c.startswith("rowwise"))
    model = Routed()
    layers = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    multi = MultiProbe(layers, candidates, keep_outputs=True)
    alone = {c: SensitivityProbe(layers, c) for c in candidates}
    for batch in edge_batches():
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_of(model, batch)
        outputs, multi.outputs = multi.outputs, []
        torch.autograd.grad(loss, outputs, allow_unused=True)
        multi.commit()
        for probe in alone.values():
            probe.commit()
    multi.close()
    measured = multi.result()
    assert list(measured) == list(candidates)
    for name, probe in alone.items():
        probe.close()
        expected = probe.result()
        assert figures(measured[name]) == figures(expected), name
        assert (probe.batches, probe.dropped) == (multi.batches, multi.dropped) == (5, 2)
        assert multi.skipped[name] == probe.skipped
    assert figures(measured["delayed"]) == figures(measured["tensorwise"]) == figures(measured["current"])
    # Blocks of 32 do not divide 16 (`tokens`) or 48 (`b`'s output, `head`'s input): MXFP8 cannot run them.
    assert set(multi.skipped["mxfp8"]) == {"tokens", "b", "head"} and set(measured["mxfp8"]) == {"a", "expert"}
    assert "32 does not divide 64 x 48" in multi.skipped["mxfp8"]["b"]
    assert set(measured["nvfp4"]) == set(layers) and not multi.skipped["nvfp4"]


def test_measure_candidates_is_one_pass_and_equals_fp8_sensitivity_per_recipe():
    """One forward per batch for every candidate (the loss function counts them), each candidate's numbers
    ``fp8_sensitivity``'s for that recipe; the non-finite batch is left out of every candidate, with one warning."""
    model = Routed()
    data = edge_batches()[:4]  # the third has an idle expert, the fourth an inf
    calls = []

    def loss_fn(m, b):
        calls.append(1)
        return loss_of(m, b)

    with pytest.warns(UserWarning, match=r"measure_candidates: 1 of 4 batches had a non-finite") as seen:
        measured = measure_candidates(model, data, ("tensorwise", "mxfp8", "nvfp4"), loss_fn=loss_fn)
    assert len(calls) == 4 and len([w for w in seen if "non-finite" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for recipe in ("tensorwise", "mxfp8"):
            assert figures(measured[recipe]) == figures(fp8_sensitivity(model, data, recipe, loss_fn=loss_of))
    assert all(s.batches == 3 for numbers in measured.values() for s in numbers.values())


def test_tokens_is_the_mean_rows_per_committed_batch():
    """``a`` reads 24 rows a batch, ``tokens`` 96 (a (24, 4, 16) input), the expert the rows routed to it (none in
    one batch); the dropped batches do not count."""
    model = Routed()
    data = edge_batches()
    finite = [b for b in data if torch.isfinite(b[0]).all()]
    routed = sum(int(route.sum()) for _, route in finite)
    with pytest.warns(UserWarning, match="2 of 7 batches"):
        measured = measure_candidates(model, data, ("tensorwise", "nvfp4"), loss_fn=loss_of)
    for numbers in measured.values():
        assert numbers["a"].tokens == 24.0 and numbers["tokens"].tokens == 96.0
        assert numbers["expert"].tokens == pytest.approx(routed / len(finite)) and numbers["expert"].batches == 5


def test_an_outlier_channel_layer_errs_less_in_mxfp8_blocks_than_in_one_tensorwise_scale():
    """Two input channels 1e5 times the others, which the layer's weights scale back (what it computes comes from the
    other channels). One tensorwise scale is set by the outliers and flushes most other values; MXFP8's blocks of 32
    confine that to the outliers' block; TE's 1x128 blocks here span a whole row (K = 128), as rowwise does.
    Measured (torch 2.13, torchao 0.18, CPU, fp32): input underflow tensorwise 0.44, rowwise 0.28, block 0.28,
    mxfp8 0.067; output error tensorwise 0.35, rowwise 0.24, block 0.24, mxfp8 0.13."""
    torch.manual_seed(0)
    layer = nn.Linear(128, 64)
    with torch.no_grad():
        layer.weight[:, [3, 7]] /= 1e5
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(2):
        x = torch.randn(32, 128, generator=g)
        x[:, [3, 7]] *= 1e5
        data.append(x)
    measured = measure_candidates(layer, data, ("tensorwise", "rowwise", "mxfp8", "block"),
                                  loss_fn=lambda m, x: m(x).float().pow(2).mean(), autocast_dtype=None)
    s = {name: numbers[""] for name, numbers in measured.items()}
    assert s["mxfp8"].output_error < s["block"].output_error < s["tensorwise"].output_error
    assert s["mxfp8"].output_error < 0.5 * s["tensorwise"].output_error
    assert s["mxfp8"].input.underflow < 0.25 * s["tensorwise"].input.underflow
    assert s["block"].input.underflow == pytest.approx(s["rowwise"].input.underflow)  # a 1x128 block is a row here


# ---- edges --------------------------------------------------------------------------------------------------------------


def test_an_idle_expert_call_is_not_measured_by_any_format():
    """An expert called on no tokens beside a dense layer: in the batch it only ran idle it is not measured (no cast
    of an empty tensor, no error), in the next its call with tokens is, by every format, and its tokens are the mean
    over both committed batches."""
    torch.manual_seed(0)
    dense, expert = nn.Linear(64, 64), nn.Linear(64, 64)
    names = ("tensorwise", "mxfp8", "nvfp4", "block")
    multi = MultiProbe({"dense": dense, "expert": expert}, names)
    expert(dense(torch.randn(8, 64))[:0]).sum().backward()  # no token routed to the expert
    multi.commit()
    assert multi.ran and all(list(numbers) == ["dense"] for numbers in multi.result().values())
    h = dense(torch.randn(8, 64))
    (expert(h[:0]).sum() + expert(h).pow(2).sum()).backward()  # an idle call and one with 8 tokens
    multi.close()
    measured = multi.result()
    assert all(numbers["expert"].tokens == 4.0 and numbers["dense"].tokens == 8.0 for numbers in measured.values())
    assert multi.batches == 2 and multi.dropped == 0


def test_a_layer_whose_dims_the_block_does_not_divide_cannot_run_the_format():
    """MXFP8 casts blocks of 32, NVFP4 of 16: a 48 x 40 layer runs neither and is left out of their numbers (and said
    why in ``skipped``), while the per-tensor formats measure it; fp8_sensitivity leaves it out likewise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 32))
    data = [torch.randn(8, 64)]
    loss = lambda m, b: m(b).float().pow(2).mean()  # noqa: E731
    measured = measure_candidates(model, data, ("tensorwise", "mxfp8", "nvfp4", "block"), loss_fn=loss)
    assert set(measured["tensorwise"]) == set(measured["block"]) == {"0", "2", "4"}
    assert set(measured["nvfp4"]) == {"0"} and set(measured["mxfp8"]) == set()
    probe = SensitivityProbe({"2": model[2]}, "nvfp4")
    probe.close()
    assert probe.skipped == {"2": "nvfp4 casts blocks of 16 along in_features and out_features, and 16 does not"
                                  " divide 48 x 40"}
    assert fp8_sensitivity(model, data, "mxfp8", loss_fn=loss) == {}


def test_candidates_and_configs_the_probe_does_not_know_are_refused_clearly():
    layer = nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"`measure_candidates\(candidates=...\)`: 'fp4' is not a format it measures"):
        measure_candidates(layer, [], ("tensorwise", "fp4"))
    with pytest.raises(ValueError, match=r"`MultiProbe\(candidates='mxfp8'\)`: a tuple of format names"):
        MultiProbe({"l": layer}, "mxfp8")
    with pytest.raises(ValueError, match=r"`MultiProbe\(candidates=\(\)\)`: name at least one format"):
        MultiProbe({"l": layer}, ())
    with pytest.raises(ValueError, match=r"SensitivityProbe: 'e4m3fn' is not what the probe measures: a candidate"
                                         r" format's name \('tensorwise', "):
        SensitivityProbe({"l": layer}, "e4m3fn")


def test_layer_sensitivity_keeps_its_fields_and_adds_tokens_last():
    """``tokens`` has a default and comes last: code that builds a ``LayerSensitivity`` by position still works."""
    from lightning_precision.fp8 import LayerSensitivity

    names = [f.name for f in dataclasses.fields(LayerSensitivity)]
    assert names[-2:] == ["batches", "tokens"] and dataclasses.fields(LayerSensitivity)[-1].default == 0.0
