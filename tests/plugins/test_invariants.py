"""Invariants every plugin of the package must keep. Plugins are discovered, so new ones are checked for free.

Parity with a hand-written loop, state round-trip, pickling, a no_grad forward before the training forward, and the
optimizer holding the model's Parameters are run for every plugin by the shared tester (tests/plugin_tester.py, run by
tests/plugins/test_plugin_tester.py); discovery and the runnable arguments of each plugin come from it too."""

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision

import lightning_precision
import lightning_precision._trainer
import lightning_precision.fabric
from tests.helpers import LitNet, loader, make_data, make_net, trainer
from tests.plugin_tester import FABRIC_PLUGINS, TRAINER_PLUGINS, default_spec, discover, make_runnable, plugin_id


def _param(cls):
    spec = default_spec(cls)  # a plugin without a spec fails in tests/plugins/test_plugin_tester.py, and runs here as cls()
    reason = spec.cannot_run_here if spec is not None else None
    return pytest.param(cls, id=plugin_id(cls), marks=[pytest.mark.skip(reason=reason)] if reason else [])


ALL = [_param(cls) for cls in FABRIC_PLUGINS + TRAINER_PLUGINS]
# Each plugin's standard precision string and the dtype it computes in: autocast's for the mixed plugins, the weights'
# and the default dtype's for the true ones (no autocast).
EXPECTED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
            "16-true": torch.float16}


def is_true(cls: type) -> bool:
    """A true-precision plugin: 16-bit weights and default dtype instead of autocast (no `matmul_precision`: nothing
    but a layer kept in fp32 runs an fp32 matmul). Told by the precision string of an instance (some classes set it
    in `__init__`)."""
    return make(cls).precision.endswith("-true")
OWN_DEVICE = {"XPUPrecision"}
make = make_runnable


def test_discovery_pairs_every_trainer_plugin_with_its_fabric_class():
    assert {c.__name__ for c in FABRIC_PLUGINS} == {c.__name__ for c in TRAINER_PLUGINS}
    assert set(lightning_precision.__all__) >= {c.__name__ for c in TRAINER_PLUGINS}
    for cls in TRAINER_PLUGINS:
        fabric_cls = getattr(lightning_precision.fabric, cls.__name__)
        assert issubclass(cls, fabric_cls), f"{cls} must inherit {fabric_cls}, not copy it"
        assert cls.__qualname__ == fabric_cls.__qualname__  # checkpoint key: type(plugin).__qualname__


@pytest.mark.parametrize("cls", ALL)
def test_answers_the_logging_questions(cls):
    # Logging code written for one plugin works with any (real loops in tests/plugins/test_plugin_api.py); a loss scale is
    # reported exactly when there is one.
    plugin = make(cls)
    metrics = plugin.metrics()
    assert all(k.startswith("precision/") and isinstance(v, torch.Tensor) for k, v in metrics.items())
    assert plugin.loss_scale is None or isinstance(plugin.loss_scale, float)
    assert ("precision/loss_scale" in metrics) == (plugin.loss_scale is not None)
    assert plugin.skipped_steps == 0


@pytest.mark.parametrize("cls", ALL)
def test_precision_string_and_compute_dtype(cls):
    plugin = make(cls)
    assert EXPECTED[plugin.precision] == plugin.compute_dtype
    if is_true(cls):
        net = plugin.convert_module(make_net())
        assert {p.dtype for p in net.parameters()} == {plugin.compute_dtype}
        with plugin.forward_context():
            assert torch.get_default_dtype() == plugin.compute_dtype and not torch.is_autocast_enabled("cpu")
            assert torch.zeros(1).dtype == plugin.compute_dtype  # tensors made in the forward pass
            assert net(plugin.convert_input(torch.randn(2, 16))).dtype == plugin.compute_dtype
        assert torch.get_default_dtype() == torch.float32
        return
    with plugin.forward_context():
        assert torch.get_autocast_dtype("cpu") == plugin.compute_dtype
        assert make_net()(torch.randn(2, 16)).dtype == plugin.compute_dtype


@pytest.mark.parametrize("cls", ALL)
def test_state_restored_after_an_exception_in_the_forward_context(cls):
    torch.set_float32_matmul_precision("highest")
    plugin = make(cls) if is_true(cls) else make(cls, matmul_precision="medium")
    default_dtype = torch.get_default_dtype()
    with pytest.raises(RuntimeError, match="boom"):
        with plugin.forward_context():
            if is_true(cls):
                assert torch.get_default_dtype() == plugin.compute_dtype
            else:
                assert torch.get_float32_matmul_precision() == "medium"
            raise RuntimeError("boom")
    assert torch.get_default_dtype() == default_dtype
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_float32_matmul_precision() == "highest"


