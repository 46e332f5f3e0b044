"""The Transformer Engine backend against a stand-in that mirrors TE's signatures (tests/te_standin.py): TE cannot be
installed on these CPU machines. What runs here: recipe construction, module replacement (LayerNorm without affine
included), the autocast call, `_extra_state` round trips, and the clear errors. Real TE runs are in test_cuda.py,
gated on transformer_engine and a CUDA device."""

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_precision import FP8Precision
from lightning_precision import fabric as lp_fabric
from lightning_precision.fp8 import FP8LayerPolicy, select_fp8_layers
from lightning_precision.fp8._te import convert_with_te, te_recipe
from tests import te_standin


@pytest.fixture
def te(monkeypatch):
    return te_standin.install(monkeypatch)


def block():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64, elementwise_affine=False),
        nn.Linear(64, 16),
    )


def test_recipes_by_name_mapping_and_object(te):
    assert isinstance(te_recipe("delayed"), te_standin.DelayedScaling)
    assert isinstance(te_recipe("current"), te_standin.Float8CurrentScaling)
    assert isinstance(te_recipe("mxfp8"), te_standin.MXFP8BlockScaling)
    assert isinstance(te_recipe("block"), te_standin.Float8BlockScaling)
    r = te_recipe({"name": "delayed", "amax_history_len": 16, "margin": 1})
    assert (r.amax_history_len, r.margin) == (16, 1)
    own = te_standin.DelayedScaling(amax_compute_algo="most_recent")
    assert te_recipe(own) is own
    with pytest.raises(ValueError, match=r"recipe='tensorwise'.*delayed"):
        te_recipe("tensorwise")


def test_replaces_linear_and_layernorm_including_without_affine(te):
    model = block()
    x = torch.randn(4, 64)
    expected = model(x)
    decisions = select_fp8_layers(model, "delayed", skip_small_layers=False)
    convert_with_te(model, decisions)
    assert type(model[3]) is te.Linear
    assert type(model[1]) is nn.Linear and type(model[5]) is nn.Linear  # first and last linear layers kept
    assert type(model[0]) is te.LayerNorm and type(model[4]) is te.LayerNorm
    # LayerNorm(elementwise_affine=False), where Lightning crashes: weight 1, bias 0, frozen
    assert torch.equal(model[4].weight, torch.ones(64)) and not model[4].weight.requires_grad
    torch.testing.assert_close(model(x), expected)  # weights were copied: same function


def test_plugin_enters_te_autocast_with_its_recipe_inside_bf16_autocast(te):
    plugin = lp_fabric.FP8Precision(backend="transformer_engine", recipe={"name": "delayed", "amax_history_len": 4})
    assert plugin.precision == "transformer-engine" and plugin.scaling_family == "delayed"
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    (call,) = te_standin.AUTOCAST_CALLS
    assert call["enabled"] and call["recipe"].amax_history_len == 4


def test_extra_state_round_trips_through_a_checkpoint(te, tmp_path):
    model = block()
    convert_with_te(model, select_fp8_layers(model, "delayed", skip_small_layers=False, skip_first_last=False))
    model[1].fp8_meta["scaling_fwd"].amax_history[0] = torch.tensor([1.0, 2.0, 3.0])
    torch.save(model.state_dict(), tmp_path / "m.pt")
    state = torch.load(tmp_path / "m.pt", weights_only=False)
    assert "1._extra_state" in state
    other = block()
    convert_with_te(other, select_fp8_layers(other, "delayed", skip_small_layers=False, skip_first_last=False))
    other.load_state_dict(state)
    assert torch.equal(other[1].fp8_meta["scaling_fwd"].amax_history[0], torch.tensor([1.0, 2.0, 3.0]))


def test_te_has_no_emulation_and_needs_cuda(te):
    with pytest.raises(ValueError, match="Transformer Engine has no emulation.*backend='torchao'"):
        FP8Precision(backend="transformer_engine", emulate=True)
    plugin = lp_fabric.FP8Precision(backend="transformer_engine", skip_small_layers=False)
    model = plugin.convert_module(block())
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        with plugin.forward_context():
            model(torch.randn(2, 64))


def test_missing_transformer_engine_names_the_extra(monkeypatch):
    from lightning_precision import _imports

    class Missing:
        message = "transformer-engine>=2.9 is not installed"

        def __bool__(self):
            return False

    monkeypatch.setattr(_imports, "TRANSFORMER_ENGINE_AVAILABLE", Missing())
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-precision\[te\]'"):
        FP8Precision(backend="transformer_engine")


def test_adopting_parameters_refuses_a_mismatch_instead_of_keeping_random_weights():
    """The converted module must train the user's weights: a Parameter it cannot take over (other shape, dtype or
    device) is an error, not a silent fresh (random) weight. A Parameter the old module lacks keeps the new init."""
    from lightning_precision.fp8._te import adopt_parameters as _adopt_parameters

    old, new = torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)
    with pytest.raises(ValueError, match=r"`weight` is \(4, 4\) torch.float32 on cpu, the converted module's \(8, 4\)"):
        _adopt_parameters(new, old)
    plain, affine = torch.nn.LayerNorm(4, elementwise_affine=False), torch.nn.LayerNorm(4)
    _adopt_parameters(affine, plain)
    assert torch.equal(affine.weight, torch.ones(4))
    same_old, same_new = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    _adopt_parameters(same_new, same_old)
    assert same_new.weight is same_old.weight


