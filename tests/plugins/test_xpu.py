"""Intel XPU support. No XPU exists on these machines: what runs here is the registration, the strategy choice, the
device parsing, the errors, the IPEX version guard (with package metadata made to disagree), and XPUPrecision's
autocast and scaler logic through the shared core on CPU (``device="cpu"``). Where a test needs torch to report an
XPU, ``torch.xpu``'s answers are stubbed, and the test says so. Nothing here has run on real Intel hardware."""

import importlib.metadata
import inspect
import math
import re
import sys
import types
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

import lightning_precision
from lightning_precision import ScalerConfig, XPUPrecision
from lightning_precision import fabric as lp_fabric
from lightning_precision._accelerators import TrainerXPUAccelerator, XPUAccelerator
from lightning_precision._accelerators.xpu import parse_xpu_devices
from lightning_precision._core.devices import check_fp64
from tests.helpers import LitNet, loader, make_data, params, trainer


def test_registered_under_xpu_in_both_registries():
    assert AcceleratorRegistry["xpu"]["accelerator"] is TrainerXPUAccelerator
    assert ACCELERATOR_REGISTRY["xpu"]["accelerator"] is XPUAccelerator
    assert issubclass(TrainerXPUAccelerator, XPUAccelerator)


@pytest.mark.parametrize("make", [lambda: L.Trainer(accelerator="xpu"), lambda: L.Fabric(accelerator="xpu")],
                         ids=["trainer", "fabric"])
def test_no_xpu_is_a_clear_error_naming_what_was_found(make):
    with pytest.raises(RuntimeError, match=r"accelerator='xpu'.*no Intel XPU is available: torch .*found instead: .*cpu"):
        make()


@pytest.fixture
def fake_xpus(monkeypatch):
    """torch.xpu reports two devices (stubbed: no XPU exists here)."""
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)


def test_parse_devices(fake_xpus):
    assert parse_xpu_devices(1) == [0] and parse_xpu_devices(-1) == [0, 1] and parse_xpu_devices("auto") == [0, 1]
    assert parse_xpu_devices("0,1") == [0, 1] and parse_xpu_devices([1]) == [1]
    with pytest.raises(ValueError, match="asks for 3 XPU.*2 are available"):
        parse_xpu_devices(3)
    with pytest.raises(ValueError, match=r"indices \[5\] do not exist"):
        parse_xpu_devices([5])


def test_the_xpu_strategy_is_a_public_object_for_trainer_and_fabric(fake_xpus):
    single = L.Trainer(strategy=TrainerXPUAccelerator.strategy(devices=1), logger=False).strategy
    assert type(single) is SingleDeviceStrategy and single.root_device == torch.device("xpu", 0)  # Lightning: cpu
    assert isinstance(single.accelerator, TrainerXPUAccelerator)
    ddp = L.Trainer(strategy=TrainerXPUAccelerator.strategy(devices=2), logger=False).strategy
    assert isinstance(ddp, DDPStrategy) and ddp.process_group_backend == "xccl"  # Lightning: gloo
    assert ddp.parallel_devices == [torch.device("xpu", 0), torch.device("xpu", 1)]
    fabric = L.Fabric(strategy=XPUAccelerator.strategy(devices=1))
    assert fabric.device == torch.device("xpu", 0)
    assert L.Fabric(strategy=XPUAccelerator.strategy(devices=2))._strategy._process_group_backend == "xccl"
    assert isinstance(TrainerXPUAccelerator.strategy(devices=1, num_nodes=2), DDPStrategy)  # several nodes: DDP


def test_lightnings_wrong_strategy_choice_is_stopped_with_the_fix(fake_xpus):
    # accelerator="xpu" alone: Lightning picks a CPU single-device strategy, and DDP over gloo. Both are stopped when
    # the fit sets them up (before any step), saying what to pass instead.
    model = LitNet()
    with pytest.raises(ValueError, match=r"CPU strategy.*TrainerXPUAccelerator.strategy"):
        trainer(None, accelerator="xpu", devices=1).fit(model, loader(make_data(1)))
    assert model.losses == []  # stopped before the first step
    single = L.Trainer(accelerator="xpu", devices=1, logger=False)
    assert single.strategy.root_device.type == "cpu"  # Lightning's choice, left as it is
    with pytest.raises(ValueError, match=r"CPU strategy.*strategy=TrainerXPUAccelerator.strategy\(devices=\.\.\.\)"):
        single.accelerator.setup_device(single.strategy.root_device)
    with pytest.raises(ValueError, match=r"strategy=XPUAccelerator.strategy"):
        XPUAccelerator().setup_device(torch.device("cpu"))
    ddp = L.Trainer(accelerator="xpu", devices=2, logger=False)
    with pytest.raises(ValueError, match=r"'gloo', which cannot reduce XPU tensors.*xccl"):
        ddp.accelerator.setup(ddp)
    # An explicit backend is the user's choice (oneCCL's "ccl" reduces XPU tensors): left alone.
    ccl = L.Trainer(strategy=DDPStrategy(accelerator=TrainerXPUAccelerator(), process_group_backend="ccl"),
                    devices=2, logger=False)
    ccl.accelerator.setup(ccl)