def _record_matmul_precision(net, seen):
    """Records the float32 matmul precision in effect inside the forward and the backward pass of ``net``."""

    def hook(module, args, out):
        seen.append(("forward", torch.get_float32_matmul_precision()))
        if out.requires_grad:
            out.register_hook(lambda g: seen.append(("backward", torch.get_float32_matmul_precision())))

    net.register_forward_hook(hook)


@pytest.mark.parametrize("cls", ALL)
def test_matmul_precision_holds_in_forward_and_backward_and_is_restored(cls):
    """Fabric never calls the plugin's teardown: the setting must not outlive the passes it is for."""
    if is_true(cls):
        pytest.skip(f"{cls.__name__} takes no matmul_precision (no fp32 matmul but in a layer kept fp32)")
    torch.set_float32_matmul_precision("highest")
    plugin = make(cls, matmul_precision="medium")
    seen = []
    if cls in TRAINER_PLUGINS:
        model = LitNet()
        _record_matmul_precision(model.net, seen)
        trainer(plugin, max_steps=1).fit(model, loader(make_data(1)))
    else:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = make_net()
        _record_matmul_precision(net, seen)
        model = fabric.setup(net)
        fabric.backward(model(torch.randn(2, 16)).sum())
        assert torch.get_float32_matmul_precision() == "highest"  # between the passes too
    assert ("forward", "medium") in seen and ("backward", "medium") in seen
    assert {p for _, p in seen} == {"medium"}
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("cls", ALL)
def test_device_comes_from_the_model_not_the_accelerator(cls):
    if cls.__name__ in OWN_DEVICE:
        pytest.skip(f"{cls.__name__} autocasts for its own device by design")
    plugin = cls()
    model = make_net()
    plugin.convert_module(model)
    assert plugin.device_type == "cpu"
    meta = make_net().to("meta")
    plugin.convert_module(meta)
    assert plugin.device_type == "meta"  # whatever the model's device is, not a guess such as "cuda"
    assert cls(device="cpu").device_type == "cpu"


def _trainable(module):
    return {id(p) for p in module.parameters() if p.requires_grad}


def _optimized(optimizer):
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def test_the_optimizer_holds_the_parameters_after_a_transformer_engine_conversion(monkeypatch):
    """The shared tester checks this for every plugin that runs here (torchao's fp8 conversion included); Transformer
    Engine needs CUDA: its modules here are the stand-in of tests/te_standin.py (TE's signatures, and
    fresh Parameters in every new module, as TE makes them)."""
    from tests import te_standin

    te = te_standin.install(monkeypatch)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 32),
                              torch.nn.Linear(32, 16))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    plugin = lightning_precision.fabric.FP8Precision(backend="transformer_engine", skip_small_layers=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fabric.setup(net, optimizer)
    assert type(net[2]) is te.Linear and type(net[1]) is te.LayerNorm
    assert _optimized(optimizer) == _trainable(net)


@pytest.mark.parametrize("cls", ALL)
def test_throughput_monitor_sees_the_real_compute_dtype(cls, monkeypatch):
    """Lightning's ThroughputMonitor takes the device's peak FLOPs for the plugin's dtype. On a CPU there is no peak to
    look up, so `get_available_flops` is replaced by a recorder of the dtype it is asked about (a GPU is what cannot
    exist here); the monitor itself is Lightning's own."""
    from lightning.fabric.utilities import throughput as fabric_throughput
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.callbacks import throughput_monitor as trainer_throughput

    asked = []
    for module in (fabric_throughput, trainer_throughput):
        monkeypatch.setattr(module, "get_available_flops", lambda device, dtype: asked.append(dtype))
    plugin = make(cls)
    if cls in TRAINER_PLUGINS:
        monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0])
        trainer(plugin, max_steps=1, callbacks=[monitor]).fit(LitNet(), loader(make_data(1)))
    else:
        fabric_throughput.ThroughputMonitor(L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]))
    assert asked == [plugin.compute_dtype]  # not torch.float32, as for every plugin Lightning does not know


