"""What Lightning's own precision flags would do instead of our plugins. Parity of every plugin, Trainer and Fabric,
with its hand-written torch.autocast (+GradScaler) loop is checked by the shared tester (tests/plugin_tester.py)."""

import torch

from lightning_precision import BF16MixedPrecision, FP16MixedPrecision
from tests.helpers import LitNet, loader, make_data, trainer


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
