"""Canaries for the private and prototype names of torchao that ``lightning_precision/_upstream/torchao.py`` fences:
each is exercised as the package uses it, so a torchao release that moves or changes one fails here first."""

import pytest
import torch

from lightning_precision._upstream import torchao as upstream

pytest.importorskip("torchao", reason="torchao is optional (`pip install 'lightning-precision[fp8]'`)")


def _mxfp8_or_skip():
    try:
        return upstream.mxfp8_linear_module()
    except Exception as err:  # an older torchao has no MXFP8 training layer: nothing of it is used then
        pytest.skip(f"this torchao has no MXFP8 training layer ({type(err).__name__})")


def test_float8_eps_is_the_floor_torchao_puts_under_amax():
    """Our copy of torchao's EPS is what its dynamic scale really uses: an all-zero tensor's scale is fmax / EPS."""
    from torchao.float8.float8_utils import amax_to_scale

    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = amax_to_scale(torch.zeros((), dtype=torch.float64), torch.float8_e4m3fn)
    assert scale.item() == pytest.approx(fmax / upstream.FLOAT8_EPS, rel=1e-6)


def test_kernel_preference_and_the_rceil_mode_exist_and_differ():
    _mxfp8_or_skip()  # what configures the MXFP8 layer: an older torchao has neither
    emulated, auto = upstream.kernel_preference(emulated=True), upstream.kernel_preference(emulated=False)
    assert emulated != auto and "EMULATED" in str(emulated) and "AUTO" in str(auto)
    assert "RCEIL" in str(upstream.rceil_scale_mode())


def test_the_mxfp8_matmul_computes_a_linear_emulated_with_its_gradients():
    """``_to_mxfp8_then_scaled_mm`` with the keywords ``MXFP8Linear.forward`` passes: close to the bf16 matmul (MXFP8
    error), differentiable to input and weight; and ``MXFP8Linear`` is an ``nn.Linear``, as the in-place conversion
    relies on."""
    module = _mxfp8_or_skip()
    assert issubclass(module.MXFP8Linear, torch.nn.Linear)
    torch.manual_seed(0)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    y = upstream.mxfp8_scaled_mm()(x, w, kernel_preference=upstream.kernel_preference(emulated=True),
                                   scale_calculation_mode=upstream.rceil_scale_mode(), wgrad_with_hp=False)
    ref = x.float() @ w.float().t()
    assert y.shape == (32, 64)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.1
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None and torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_float8_casts_of_the_backward_give_torchaos_own_input_gradient(recipe):
    """``float8_dynamic_cast``'s casts of the output gradient and the weight, multiplied, are the input gradient
    torchao's ``Float8Linear`` backward computes (the sensitivity probe computes only that half of it)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_precision.fp8._sensitivity import fp8_grad_input

    to_float8, axiswise_dim, roles = upstream.float8_dynamic_cast()
    assert callable(to_float8) and callable(axiswise_dim) and {"GRAD_OUTPUT", "WEIGHT"} <= set(roles.__members__)
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 32))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(layer, config=config)
    x = torch.randn(16, 64, requires_grad=True)
    grad_output = torch.randn(16, 32)
    layer(x).backward(grad_output)
    assert x.grad is not None
    torch.testing.assert_close(fp8_grad_input(layer[0], grad_output), x.grad, rtol=0, atol=0)
