"""What only a CUDA device can show: autocast for "cuda" because the model lives there. Skipped, with the reason,
on the CPU CI machines."""

import torch

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision
from tests.helpers import LitNet, loader, make_data, trainer
from tests.runif import RunIf


@RunIf(cuda=True)
def test_fp16_on_cuda_autocasts_for_cuda_with_a_cuda_scaler():
    plugin, model = FP16MixedPrecision(), LitNet()
    trainer(plugin, accelerator="cuda", max_steps=3).fit(model, loader(make_data(3)))
    assert plugin.device_type == "cuda" and plugin.scaler._device == "cuda"
    assert set(model.output_dtypes) == {torch.float16}
    assert plugin.skipped_steps >= 0 and plugin.loss_scale > 0


@RunIf(cuda=True, min_sm=(8, 0))
def test_bf16_on_cuda():
    plugin, model = BF16MixedPrecision(), LitNet()
    trainer(plugin, accelerator="cuda", max_steps=2).fit(model, loader(make_data(2)))
    assert plugin.device_type == "cuda" and set(model.output_dtypes) == {torch.bfloat16}


def _te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # not installed, or installed without a working CUDA build
        return False
    return True


@RunIf(cuda=True, min_sm=(8, 9))
def test_fp8_torchao_on_an_fp8_gpu():
    import pytest

    pytest.importorskip("torchao", reason="needs torchao (`pip install 'lightning-precision[fp8]'`)")
    from lightning_precision import FP8Precision
    from tests.test_fp8 import FP8Net, fp8_data

    model = FP8Net()
    trainer(FP8Precision(skip_small_layers=False), accelerator="cuda", max_steps=3).fit(model, fp8_data(3))
    assert type(model.net[2]).__name__ == "Float8Linear"


@RunIf(cuda=True, min_sm=(8, 9))
def test_fp8_transformer_engine_on_an_fp8_gpu():
    import pytest

    if not _te_importable():
        pytest.skip("needs transformer_engine with CUDA (`pip install 'lightning-precision[te]'`)")
    from lightning_precision import FP8Precision
    from tests.test_fp8 import FP8Net, fp8_data

    model = FP8Net()
    trainer(FP8Precision(backend="transformer_engine", recipe="current", skip_small_layers=False),
            accelerator="cuda", max_steps=3).fit(model, fp8_data(3))
    assert type(model.net[2]).__module__.startswith("transformer_engine")
