"""Over 20 steps, Trainer and Fabric with our plugins reproduce the hand-written torch.autocast (+GradScaler) loop."""

import pytest
import torch

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision
from lightning_precision import fabric as lp_fabric
from tests.helpers import LitNet, assert_params_equal, fabric_loop, hand_loop, loader, make_data, params, trainer

STEPS = 20
CASES = [
    pytest.param(torch.bfloat16, {}, id="bf16"),
    # growth_interval=5 makes the scale grow inside the run, so the scaler's arithmetic is compared too.
    pytest.param(torch.float16, {"growth_interval": 5}, id="fp16"),
]


def _make(kind: str, dtype: torch.dtype, scaler_kwargs: dict):
    module = {"trainer": __import__("lightning_precision"), "fabric": lp_fabric}[kind]
    if dtype == torch.bfloat16:
        return module.BF16MixedPrecision()
    return module.FP16MixedPrecision(**scaler_kwargs)


@pytest.mark.parametrize(("dtype", "scaler_kwargs"), CASES)
def test_trainer_matches_hand_loop(dtype, scaler_kwargs):
    ds = make_data(STEPS)
    expected_losses, expected_net, expected_scaler = hand_loop(dtype, ds, STEPS, scaler_kwargs)

    plugin = _make("trainer", dtype, scaler_kwargs)
    model = LitNet()
    trainer(plugin, max_steps=STEPS).fit(model, loader(ds))

    assert set(model.output_dtypes) == {dtype}  # autocast really ran, for cpu, in the plugin's dtype
    torch.testing.assert_close(model.losses, expected_losses)
    assert_params_equal(params(model.net), params(expected_net))
    if expected_scaler is not None:
        assert plugin.loss_scale == expected_scaler.get_scale() != 2.0**16  # the scale moved during the run


@pytest.mark.parametrize(("dtype", "scaler_kwargs"), CASES)
def test_fabric_matches_hand_loop(dtype, scaler_kwargs):
    ds = make_data(STEPS)
    expected_losses, expected_net, expected_scaler = hand_loop(dtype, ds, STEPS, scaler_kwargs)

    plugin = _make("fabric", dtype, scaler_kwargs)
    losses, net, _ = fabric_loop(plugin, ds, STEPS)

    torch.testing.assert_close(losses, expected_losses)
    assert_params_equal(params(net), params(expected_net))
    if expected_scaler is not None:
        assert plugin.loss_scale == expected_scaler.get_scale()


def test_fp16_runs_fp16_on_cpu_where_lightning_silently_uses_bf16():
    import lightning as L

    assert L.Trainer(accelerator="cpu", precision="16-mixed", logger=False).precision == "bf16-mixed"
    model = LitNet()
    trainer(FP16MixedPrecision(), max_steps=2).fit(model, loader(make_data(2)))
    assert set(model.output_dtypes) == {torch.float16}


def test_trainer_precision_string_and_dtype():
    for plugin, string, dtype in [(BF16MixedPrecision(), "bf16-mixed", torch.bfloat16), (FP16MixedPrecision(), "16-mixed", torch.float16)]:
        t = trainer(plugin)
        assert t.precision == string
        assert t.precision_plugin.compute_dtype == dtype
