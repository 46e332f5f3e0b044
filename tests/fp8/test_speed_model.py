"""The speed model (fp8/_speed.py): the device table, the formats each device runs, and the predicted saving against
torchao's size rules (the signs against every measurement: test_speed_signs.py). No GPU is needed."""

import doctest
import math

import pytest
import torch

from lightning_precision._mfu import PEAKS
from lightning_precision.fp8 import _speed
from lightning_precision.fp8._plan_types import HIGH_LABELS
from lightning_precision.fp8._speed import (
    CAST_COSTS,
    DEVICES,
    high_time,
    predicted_saving,
    speed_device,
    supported_candidates,
)

H100 = speed_device("H100 SXM")[0]
B200 = speed_device("B200")[0]
SWEEP = (1024, 2048, 4096, 8192, 16384, 32768)


def speedup(candidate, m, k, n, device=H100, backend="torchao"):
    """The predicted speedup of the layer's three GEMMs and casts over the high dtype's GEMMs."""
    high = high_time(m, k, n, device)
    return high / (high - predicted_saving(candidate, m, k, n, device, backend=backend))


def test_device_table_reuses_the_mfu_peaks_and_names_its_sources():
    assert [d.name for d in DEVICES] == [p.name for p in PEAKS]
    for device, peak in zip(DEVICES, PEAKS, strict=True):
        assert {k: device.tflops[k] for k in peak.tflops} == dict(peak.tflops)  # the same numbers, not a copy
        assert device.bandwidth > 0 and "datasheet" in device.source and peak.source in device.source
    by_name = {d.name: d for d in DEVICES}
    assert {"H100 SXM", "H100 PCIe", "H100 NVL", "H200 SXM", "B200", "L40S", "L4", "A100"} <= set(by_name)
    # Blackwell: MXFP8 at the fp8 rate, NVFP4 at twice it; Hopper and Ada have neither; Ampere has no fp8.
    assert by_name["B200"].tflops["mxfp8"] == by_name["B200"].tflops["fp8"]
    assert by_name["B200"].tflops["nvfp4"] == 2 * by_name["B200"].tflops["fp8"]
    for name in ("H100 SXM", "H200 SXM", "L40S", "L4", "A100"):
        assert "mxfp8" not in by_name[name].tflops and "nvfp4" not in by_name[name].tflops
    assert "fp8" not in by_name["A100"].tflops


def test_supported_candidates_per_device_and_backend():
    by_name = {d.name: d for d in DEVICES}
    assert supported_candidates(by_name["A100"], "torchao") == ()
    assert supported_candidates(by_name["A100"], "transformer_engine") == ()
    assert supported_candidates(H100, "torchao") == ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    assert supported_candidates(H100, "transformer_engine") == ("delayed", "current", "block")
    assert supported_candidates(by_name["L40S"], "transformer_engine") == ("delayed", "current")  # block: Hopper+
    assert supported_candidates(B200, "torchao") == ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
    assert supported_candidates(B200, "transformer_engine") == ("delayed", "current", "mxfp8", "block", "nvfp4")
    with pytest.raises(ValueError, match="backend='te'.*torchao, transformer_engine"):
        supported_candidates(H100, "te")


def test_signs_against_torchao_size_rules():
    """torchao's size rules (the thresholds fp8/_selection.py quotes: tensorwise skips K <= 4096 and N <= 1024;
    rowwise skips N <= 2048, K <= 1024, or N <= 4096 and K <= 2048), read at the large token counts they were set
    for. Rules of thumb, not measurements: the model may be stricter than the tensorwise rule (the ViT-H-sized stack
    of GPU.md loses at K, N of 1280..5120, which the rule converts) but agrees with it on most of the 36 (K, N)."""
    for m in (16384, 32768):
        rowwise = [(k, n) for k in SWEEP for n in SWEEP
                   if (predicted_saving("rowwise", m, k, n, H100) > 0)
                   == (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))]
        assert rowwise == [], (m, rowwise)
        # Tensorwise: where they differ the model keeps the layer high and the rule converts it (14 of 36: K = 1024,
        # or N <= 2048, or K = N = 2048..4096), never the other way round.
        saves = {(k, n): predicted_saving("tensorwise", m, k, n, H100) > 0 for k in SWEEP for n in SWEEP}
        assert not [kn for kn, saved in saves.items() if saved and kn[0] <= 4096 and kn[1] <= 1024], m
        stricter = [kn for kn, saved in saves.items() if not saved and not (kn[0] <= 4096 and kn[1] <= 1024)]
        assert len(stricter) <= 14 and all(k == 1024 or n <= 2048 or max(k, n) <= 4096 for k, n in stricter), (m, stricter)


def test_large_gemms_approach_the_measured_rate_ratio():
    huge = (262144, 32768, 32768)
    # fp8 / bf16 GEMM rates as measured on an H200 (1453 / 783 TFLOP/s: 1.85x, not the peaks' 2x), less the casts.
    assert 1.6 < speedup("tensorwise", *huge) < 1.85
    assert 1.6 < speedup("mxfp8", *huge, device=B200) < 1.85
    assert 3.2 < speedup("nvfp4", *huge, device=B200, backend="transformer_engine") < 3.7  # fp4: twice fp8's rate
    # Per-row scaling's casts cost more than per-tensor's: below tensorwise even at this size.
    assert 1.5 < speedup("rowwise", *huge) < speedup("tensorwise", *huge)


