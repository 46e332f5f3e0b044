"""MFU: the peak table (device names matched most specific first), compute kinds, overrides, and FLOPs per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_precision._mfu import (
    choose_peak,
    compute_kind,
    device_peak,
    model_flops_per_step,
    parse_peak_override,
)


@pytest.mark.parametrize(("device", "name"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40", None),  # not in the table: n/a, never the L4's or the L40S's peak
    ("Tesla T4", None),
])
def test_device_names_match_the_most_specific_entry(device, name):
    peak = device_peak(device)
    assert (peak.name if peak else None) == name


def test_lightnings_table_gives_an_l40s_the_l4s_peak_which_is_why_we_keep_our_own(monkeypatch):
    """Lightning 2.6's ``get_available_flops`` maps any name containing "l4" to the L4 (121 bf16 TFLOP/s): an L40S
    (362) would show 3x its MFU. If this starts failing, Lightning fixed it: compare their table with ours. The device
    name is stubbed (``torch.cuda.get_device_name``): no GPU exists here, and Lightning reads nothing else of it."""
    from lightning.fabric.utilities.throughput import get_available_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    lightning = get_available_flops(torch.device("cuda", 0), torch.bfloat16)
    assert lightning == pytest.approx(121e12, rel=0.01)
    assert choose_peak("NVIDIA L40S", "bf16").tflops == 362.05


def test_compute_kinds_follow_the_run(monkeypatch):
    """The kind comes from the plugin's ``peak_flops_dtype``: fp8 only where layers really run in fp8."""
    pytest.importorskip("torchao")
    from lightning_precision import BF16MixedPrecision, FP8Precision, FP16MixedPrecision

    assert compute_kind(FP8Precision().peak_flops_dtype) == "fp8" and compute_kind(torch.int8) == "fp8"
    assert compute_kind(FP8Precision(emulate=True).peak_flops_dtype) == "bf16"  # emulated GEMMs run in bf16
    assert compute_kind(BF16MixedPrecision().peak_flops_dtype) == "bf16"
    assert compute_kind(FP16MixedPrecision().peak_flops_dtype) == "fp16" and compute_kind("torch.float16") == "fp16"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert compute_kind(torch.float32) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert compute_kind(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)
    with pytest.raises(ValueError, match="no peak kind"):
        compute_kind(torch.float64)


def test_peaks_overrides_and_why_there_is_none():
    assert choose_peak("NVIDIA H100 80GB HBM3", "bf16").tflops == 989.5
    assert choose_peak("NVIDIA H100 80GB HBM3", "fp8").tflops == 1979.0
    assert choose_peak("NVIDIA A100-SXM4-80GB", "fp8").source == "n/a: the A100 has no fp8 tensor cores"
    assert choose_peak("cpu", "bf16").tflops is None and "pass --peak-tflops" in choose_peak("cpu", "bf16").source
    assert "not in the table" in choose_peak("Some GPU", "bf16").source
    assert choose_peak("cpu", "bf16", {"bf16": 2.0}) .tflops == 2.0
    assert parse_peak_override("989") == dict.fromkeys(("fp32", "tf32", "bf16", "fp16", "fp8"), 989.0)
    assert parse_peak_override("bf16=989, fp8=1979") == {"bf16": 989.0, "fp8": 1979.0}
    for bad, match in [("x", "could not convert"), ("bf16=-1", "positive"), ("fp4=3", "unknown kind 'fp4'"),
                       ("inf", "finite")]:
        with pytest.raises(ValueError, match=match):
            parse_peak_override(bad)


def test_flops_per_step_are_forward_and_backward_matmuls_and_leave_grad_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    batch = (torch.randn(8, 64), torch.randint(0, 16, (8,)))
    flops = model_flops_per_step(model, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    forward = 2 * 8 * 64 * 32 + 2 * 8 * 32 * 16
    # backward: both weight gradients, and the second layer's input gradient (the data needs none)
    assert flops == forward + 2 * 8 * 64 * 32 + 2 * (2 * 8 * 32 * 16)
    assert all(p.grad is None for p in model.parameters())
