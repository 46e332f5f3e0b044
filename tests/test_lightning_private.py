"""The private Lightning APIs the package relies on (all in lightning_precision/_lightning.py), checked against the
installed Lightning: if an upstream release renames or changes one, this fails here, loudly, with the name."""

import inspect

import pytest
import torch
from lightning.fabric.utilities import throughput as fabric_throughput
from lightning.pytorch.callbacks import throughput_monitor as trainer_throughput

from lightning_precision import BF16MixedPrecision, _lightning
from tests.helpers import LitNet, loader, make_data, trainer


def test_logging_cadence_and_step_counter_are_readable_from_a_real_fit():
    seen = []

    class Probe(LitNet):
        def on_before_optimizer_step(self, optimizer):
            seen.append((_lightning.should_update_logs(self.trainer), _lightning.batches_that_stepped(self.trainer)))

    trainer(None, max_steps=4, log_every_n_steps=2).fit(Probe(), loader(make_data(4)))
    assert seen == [(False, 0), (True, 1), (False, 2), (True, 3)]


def test_fused_optimizer_detection_and_output_cast():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert _lightning.optimizer_handles_unscaling(torch.optim.Adam(params, fused=True))
    assert not _lightning.optimizer_handles_unscaling(torch.optim.SGD(params, lr=0.1))
    out = _lightning.convert_fp_tensor(torch.ones(2, dtype=torch.bfloat16), torch.float32)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("module", [fabric_throughput, trainer_throughput], ids=["fabric", "trainer"])
def test_throughput_dispatch_exists_and_is_wrapped_once(module):
    original = getattr(module, "_plugin_to_compute_dtype", None)
    assert callable(original), f"{module.__name__}._plugin_to_compute_dtype is gone: update _lightning.py"
    assert list(inspect.signature(original).parameters) == ["plugin"]
    BF16MixedPrecision()
    BF16MixedPrecision()
    wrapped = module._plugin_to_compute_dtype
    assert getattr(wrapped, "_lightning_precision_wrapped", False)
    assert not getattr(wrapped.__wrapped__, "_lightning_precision_wrapped", False)  # not wrapped twice


def test_fabric_wrapper_prefix_is_what_named_parameters_gives():
    import lightning as L
    from torch import nn

    from lightning_precision._lightning import FABRIC_MODULE_PREFIX, unwrapped_name

    model = L.Fabric(accelerator="cpu", devices=1).setup(nn.Sequential(nn.Linear(2, 2)))
    names = [n for n, _ in model.named_parameters()]
    assert names == [f"{FABRIC_MODULE_PREFIX}0.weight", f"{FABRIC_MODULE_PREFIX}0.bias"]
    assert [unwrapped_name(n) for n in names] == ["0.weight", "0.bias"]