def test_finer_scaling_saves_less_at_the_same_shape():
    for m in SWEEP:
        for k in SWEEP:
            for n in SWEEP:
                rowwise, tensorwise = (predicted_saving(c, m, k, n, H100) for c in ("rowwise", "tensorwise"))
                assert rowwise < tensorwise, (m, k, n)
    # The weight gradient in high precision gives up a third of the GEMM saving: less than rowwise on large layers...
    for shape in ((16384, 16384, 16384), (32768, 8192, 28672), (65536, 16384, 53248)):
        assert predicted_saving("rowwise_with_gw_hp", *shape, H100) < predicted_saving("rowwise", *shape, H100)
    # ...but its casts are cheaper (no transposed copies of input and grad_output), so on medium layers it saves more,
    # as torchao's Llama3-8B runs on MI300X show (rowwise_with_gw_hp 13.5% faster than bf16, rowwise 9.6%).
    assert predicted_saving("rowwise_with_gw_hp", 4096, 4096, 4096, H100) > predicted_saving(
        "rowwise", 4096, 4096, 4096, H100)


def test_no_tokens_and_high_labels_save_nothing():
    assert predicted_saving("tensorwise", 0, 4096, 4096, H100) == 0.0
    assert high_time(0, 4096, 4096, H100) == 0.0
    for label in HIGH_LABELS:
        assert predicted_saving(label, 8192, 4096, 4096, H100) == 0.0
        assert predicted_saving(label, 8192, 4096, 4096, speed_device("A100")[0]) == 0.0


def test_high_dtype_sets_the_baseline():
    assert high_time(8192, 4096, 4096, H100, "fp16") == high_time(8192, 4096, 4096, H100, "bf16")
    # fp32 matmuls: tf32 tensor cores where torch allows them, else fp32 without tensor cores (as MFU counts them).
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        tf32 = high_time(8192, 4096, 4096, H100, "fp32")
        torch.set_float32_matmul_precision("highest")
        fp32 = high_time(8192, 4096, 4096, H100, "fp32")
    finally:
        torch.set_float32_matmul_precision(previous)
    assert high_time(8192, 4096, 4096, H100) < tf32 < fp32
    assert predicted_saving("tensorwise", 8192, 4096, 4096, H100, high="high") == predicted_saving(
        "tensorwise", 8192, 4096, 4096, H100, high="bf16")


def test_transformer_engine_formats():
    shape = (16384, 8192, 8192)
    # Fused cast-transposes: TE's MXFP8 casts cost less than torchao's two passes; delayed scaling has no amax pass.
    assert predicted_saving("mxfp8", *shape, B200, backend="transformer_engine") > predicted_saving("mxfp8", *shape,
                                                                                                   B200)
    assert predicted_saving("delayed", *shape, H100, backend="transformer_engine") > predicted_saving(
        "current", *shape, H100, backend="transformer_engine")
    assert predicted_saving("nvfp4", *shape, B200, backend="transformer_engine") > predicted_saving(
        "mxfp8", *shape, B200, backend="transformer_engine")
    # Without a backend, a format's name says whose it is (torchao's for "mxfp8", the name both have).
    assert predicted_saving("nvfp4", *shape, B200) == predicted_saving("nvfp4", *shape, B200,
                                                                       backend="transformer_engine")
    assert predicted_saving("mxfp8", *shape, B200) == predicted_saving("mxfp8", *shape, B200, backend="torchao")
    assert set(CAST_COSTS) >= {"tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "delayed", "current", "block",
                               "nvfp4"}


def test_wrong_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match=r"speed_device\(name='H300'\): no such GPU.*known: B200, H200 NVL, .*L4"):
        speed_device("H300")
    with pytest.raises(TypeError, match="as a string"):
        speed_device(100)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"the H100 SXM has no mxfp8 tensor cores.*supported_candidates"):
        predicted_saving("mxfp8", 8192, 4096, 4096, H100)
    with pytest.raises(ValueError, match="the A100 has no fp8 tensor cores"):
        predicted_saving("tensorwise", 0, 4096, 4096, speed_device("A100")[0])  # even with no tokens
    with pytest.raises(ValueError, match=r"candidate='nvfp4'\): not a torchao format; choose one of tensorwise"):
        predicted_saving("nvfp4", 8192, 4096, 4096, B200, backend="torchao")
    with pytest.raises(ValueError, match=r"candidate='fp8'\): not a torchao format; .*or a high label: high, bf16"):
        predicted_saving("fp8", 8192, 4096, 4096, H100)
    with pytest.raises(ValueError, match=r"backend='te'\): choose one of torchao, transformer_engine"):
        predicted_saving("tensorwise", 8192, 4096, 4096, H100, backend="te")
    with pytest.raises(ValueError, match=r"tokens=-1\): .* >= 0"):
        predicted_saving("tensorwise", -1, 4096, 4096, H100)
    with pytest.raises(ValueError, match=r"in_features=nan"):
        high_time(8, math.nan, 4096, H100)
    with pytest.raises(ValueError, match=r"high='fp8'\): the high precision is one of high, bf16, fp16, fp32"):
        high_time(8, 4096, 4096, H100, high="fp8")


def test_cuda_device_names_match_the_table():
    for cuda_name, entry in (("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
                             ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200 SXM"), ("NVIDIA B200", "B200"),
                             ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"), ("NVIDIA A100-SXM4-80GB", "A100"),
                             ("h100 sxm", "H100 SXM")):
        assert speed_device(cuda_name)[0].name == entry


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the prediction device of a machine without CUDA")
def test_without_cuda_the_prediction_is_for_an_h100_sxm():
    device, predicted = speed_device()
    assert device.name == "H100 SXM" and device is H100 and predicted is True
    assert speed_device("B200") == (B200, True)  # a named GPU this process does not run on: a prediction too


def test_docstring_examples_run():
    result = doctest.testmod(_speed, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.failed == 0 and result.attempted >= 8, result