def test_importing_the_package_patches_nothing_of_lightnings():
    from lightning.fabric.connector import _Connector
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    for connector in (_Connector, _AcceleratorConnector):
        for name in ("_choose_strategy", "_set_parallel_devices_and_init_accelerator"):
            method = getattr(connector, name)
            # A wrapper made with functools.wraps copies __module__; it cannot hide its file or __wrapped__.
            assert not hasattr(method, "__wrapped__"), (connector, name)
            assert Path(inspect.getfile(method)).is_relative_to(Path(L.__file__).parent), (connector, name)
    assert L.Trainer(accelerator="cpu", devices=1, logger=False).strategy.root_device.type == "cpu"


def test_an_existing_xpu_registration_is_never_replaced():
    from lightning.fabric.accelerators.registry import _AcceleratorRegistry

    class TheirXPU(XPUAccelerator):
        pass

    registry = _AcceleratorRegistry()
    registry.register("xpu", TheirXPU, description="registered first")
    XPUAccelerator.register_accelerators(registry)
    assert registry["xpu"]["accelerator"] is TheirXPU
    empty = _AcceleratorRegistry()
    XPUAccelerator.register_accelerators(empty)
    assert empty["xpu"]["accelerator"] is XPUAccelerator


def test_precision_bf16_autocasts_with_the_dtype_passed_and_no_scaler():
    plugin = lp_fabric.XPUPrecision(device="cpu")
    assert (plugin.precision, plugin.compute_dtype, plugin.scaler) == ("bf16-mixed", torch.bfloat16, None)
    with plugin.forward_context():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert plugin.state_dict() == {} and plugin.metrics() == {}
    guarded = lp_fabric.XPUPrecision(device="cpu", skip_nonfinite=True)  # the non-finite guard's counters, no scale
    assert (guarded.scaler, guarded.loss_scale) == (None, None)
    assert guarded.state_dict() == {"skipped_steps": 0, "optimizer_steps": 0, "consecutive_skips": 0}
    assert set(guarded.metrics()) == {"precision/skipped_steps"}
    assert XPUPrecision().autocast_context_manager().device == "xpu"  # the real target, dtype explicit
    assert XPUPrecision().autocast_context_manager().fast_dtype == torch.bfloat16


def test_xpu_precision_is_not_an_fp16_plugin_and_bf16_owns_no_scaler():
    # Code that asks "is this fp16?" with isinstance must not get yes for a bf16 XPU plugin.
    for module in (lp_fabric, lightning_precision):
        assert not isinstance(module.XPUPrecision(device="cpu"), module.FP16MixedPrecision)
        assert not isinstance(module.XPUPrecision(dtype="fp16", device="cpu"), module.FP16MixedPrecision)
    assert XPUPrecision(dtype="fp16", device="cpu").scaler.is_enabled()


def test_xpu_bf16_refuses_a_scaler_it_would_ignore():
    # It did nothing in bf16 (a warning said so, easily missed): a user who sets a scale believes the loss is scaled.
    with pytest.raises(ValueError, match=r"XPUPrecision\(dtype='bf16', scaler=ScalerConfig\(.*would do nothing.*dtype='fp16'"):
        XPUPrecision(device="cpu", scaler=ScalerConfig())
    plugin = XPUPrecision(dtype="fp16", device="cpu", scaler=ScalerConfig(init_scale=1024.0))
    assert plugin.loss_scale == 1024.0


