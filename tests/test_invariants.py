"""Invariants every plugin of the package must keep. Plugins are discovered, so new ones are checked for free."""

import inspect
import pickle

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision

import lightning_precision
import lightning_precision.fabric
import lightning_precision.plugins
from tests.helpers import LitNet, loader, make_data, make_net, trainer


def _discover(module, base):
    found = [obj for name in module.__all__ if inspect.isclass(obj := getattr(module, name)) and issubclass(obj, base)]
    assert found, f"no plugin found in {module.__name__}"
    return found


FABRIC_PLUGINS = _discover(lightning_precision.fabric, FabricPrecision)
TRAINER_PLUGINS = _discover(lightning_precision.plugins, TrainerPrecision)
ALL = [pytest.param(cls, id=f"{cls.__module__.split('.')[1]}.{cls.__name__}") for cls in FABRIC_PLUGINS + TRAINER_PLUGINS]
# Each plugin's standard precision string and the dtype autocast must run in.
EXPECTED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
# Arguments that let a plugin run its logic here: XPUPrecision targets "xpu", which does not exist on these machines.
RUNNABLE_HERE = {"XPUPrecision": {"device": "cpu"}}


def make(cls, **kwargs):
    return cls(**{**RUNNABLE_HERE.get(cls.__name__, {}), **kwargs})


def test_discovery_pairs_every_trainer_plugin_with_its_fabric_class():
    assert {c.__name__ for c in FABRIC_PLUGINS} == {c.__name__ for c in TRAINER_PLUGINS}
    assert set(lightning_precision.__all__) >= {c.__name__ for c in TRAINER_PLUGINS}
    for cls in TRAINER_PLUGINS:
        fabric_cls = getattr(lightning_precision.fabric, cls.__name__)
        assert issubclass(cls, fabric_cls), f"{cls} must inherit {fabric_cls}, not copy it"
        assert cls.__qualname__ == fabric_cls.__qualname__  # checkpoint key: type(plugin).__qualname__


@pytest.mark.parametrize("cls", ALL)
def test_precision_string_and_compute_dtype(cls):
    plugin = make(cls)
    assert EXPECTED[plugin.precision] == plugin.compute_dtype
    with plugin.forward_context():
        assert torch.get_autocast_dtype("cpu") == plugin.compute_dtype
        assert make_net()(torch.randn(2, 16)).dtype == plugin.compute_dtype


@pytest.mark.parametrize("cls", ALL)
def test_state_restored_after_an_exception_in_the_forward_context(cls):
    plugin = make(cls)
    default_dtype = torch.get_default_dtype()
    with pytest.raises(RuntimeError, match="boom"):
        with plugin.forward_context():
            raise RuntimeError("boom")
    assert torch.get_default_dtype() == default_dtype
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("cls", ALL)
def test_state_dict_round_trips(cls):
    plugin = make(cls)
    state = plugin.state_dict()
    other = make(cls)
    other.load_state_dict(state)
    assert other.state_dict() == state
    # and survives pickling (ddp_spawn pickles the plugin)
    assert pickle.loads(pickle.dumps(plugin)).state_dict() == state


@pytest.mark.parametrize("cls", ALL)
def test_matmul_precision_is_applied_for_the_run_and_restored(cls):
    torch.set_float32_matmul_precision("highest")
    plugin = make(cls, matmul_precision="medium")
    seen = []
    if cls in TRAINER_PLUGINS:

        class Probe(LitNet):
            def training_step(self, batch, batch_idx):
                seen.append(torch.get_float32_matmul_precision())
                return super().training_step(batch, batch_idx)

        trainer(plugin, max_steps=1).fit(Probe(), loader(make_data(1)))
    else:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        fabric.setup(make_net())
        seen.append(torch.get_float32_matmul_precision())
        plugin.teardown()
    assert seen == ["medium"]
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("cls", ALL)
def test_device_comes_from_the_model_not_the_accelerator(cls):
    if cls.__name__ in RUNNABLE_HERE:
        pytest.skip(f"{cls.__name__} autocasts for its own device by design")
    plugin = cls()
    model = make_net()
    plugin.convert_module(model)
    assert plugin.device_type == "cpu"
    meta = make_net().to("meta")
    plugin.convert_module(meta)
    assert plugin.device_type == "meta"  # whatever the model's device is, not a guess such as "cuda"
    assert cls(device="cpu").device_type == "cpu"


import lightning_precision.callbacks  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

CALLBACKS = _discover(lightning_precision.callbacks, Callback)


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_every_callback_fits_and_round_trips_its_state(cls):
    from tests.test_channels_last import ConvModule, _images

    callback = cls()
    trainer(None, max_steps=2, log_every_n_steps=1, callbacks=[callback]).fit(ConvModule(), _images())
    state = callback.state_dict()
    other = cls()
    other.load_state_dict(state)
    assert repr(other.state_dict()) == repr(state)
