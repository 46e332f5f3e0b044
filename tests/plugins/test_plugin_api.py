"""Every plugin answers the same questions (``metrics()``, ``loss_scale``, ``skipped_steps``), so the README's logging
code keeps working when another plugin is swapped in: real Fabric loops and Trainer fits on CPU."""


import lightning as L
import pytest
import torch
from torch import nn

import lightning_precision
from lightning_precision import _imports
from lightning_precision import fabric as lp_fabric
from tests.helpers import LitNet, RecordingLogger, loader, make_data, make_net, trainer

STEPS = 4
_FP8 = pytest.mark.skipif(not _imports.TORCHAO_AVAILABLE, reason="FP8Precision needs torchao (the [fp8] extra)")
# FP8 on make_net: skip_first_last leaves the 32 -> 32 layer alone in fp8 (emulated on the CPU).
PLUGINS = [
    pytest.param("BF16MixedPrecision", {}, id="bf16"),
    pytest.param("FP16MixedPrecision", {}, id="fp16"),
    pytest.param("FP8Precision", dict(emulate=True, skip_small_layers=False), id="fp8", marks=_FP8),
    pytest.param("BF16MixedPrecision", {"skip_nonfinite": True}, id="bf16-guarded"),
    pytest.param("FP8Precision", dict(emulate=True, skip_small_layers=False, skip_nonfinite=True), id="fp8-guarded",
                 marks=_FP8),
]


def expected_metrics(name: str, kwargs: dict) -> set[str]:
    # Skipped steps where steps are skipped (fp16's scaler, or the non-finite guard); a loss scale only with loss scaling.
    return {
        "BF16MixedPrecision": set(),  # nothing to report: no loss scale is invented
        "FP16MixedPrecision": {"precision/loss_scale", "precision/skipped_steps"},
        "FP8Precision": {"precision/fp8_layers"},
    }[name] | ({"precision/skipped_steps"} if kwargs.get("skip_nonfinite") else set())


@pytest.mark.parametrize(("name", "kwargs"), PLUGINS)
def test_readme_fabric_loop_logs_plugin_metrics(name, kwargs):
    plugin = getattr(lp_fabric, name)(**kwargs)
    logger = RecordingLogger()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin], loggers=[logger])
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for step, (x, y) in enumerate(fabric.setup_dataloaders(loader(make_data(STEPS)))):
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.log_dict(plugin.metrics(), step)  # the README's line, every step here

    assert [step for step, _ in logger.logged] == list(range(STEPS))
    assert all(set(metrics) == expected_metrics(name, kwargs) for _, metrics in logger.logged)
    last = logger.logged[-1][1]
    if name == "FP16MixedPrecision":
        assert last == {"precision/loss_scale": plugin.loss_scale, "precision/skipped_steps": 0.0}
    elif name == "FP8Precision":
        assert last == {"precision/fp8_layers": 1.0, **({"precision/skipped_steps": 0.0} if kwargs.get("skip_nonfinite") else {})}
        assert sum(d.fp8 for d in plugin.layer_decisions) == 1  # the figure logged is the plugin's own count
    assert plugin.skipped_steps == 0
    assert (plugin.loss_scale is None) == (name != "FP16MixedPrecision")


@pytest.mark.parametrize(("name", "kwargs"), PLUGINS)
def test_readme_trainer_snippet_reads_loss_scale_and_skipped_steps(name, kwargs):
    plugin = getattr(lightning_precision, name)(**kwargs)
    fit = trainer(plugin, max_steps=STEPS)
    fit.fit(LitNet(), loader(make_data(STEPS)))

    loss_scale, skipped_steps = fit.precision_plugin.loss_scale, fit.precision_plugin.skipped_steps  # the README's
    assert skipped_steps == 0
    if name == "FP16MixedPrecision":
        assert loss_scale == plugin.scaler_config.init_scale  # 4 clean steps: no growth, no backoff
    else:
        assert loss_scale is None  # no loss scaling
    assert set(fit.precision_plugin.metrics()) == expected_metrics(name, kwargs)


def test_fp8_reports_no_layer_count_before_the_first_backward():
    # Until a backward has run, a layer chosen for fp8 may still turn out to be unused (its weight used elsewhere).
    pytest.importorskip("torchao", reason="FP8Precision needs torchao (the [fp8] extra)")
    plugin = lp_fabric.FP8Precision(emulate=True, skip_small_layers=False)
    plugin.convert_module(make_net())
    assert "precision/fp8_layers" not in plugin.metrics()


def test_xpu_plugin_in_bf16_has_no_loss_scale():
    plugin = lp_fabric.XPUPrecision(dtype="bf16", device="cpu")
    assert (plugin.metrics(), plugin.loss_scale, plugin.skipped_steps) == ({}, None, 0)
    guarded = lp_fabric.XPUPrecision(dtype="bf16", device="cpu", skip_nonfinite=True)
    assert (set(guarded.metrics()), guarded.loss_scale, guarded.skipped_steps) == ({"precision/skipped_steps"}, None, 0)


# ---- FSDP2 policy (the sharded runs themselves are in test_fsdp.py) ----------------------------------------------------


def test_every_plugin_gives_fully_shard_its_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_precision import BF16MixedPrecision, FP8Precision, FP16MixedPrecision

    for plugin, dtype in ((BF16MixedPrecision(), torch.bfloat16), (FP16MixedPrecision(), torch.float16),
                          (FP8Precision(emulate=True), torch.bfloat16)):
        assert plugin.mp_policy == MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                                        cast_forward_inputs=False)
    assert BF16MixedPrecision(reduce_dtype=torch.bfloat16).mp_policy.reduce_dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [torch.int8, torch.float8_e4m3fn, "fp32", torch.float16, torch.float64])
def test_reduce_dtype_must_be_fp32_or_bf16(bad):
    from lightning_precision import BF16MixedPrecision

    with pytest.raises(ValueError, match=r"BF16MixedPrecision\(reduce_dtype="):
        BF16MixedPrecision(reduce_dtype=bad)


def test_float8_all_gather_is_tensorwise_torchao_only():
    from lightning_precision import FP8Precision

    with pytest.raises(ValueError, match="tensorwise scaling only"):
        FP8Precision(emulate=True, recipe="rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="pass None, True or False"):
        FP8Precision(emulate=True, fsdp_float8_all_gather="yes")
    assert FP8Precision(emulate=True).fsdp_float8_all_gather is None  # decided at conversion


def test_unsharded_fp8_weights_stay_plain_tensors_a_plain_torch_load_reads():
    """Without sharding the float8 all-gather stays off: torchao would otherwise wrap the weights in a tensor subclass
    that `torch.load(weights_only=True)` refuses in a process that has not imported torchao."""
    from lightning_precision import FP8Precision

    plugin = FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False)
    model = plugin.convert_module(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)))
    assert all(type(p.data) is torch.Tensor for p in model.parameters())
    assert plugin._float8_all_gather is False


def test_lightnings_fsdp1_strategy_refuses_our_plugins_when_the_trainer_is_built():
    """What docs/sharded.md tells FSDP1 users: Lightning's FSDPStrategy (CUDA only) takes only its FSDPPrecision and
    raises at `Trainer(...)`, before any step; sharded training with our plugins is ModelParallelStrategy (FSDP2)."""
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_precision import BF16MixedPrecision

    with pytest.raises(TypeError, match="can only work with the `FSDPPrecision` plugin"):
        FSDPStrategy(precision_plugin=BF16MixedPrecision())