@pytest.mark.parametrize("module", [lightning_precision, lp_fabric], ids=["trainer", "fabric"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_xpu_takes_the_scaler_as_one_config_only(module, dtype):
    """The loss scaler's options are one ``ScalerConfig`` (flat arguments are FP16MixedPrecision's shorthand only): a
    flat one is an unknown keyword, a plain ``TypeError`` as Python gives for any misspelt argument, in either dtype."""
    for name in ("init_scale", "growth_interval", "init_scael"):
        with pytest.raises(TypeError, match=rf"XPUPrecision.*__init__\(\) got an unexpected keyword argument '{name}'"):
            module.XPUPrecision(dtype=dtype, device="cpu", **{name: 2})
    assert "init_scale" not in inspect.signature(module.XPUPrecision).parameters


def test_precision_fp16_trains_with_the_scaler_on_a_real_fit():
    plugin = XPUPrecision(dtype="fp16", device="cpu", scaler=ScalerConfig(init_scale=1024.0))
    model = LitNet()
    trainer(plugin, max_steps=4).fit(model, loader(make_data(4, overflow_batches=(1,))))
    assert set(model.output_dtypes) == {torch.float16}
    assert plugin.skipped_steps == 1 and plugin.loss_scale == 512.0
    assert not math.isfinite(model.losses[1]) and all(math.isfinite(x) for i, x in enumerate(model.losses) if i != 1)


def test_bf16_trains_on_a_real_fit_and_resumes(tmp_path):
    model = LitNet()
    t = trainer(XPUPrecision(device="cpu"), max_epochs=1)
    t.fit(model, loader(make_data(2)))
    t.save_checkpoint(tmp_path / "x.ckpt")
    assert set(model.output_dtypes) == {torch.bfloat16}
    resumed = LitNet()
    trainer(XPUPrecision(device="cpu"), max_epochs=1).fit(resumed, loader(make_data(2)), ckpt_path=tmp_path / "x.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(model), strict=True))


def test_fp16_without_fp64_says_use_bf16():
    check_fp64(types.SimpleNamespace(name="Intel Arc A770", has_fp64=True))
    with pytest.raises(RuntimeError, match=r"GradScaler needs fp64.*Intel Arc A770.*dtype='bf16'"):
        check_fp64(types.SimpleNamespace(name="Intel Arc A770", has_fp64=False))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"dtype='fp8'"):
        XPUPrecision(dtype="fp8")
    with pytest.raises(ValueError, match=r"ipex='yes'"):
        XPUPrecision(ipex="yes")


@pytest.fixture
def ipex_metadata(monkeypatch):
    """Make package metadata report an IPEX version (no IPEX is installed: it pins torch 2.8)."""
    real = importlib.metadata.version

    def set_version(version):
        def fake(name):
            if name == "intel-extension-for-pytorch":
                if version is None:
                    raise importlib.metadata.PackageNotFoundError(name)
                return version
            return real(name)

        monkeypatch.setattr(importlib.metadata, "version", fake)

    return set_version


def test_ipex_for_another_torch_is_never_imported(ipex_metadata):
    # IPEX's last release is 2.8.10, for torch 2.8; whatever torch runs here, take an IPEX built for another minor
    # version: importing it would os._exit(127).
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    other = "2.8" if (major, minor) != (2, 8) else "2.7"
    ipex_metadata(f"{other}.10+xpu")
    with pytest.raises(RuntimeError, match=rf"built for torch {re.escape(other)}, this is torch"
                                           rf" {re.escape(torch.__version__)}.*ipex=False"):
        XPUPrecision(ipex=True)
    assert XPUPrecision(ipex="auto")._ipex_module is None  # quiet fallback to upstream torch
    assert "intel_extension_for_pytorch" not in sys.modules


def test_ipex_not_installed(ipex_metadata):
    ipex_metadata(None)
    with pytest.raises(RuntimeError, match="not installed"):
        XPUPrecision(ipex=True)
    assert XPUPrecision(ipex="auto")._ipex_module is None


def test_matching_ipex_optimizes_model_and_optimizer_in_place(ipex_metadata, monkeypatch):
    """A stand-in IPEX module (IPEX cannot be installed beside this torch) records the call."""
    ipex_metadata(torch.__version__.split("+")[0])
    calls = []
    stand_in = types.ModuleType("intel_extension_for_pytorch")
    stand_in.optimize = lambda model, optimizer=None, dtype=None, inplace=False: calls.append((model, optimizer, dtype, inplace)) or (model, optimizer)
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", stand_in)
    plugin = XPUPrecision(ipex=True, device="cpu")
    model = LitNet()
    trainer(plugin, max_steps=1).fit(model, loader(make_data(1)))
    ((optimized, optimizer, dtype, inplace),) = calls
    assert optimized is model and isinstance(optimizer, torch.optim.SGD) and dtype == torch.bfloat16 and inplace


class _LBFGSNet(LitNet):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_bf16_has_no_scaler_so_a_closure_optimizer_trains_as_with_lightning():
    # LBFGS re-evaluates its closure inside `step`: only a loss scaler cannot drive it. In bf16 XPUPrecision has none,
    # so the step must be Lightning's closure-driven one (calling the closure first and stepping without it fails).
    model = _LBFGSNet()
    before = [p.detach().clone() for p in model.parameters()]
    trainer(XPUPrecision(device="cpu"), max_steps=2).fit(model, loader(make_data(2)))
    assert len(model.losses) > 2  # LBFGS evaluated the closure several times per step
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert set(model.output_dtypes) == {torch.bfloat16}
    with pytest.raises(ValueError, match="LBFGS"):
        trainer(XPUPrecision(dtype="fp16", device="cpu"), max_steps=1).fit(_LBFGSNet(), loader(make_data(1)))


def test_the_guard_on_an_xpu_without_fp64_stands_aside_and_says_so(monkeypatch):
    """No XPU exists here: torch.xpu's answers are stubbed to those of an Arc A770 (no fp64). torch's GradScaler, which
    the guard's check runs through, computes in fp64 there; the fp16 scaler refuses such a device
    (test_fp16_without_fp64_says_use_bf16), the bf16 guard steps aside with a warning instead of failing the run."""
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "get_device_properties",
                        lambda *a: types.SimpleNamespace(name="Intel Arc A770", has_fp64=False))
    plugin = lp_fabric.XPUPrecision(skip_nonfinite=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plugin.device_type == "xpu"  # a property read asks no hardware
    assert plugin.skip_nonfinite
    with pytest.warns(lightning_precision.NoEffectWarning, match=r"'Intel Arc A770' has no fp64.*not skipped"):
        plugin.resolve_device()  # the explicit step (Fabric's first forward, the Trainer's connect)
    assert (plugin.skip_nonfinite, plugin.metrics()) == (False, {})
