"""``eval_precision=`` at its edges (issue 39), each found by using it as a user would and fixed: two models on one fp8
plugin, BatchNorm's running statistics under a true plugin's fp32 evaluation, FSDP2 all-gathering 16-bit weights into
an fp32 evaluation, and ``eval_context`` from two threads."""

from __future__ import annotations

import threading
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import fabric as lpf
from tests.helpers import fp8_recipe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _fp8(eval_precision: str | None = "32-true") -> Any:
    return lpf.FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False,
                            eval_precision=eval_precision)


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def test_fp8_evaluates_every_model_set_up_on_the_plugin_without_fp8():
    """A GAN's generator and discriminator, set up on one plugin: both are evaluated without fp8 (the first used to
    stay fp8, silently), and both are fp8 again afterwards."""
    plugin = _fp8()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    nets = [_net(0), _net(1)]
    models = [fabric.setup(net) for net in nets]
    fp8_classes = [[type(m) for m in net.modules()] for net in nets]
    x = torch.randn(4, 16)
    with torch.no_grad(), plugin.eval_context():
        for model, net in zip(models, nets, strict=True):
            assert all(type(m) is nn.Linear for m in net if isinstance(m, nn.Linear))
            reference = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
            reference.load_state_dict(net.state_dict())
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert [[type(m) for m in net.modules()] for net in nets] == fp8_classes


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_true_fp32_evaluation_updates_batchnorm_running_stats_in_the_models_buffers(grad_mode):
    """BatchNorm in train mode inside an evaluation (a user recalibrating its statistics, as
    ``torch.optim.swa_utils.update_bn`` does under no_grad): the statistics computed in fp32 land in the model's 16-bit
    buffers, as fp32's rounded, beside its ``num_batches_tracked`` (they used to land in a widened copy and vanish)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    fp32 = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    plugin = lpf.BF16TruePrecision(eval_precision="32-true")
    model = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup(net)
    fp32.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in net.state_dict().items()})
    x = torch.randn(16, 8) + 3
    norm = net[1]
    with grad_mode(), plugin.eval_context():
        model(x)
    with torch.no_grad():
        fp32(x)
    assert norm.running_mean.dtype == torch.bfloat16 and int(norm.num_batches_tracked) == 1
    assert torch.equal(norm.running_mean, fp32[1].running_mean.bfloat16())
    assert torch.equal(norm.running_var, fp32[1].running_var.bfloat16())
    model.eval()  # in eval mode the statistics are read, and written back unchanged
    before = norm.running_mean.clone()
    with grad_mode(), plugin.eval_context():
        model(x)
    assert torch.equal(norm.running_mean, before)


# torch's own deprecation, inside the plugins' one-collective check that gloo averages (`_core/fsdp.py`).
@pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.*:FutureWarning")
@pytest.mark.parametrize("make", [
    lambda: lpf.BF16MixedPrecision(eval_precision="32-true"),
    lambda: _fp8("32-true"),
    lambda: lpf.BF16TruePrecision(eval_precision="32-true"),
], ids=["bf16-mixed", "fp8", "bf16-true"])
def test_fsdp2_gathering_16_bit_weights_refuses_an_fp32_evaluation_at_the_first_forward(make, tmp_path):
    """One gloo process, real ``fully_shard`` with the plugin's ``mp_policy`` (bf16 all-gather): an fp32 evaluation
    would meet bf16 weights at its first matmul (the autocast plugins crashed there: "mat1 and mat2 must have the same
    dtype"). Refused, naming the fix, at the first forward (the Trainer's ``connect``), training's included."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    plugin = make()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model = plugin.convert_module(_net(0))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mp_policy=plugin.mp_policy)
        with pytest.raises(ValueError, match=r"eval_precision='32-true'.*eval_precision=None"), plugin.forward_context():
            model(plugin.convert_input(torch.randn(2, 16)))
    finally:
        dist.destroy_process_group()


def test_eval_context_from_a_second_thread_is_refused_while_one_is_open():
    """The evaluation changes the shared model until the outermost context closes: a second thread's context used to
    run on after the first closed, its fp8 layers back in fp8 while it believed itself evaluating without."""
    plugin = _fp8()
    model = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup(_net(0))
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with plugin.eval_context():
                pass
        except RuntimeError as error:
            errors.append(error)

    with torch.no_grad(), plugin.eval_context():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert type(model.module[0]) is nn.Linear  # the open evaluation is untouched
    assert len(errors) == 1 and "open in another thread" in str(errors[0])
    thread = threading.Thread(target=other)  # once closed, any thread may evaluate
    thread.start()
    thread.join()
    assert len(errors) == 1



@pytest.mark.parametrize("recipe", [fp8_recipe("rowwise"), fp8_recipe("mxfp8")])
def test_fp8_formats_beside_tensorwise_evaluate_in_fp32_as_the_plain_layers_do(recipe):
    """rowwise and torchao's MXFP8 layer (dims divisible by 32) go through the same class swap as tensorwise: in
    "32-true" each computes as the plain fp32 linear it is, bit for bit, and is that format again afterwards."""
    plugin = lpf.FP8Precision(recipe=recipe, emulate=True, skip_small_layers=False, skip_first_last=False,
                              eval_precision="32-true")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    twin = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    twin.load_state_dict(net.state_dict())
    model = fabric.setup(net)
    converted = [type(m) for m in net.modules()]
    assert plugin.fp8_modules() and converted[1] is not nn.Linear
    x = torch.randn(32, 32)
    with torch.no_grad(), plugin.eval_context():
        out = model(x)
    with torch.no_grad():
        assert torch.equal(out, twin(x))
        assert not torch.equal(model(x), out)  # its format again
    assert [type(m) for m in net.modules()] == converted
