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
        ({"init_scale": 0.0}, r"init_scale=0\.0.*\[min_scale, max_scale\]"),
        ({"init_scale": -2.0}, r"init_scale=-2\.0.*\[min_scale, max_scale\]"),
        ({"growth_factor": 1.0}, r"growth_factor=1\.0.*> 1"),
        ({"backoff_factor": 1.5}, r"backoff_factor=1\.5.*\(0, 1\)"),
        ({"matmul_precision": "low"}, r"matmul_precision='low'.*highest"),
        ({"init_scale": float("inf")}, r"init_scale=inf.*finite number"),
        ({"init_scale": float("nan")}, r"init_scale=nan.*finite number"),
        ({"init_scale": 1e39}, r"init_scale=1e\+39.*\[min_scale, max_scale\]"),
        ({"init_scale": 1e-40}, r"init_scale=1e-40.*\[min_scale, max_scale\]"),
        ({"init_scale": "1024"}, r"init_scale='1024'.*finite number"),
        ({"init_scale": None}, r"init_scale=None.*finite number"),
        ({"growth_factor": float("inf")}, r"growth_factor=inf.*finite number"),
        ({"growth_factor": "2"}, r"growth_factor='2'.*finite number"),
        ({"growth_factor": None}, r"growth_factor=None.*finite number"),
        ({"backoff_factor": "0.5"}, r"backoff_factor='0.5'.*finite number"),
        ({"backoff_factor": None}, r"backoff_factor=None.*finite number"),
        ({"backoff_factor": 1e-300}, r"backoff_factor=1e-300.*one backoff would take the scale.*below min_scale"),
        ({"skip_schedulers_on_overflow": "no"}, r"skip_schedulers_on_overflow='no'.*True or False"),
        ({"min_scale": 0.0}, r"min_scale=0\.0.*2\*\*-126 <= min_scale < max_scale"),
        ({"max_scale": 2.0**200}, r"max_scale=.*max_scale <= 2\*\*126"),
        ({"min_scale": 2.0**10, "max_scale": 2.0**5}, r"min_scale=1024\.0.*min_scale < max_scale"),
        ({"max_consecutive_skips": 0}, r"max_consecutive_skips=0.*positive int.*or None"),
        ({"max_consecutive_skips": 2.5}, r"max_consecutive_skips=2\.5.*positive int"),
        ({"growth_interval": True}, r"growth_interval=True.*positive int"),
        # torch grows only to a finite fp32 scale: past 2**128 / max_scale the scale would never grow after a backoff
        ({"growth_factor": 1e35}, r"growth_factor=1e\+35.*finite fp32.*<= 2\.0282408e\+31 \(max_scale = 1\.67772e\+07\)"),
        ({"growth_factor": 2.0**104}, r"growth_factor=.*finite fp32"),
        ({"growth_factor": 4.0, "max_scale": 2.0**126}, r"growth_factor=4\.0.*<= 3\.9999998 "),
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
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    plugin = lp_fabric.BF16MixedPrecision(device="cuda")
    with pytest.raises(RuntimeError, match=r"Tesla V100.*7\.0.*FP16MixedPrecision"):
        with plugin.forward_context():
            pass


@pytest.mark.parametrize(
    "make",
    [
        lambda: __import__("lightning_precision").XPUPrecision(),
        lambda: FP16MixedPrecision(device="mps"),
        lambda: BF16MixedPrecision(device="xpu"),
    ],
    ids=["XPUPrecision()", "FP16MixedPrecision(device='mps')", "BF16MixedPrecision(device='xpu')"],
)
def test_an_explicit_device_that_is_not_where_the_model_lives_is_an_error(make):
    """Autocast for another device type leaves the model's operations alone: it would train in fp32 while reporting
    bf16-mixed or 16-mixed."""
    from tests.helpers import LitNet, loader, make_data, trainer

    with pytest.raises(ValueError, match=r"autocasts for '(xpu|mps)', but the model lives on 'cpu'.*fp32"):
        trainer(make(), max_steps=1).fit(LitNet(), loader(make_data(1)))


def test_an_explicit_device_that_is_not_where_the_model_lives_is_an_error_with_fabric():
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[lp_fabric.BF16MixedPrecision(device="xpu")])
    model = fabric.setup(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"autocasts for 'xpu', but the model lives on 'cpu'"):
        model(torch.ones(1, 4))


def test_meta_tensors_do_not_count_as_a_device():
    """A model partly on meta (deferred initialisation) lives where its real tensors are. No explicit device: with one,
    the check passed whether meta was counted or not."""
    plugin = lp_fabric.BF16MixedPrecision()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to("meta"), torch.nn.Linear(4, 4))
    plugin.convert_module(model)
    assert plugin.device_type == "cpu"


def test_the_largest_growth_factor_accepted_still_grows_the_scale():
    """The bound of the growth_factor check is torch's own: at it, a scale that backed off grows again."""
    from tests.helpers import fabric_loop, make_data

    factor = 2.0**123  # max_scale (2**4) * 2**123 = 2**127, below fp32's max
    assert 2.0**4 * factor <= torch.finfo(torch.float32).max
    plugin = lp_fabric.FP16MixedPrecision(growth_factor=factor, growth_interval=1, init_scale=2.0**4, max_scale=2.0**4)
    fabric_loop(plugin, make_data(2, overflow_batches=(0,)), steps=2)  # a skipped step backs off, a clean one grows
    assert plugin.skipped_steps == 1 and plugin.loss_scale == 2.0**4