def test_fp8_counts_against_the_fp8_peak_and_other_plugins_are_left_to_lightning():
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
    from lightning.pytorch.plugins.precision import MixedPrecision

    lightning_precision.FP8Precision()  # installs the dispatch (no model: nothing checks the hardware yet)
    assert _plugin_to_compute_dtype(lightning_precision.FP8Precision()) == torch.int8  # Lightning's key for the fp8 peak
    assert _plugin_to_compute_dtype(lightning_precision.FP8Precision(emulate=True)) == torch.bfloat16
    assert _plugin_to_compute_dtype(MixedPrecision("bf16-mixed", "cpu")) == torch.bfloat16
    assert _plugin_to_compute_dtype(FabricMixed("16-mixed", "cpu")) == torch.float16
    assert _plugin_to_compute_dtype(TrainerPrecision()) == torch.float32


from lightning.pytorch.callbacks import Callback  # noqa: E402

import lightning_precision.callbacks  # noqa: E402

CALLBACKS = discover(lightning_precision.callbacks, Callback)


# What a callback needs beside it to have anything to do: FP8Guard watches FP8Precision's layers (emulated fp8 here);
# MFUMonitor needs the model's FLOPs (it never guesses them) and a peak (a CPU has none in the table).
CALLBACK_NEEDS = {
    "FP8Guard": lambda: (lightning_precision.FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False),
                         {"every_n_steps": 1}),
    "MFUMonitor": lambda: (None, {"flops_per_batch": 10**6, "peak_tflops": 1.0}),
}
NEEDS_TORCHAO = {"FP8Guard"}


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_every_callback_fits_and_round_trips_its_state(cls, tmp_path):
    from tests.callbacks.test_channels_last import ConvModule, _images

    if cls.__name__ in NEEDS_TORCHAO:
        pytest.importorskip("torchao")
    plugin, kwargs = CALLBACK_NEEDS.get(cls.__name__, lambda: (None, {}))()
    callback = cls(**kwargs)
    trainer(plugin, max_steps=2, log_every_n_steps=1, callbacks=[callback], default_root_dir=tmp_path).fit(
        ConvModule(), _images())
    state = callback.state_dict()
    other = cls(**kwargs)
    other.load_state_dict(state)
    assert repr(other.state_dict()) == repr(state)


_NO_TRAINER_PROBE = r"""
import builtins, importlib, pkgutil, sys

asked = []
real_import, real_import_module = builtins.__import__, importlib.import_module


def record(importer, name):
    if importer.startswith("lightning_precision") and (name == "lightning.pytorch" or name.startswith("lightning.pytorch.")):
        asked.append(f"{importer} imports {name}")


def traced_import(name, globals=None, locals=None, fromlist=(), level=0):
    record((globals or {}).get("__name__", ""), name)
    return real_import(name, globals, locals, fromlist, level)


def traced_import_module(name, package=None):
    record(sys._getframe(1).f_globals.get("__name__", ""), name)
    return real_import_module(name, package)


builtins.__import__, importlib.import_module = traced_import, traced_import_module
import torch
import lightning as L
import lightning_precision.fabric as fabric

for info in pkgutil.walk_packages(fabric.__path__, "lightning_precision.fabric."):
    importlib.import_module(info.name)
plugins = [fabric.BF16MixedPrecision(skip_nonfinite=True), fabric.FP16MixedPrecision(),
           fabric.XPUPrecision(dtype="fp16", device="cpu")]
for plugin in plugins:  # a real Fabric step with each: setup, forward, backward, optimizer step, state
    f = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = torch.nn.Linear(4, 4)
    model, optimizer = f.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    f.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    plugin.metrics(), plugin.state_dict()
print("\n".join(sorted(set(asked))))
"""


def test_the_fabric_plugins_import_nothing_of_lightning_pytorch():
    """``lightning_precision.fabric`` and every module under it, imported and run in a fresh process, never import
    ``lightning.pytorch`` themselves. (``import lightning`` loads it anyway, through Lightning's own ``__init__``,
    so what is checked is which module asks for it.)"""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _NO_TRAINER_PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"Fabric modules that import lightning.pytorch:\n{result.stdout}"


def test_reading_the_device_type_runs_no_hardware_check(monkeypatch):
    """No GPU exists here: torch.cuda answers as a T4 (no bf16) and counts its questions. A property read asks the
    hardware nothing; the explicit resolution (Fabric's first forward, the Trainer's connect) raises as before."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: asked.append("capability") or (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    plugin = lightning_precision.fabric.BF16MixedPrecision(device="cuda")
    assert plugin.device_type == "cuda" and asked == []
    with pytest.raises(RuntimeError, match=r"found 'Tesla T4'"):
        with plugin.forward_context():
            pass
    assert asked == ["capability"]
    with pytest.raises(RuntimeError, match=r"found 'Tesla T4'"):
        plugin.resolve_device()  # nothing was remembered: asked again