def test_auto_measures_through_torchao_and_converts_the_accepted_layers_to_te(te):
    """``layers="auto"`` with the TE backend: the layers are measured through torchao's emulation of per-tensor
    scaling (TE's own casts need CUDA), then the accepted ones become TE modules. The stand-in does no fp8 arithmetic:
    what is tested is the choice and the conversion."""
    pytest.importorskip("torchao")
    from lightning_precision.callbacks import FP8Guard
    from tests.fp8.test_plan import Outliers, batches

    plugin = lp_fabric.FP8Precision(backend="transformer_engine", layers="auto", calibration_batches=2,
                                    skip_small_layers=False, skip_first_last=False)
    model = plugin.convert_module(Outliers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        plugin.backward(loss, model)  # the plugin counts each backward pass as a measured batch (as fabric.backward)
        plugin.optimizer_step(optimizer)  # and decides at the optimizer step after them
    assert plugin.plan.fp8_layers == {"a", "d", "head"} and plugin.plan.batches == 2
    assert (type(model.a), type(model.b), type(model.c)) == (te.Linear, nn.Linear, nn.Linear)
    # TE modules cannot go back to high precision in place: the guard and `demote` say so instead of trying.
    with pytest.raises(RuntimeError, match="Transformer Engine layers cannot return to high precision in place"):
        plugin.demote({"a": "by hand"})
    trainer = L.Trainer(accelerator="cpu", plugins=[FP8Precision(backend="transformer_engine")],
                        callbacks=[FP8Guard()], max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="FP8Guard: Transformer Engine layers cannot return"):
        trainer.fit(BoringModel())


def test_nvfp4_has_its_own_plugin_with_block_rules_and_a_blackwell_check(te, monkeypatch):
    """NVFP4 through TE's NVFP4BlockScaling (stand-in: TE needs CUDA). It is 4-bit, so `FP8Precision` refuses it and
    `NVFP4Precision` takes only it; its layers need dims divisible by 32, and the GPU compute capability 10.0."""
    import lightning_precision
    from lightning_precision.fp8 import check_fp8_hardware

    plugin = lp_fabric.NVFP4Precision(recipe={"name": "nvfp4", "disable_rht": True})
    assert isinstance(plugin.recipe, te_standin.NVFP4BlockScaling) and plugin.recipe.disable_rht
    assert plugin.scaling_family == "nvfp4" and plugin.backend == "transformer_engine"
    assert isinstance(lightning_precision.NVFP4Precision(), lightning_precision.FP8Precision)  # the Trainer's
    with pytest.raises(ValueError, match="NVFP4 is 4-bit, not fp8: use `NVFP4Precision"):
        FP8Precision(backend="transformer_engine", recipe="nvfp4")
    with pytest.raises(ValueError, match="`NVFP4Precision` takes|FP8Precision` takes the fp8 ones"):
        lp_fabric.NVFP4Precision(recipe="delayed")

    fabric = L.Fabric(accelerator="cpu", devices=1,
                      plugins=[lp_fabric.NVFP4Precision(layer_policy=FP8LayerPolicy(skip_small_layers=False, skip_first_last=False))])
    with pytest.raises(RuntimeError, match=r"NVFP4Precision \(nvfp4\) needs a CUDA GPU.*10\.0.*formats=\('nvfp4',\)"):
        fabric.setup(nn.Sequential(nn.Linear(64, 64)))(torch.randn(2, 64))  # the device is known at the first forward
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48), nn.Linear(48, 64), nn.Linear(64, 64))
    decisions = select_fp8_layers(model, "nvfp4", module_filter=lambda m, fqn: True)
    assert [d.fp8 for d in decisions] == [True, False, False, True]  # 48 is a multiple of 16, not of 32
    # No CUDA device here: torch.cuda's answers are stubbed to an H200's (9.0), which has fp8 but not NVFP4.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    with pytest.raises(RuntimeError, match=r"NVFP4Precision \(nvfp4\) needs CUDA compute capability >= 10\.0.*H200"):
        check_fp8_hardware("cuda", "transformer_engine", "nvfp4", emulate=False, owner="NVFP4Precision")


def test_nvfp4_says_its_own_name_when_no_layer_converts():
    from lightning_precision._warnings import NoEffectWarning
    from lightning_precision.fp8._selection import warn_if_no_fp8 as _warn_if_no_fp8

    with pytest.warns(NoEffectWarning, match=r"^NVFP4Precision: no linear layer runs in NVFP4"):
        _warn_if_no_fp8([], "NVFP4Precision", "NVFP4")


def test_nvfp4_takes_the_layer_choice_as_a_policy_or_the_flat_shorthands_never_both(te):
    """One rule across FP8Precision, NVFP4Precision and make_plan: `layer_policy=` or the flat arguments (TE is the
    stand-in here)."""
    flat = lp_fabric.NVFP4Precision(skip_small_layers=False, module_filter=None)
    assert flat.layer_policy == FP8LayerPolicy(skip_small_layers=False)
    assert lp_fabric.NVFP4Precision(layer_policy=FP8LayerPolicy(skip_first_last=False)).skip_first_last is False
    for plugin in (lp_fabric.NVFP4Precision, FP8Precision):
        kwargs = {"backend": "transformer_engine"} if plugin is FP8Precision else {}
        with pytest.raises(ValueError, match=rf"`{plugin.__name__}\(layer_policy=FP8LayerPolicy\(...\), skip_first_last="
                                             r"False\)`: give these arguments in one place"):
            plugin(layer_policy=FP8LayerPolicy(), skip_first_last=False, **kwargs)
