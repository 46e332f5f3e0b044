"""Bad input gets a ValueError that names the argument, the value and the fix."""

import pytest
import torch

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision
from lightning_precision import fabric as lp_fabric


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "tpu"}, r"device='tpu'.*autocast device.*device=None"),
        ({"growth_interval": -1}, r"growth_interval=-1.*positive int"),
        ({"growth_interval": 0}, r"growth_interval=0.*positive int"),
        ({"growth_interval": 2.5}, r"growth_interval=2\.5.*positive int"),
        ({"init_scale": 0.0}, r"init_scale=0\.0.*> 0"),
        ({"init_scale": -2.0}, r"init_scale=-2\.0.*> 0"),
        ({"growth_factor": 1.0}, r"growth_factor=1\.0.*> 1"),
        ({"backoff_factor": 1.5}, r"backoff_factor=1\.5.*\(0, 1\)"),
        ({"matmul_precision": "low"}, r"matmul_precision='low'.*highest"),
    ],
)
@pytest.mark.parametrize("cls", [FP16MixedPrecision, lp_fabric.FP16MixedPrecision])
def test_fp16_bad_arguments(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("cls", [BF16MixedPrecision, lp_fabric.BF16MixedPrecision])
def test_bf16_rejects_a_scaler_and_bad_device(cls):
    with pytest.raises(ValueError, match=r"scaler=.*no loss scaling.*FP16MixedPrecision"):
        cls(scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"device='gpu'"):
        cls(device="gpu")


def test_bf16_on_a_cuda_gpu_without_bf16_says_use_fp16(monkeypatch):
    """No CUDA device exists here: torch.cuda's answers are stubbed to those of a pre-Ampere GPU (a V100)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    plugin = lp_fabric.BF16MixedPrecision(device="cuda")
    with pytest.raises(RuntimeError, match=r"Tesla V100.*7\.0.*FP16MixedPrecision"):
        with plugin.forward_context():
            pass
