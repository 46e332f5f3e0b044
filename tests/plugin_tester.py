"""A reusable tester that runs every precision plugin of the package through the same checks (torchmetrics'
``MetricTester`` style): parity with a hand-written PyTorch loop, ``state_dict`` round-trip, pickling, a ``no_grad``
forward before the training forward, and the optimizer holding the model's own Parameters after setup.

Plugins are discovered from ``lightning_precision.fabric`` and ``lightning_precision._trainer``; each class name needs a
spec in ``SPECS`` below (how to build it runnably on a CPU, and its reference loop). A new plugin without one fails
``tests/plugins/test_plugin_tester.py`` with a message saying to add it: that is how new plugins get these checks.

Why parity is exact (``rtol=0, atol=0``): the plugin and the reference run the same torch ops in the same order on a
CPU, whose kernels are deterministic. What differs cannot change a bit: the plugins autocast with
``cache_enabled=False`` (the cache only reuses a cast, the same values), cast the model output to fp32 (exact) before a
loss that autocast runs in fp32 anyway, and scale, unscale and step through the same ``GradScaler`` arithmetic. Plugins
without loss scaling skip a step whose gradients hold inf/nan (``skip_nonfinite``, their guard at a scale of 1, which
multiplies by 1: exact); their reference skips such a step by hand, and their specs feed a NaN batch so that it does.

The true-precision plugins do not autocast: their reference casts the model and the inputs to the 16-bit dtype, and
steps by one of three hand-written recipes (``PluginSpec.true_step``), each what one of their settings must do exactly:
``"lightning"``, the optimizer on the 16-bit weights (Lightning's ``bf16-true``: ``update="nearest"``); ``"master"``,
fp32 master weights of which the model holds the nearest bf16 (``update="compensated"`` with fp32 states: weight and
remainder are the fp32 weight); ``"widened"``, each step on the 16-bit weights widened to fp32, gradients unscaled by
torch's ``GradScaler`` in fp32, the result rounded to nearest (``update="nearest"`` with fp32 states, fp16). Their
stochastic rounding (the default) has no hand-written twin here; tests/core/test_true_precision.py checks it against fp32.

Each check was seen to fail on a copy of the package broken on purpose: autocast disabled (parity, every plugin); the
scaler growing one step late (fp16 parity); ``load_state_dict`` ignoring the scaler state (round-trip); ``__getstate__``
losing the compute dtype (pickling); the autocast weight cache switched on, on torch 2.7 (no_grad forward); the fp8
conversion making new Parameters (optimizer parameters, and fp8 parity); a spec removed (its plugin's tests fail);
the guard left out (bf16, fp8 and XPU bf16 parity: the NaN batch reaches the weights); for the true-precision
plugins, the remainder ignored (compensated parity), fp32 states' low halves dropped (compensated and fp16 parity), and
the plugin holding a WeakSet of its fp32 layers (pickling: it did, and was fixed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from torch import nn

import lightning_precision._trainer
import lightning_precision.fabric
from lightning_precision import ScalerConfig
from tests.helpers import LitNet, loader, make_data, make_net, trainer


def discover(module: Any, base: type) -> list[type]:
    """The classes ``module.__all__`` exports that subclass ``base``."""
    found = [obj for name in module.__all__ if inspect.isclass(obj := getattr(module, name)) and issubclass(obj, base)]
    assert found, f"no plugin found in {module.__name__}"
    return found


FABRIC_PLUGINS = discover(lightning_precision.fabric, FabricPrecision)
TRAINER_PLUGINS = discover(lightning_precision._trainer, TrainerPrecision)


def is_trainer_plugin(cls: type) -> bool:
    return issubclass(cls, TrainerPrecision)


def plugin_id(cls: type) -> str:
    """``fabric.X`` or ``plugins.X``: the two classes of one name are told apart in test ids."""
    return f"{cls.__module__.split('.')[1]}.{cls.__name__}"


# ---- specs -----------------------------------------------------------------------------------------------------------


def _fp8_layer_2(net: nn.Module) -> None:
    """The reference's fp8 conversion: torchao's own verb, tensorwise recipe, emulated, on layer "2" of ``make_net``
    (32x32): the plugin leaves the first and the last linear layer in bf16 (``skip_first_last``), and the last (32x4)
    is not divisible by 16 either."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    convert_to_float8_training(net, config=config, module_filter_fn=lambda module, fqn: fqn == "2")


def _fp8_converted(net: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(net[2], Float8Linear) and type(net[0]) is nn.Linear and type(net[4]) is nn.Linear


# The scaler arguments of the fp16 specs, given to the plugin and to the reference's GradScaler alike. A small
# `growth_interval` and an fp16-overflowing batch make the scale grow, back off on a skipped step and grow again within
# a few steps, so that the scaler's arithmetic is compared too, and its state has moved by the round-trip.
_SCALER = {"init_scale": 1024.0, "growth_interval": 2}
_OVERFLOW_BATCHES = (2,)
_NAN_BATCHES = (2,)
_GUARD = {"skip_nonfinite": True}  # the non-finite guard, opt-in
@dataclasses.dataclass(frozen=True)
class PluginSpec:
    """How the tester runs one plugin class (its Fabric and its Trainer class alike)."""

    # Keyword arguments that make it run its real logic on a CPU.
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The reference loop: torch.autocast("cpu", dtype), and a torch.amp.GradScaler("cpu", **scaler) unless None.
    dtype: torch.dtype = torch.bfloat16
    scaler: dict[str, Any] | None = None
    # The reference's model conversion (fp8), done before its optimizer is built; and how to see that the plugin's
    # model was converted the same way.
    convert: Callable[[nn.Module], None] | None = None
    converted: Callable[[nn.Module], bool] | None = None
    # Batches of the training data whose inputs overflow fp16 (the step is skipped, the scale backs off).
    overflow_batches: tuple[int, ...] = ()
    # Without a loss scaler: whether the plugin skips steps with inf/nan gradients (`skip_nonfinite`), as its reference
    # then does by hand; and batches whose input is NaN (the loss and every gradient turn NaN: that step is skipped).
    guard: bool = False
    nan_batches: tuple[int, ...] = ()
    # Optional packages it needs (a missing one skips, naming the pip extra).
    requires: tuple[str, ...] = ()
    # The only admitted reason not to run: hardware that cannot exist here and cannot be emulated.
    cannot_run_here: str | None = None
    # A true-precision plugin (16-bit weights, no autocast): its reference recipe (module docstring), else None.
    true_step: str | None = None
    # Package bugs the checks found, "<fabric|plugins>.<check>" -> what is wrong: a strict xfail, so the check turns
    # red (XPASS) the day the bug is fixed, asking for the entry to go.
    known_bugs: dict[str, str] = dataclasses.field(default_factory=dict)

    def make(self, cls: type, **overrides: Any) -> Any:
        return cls(**{**self.kwargs, **overrides})

    def data(self, steps: int) -> Any:
        ds = make_data(steps, overflow_batches=self.overflow_batches)
        for b in self.nan_batches:
            if b < steps:
                ds.tensors[0][b * 8] = float("nan")  # one row is enough: the batch's mean loss is NaN
        return ds

    @property
    def skips(self) -> int:
        """Steps the plugin must skip in a fit of ``STEPS``."""
        return len(self.overflow_batches) + len(self.nan_batches)


# Per class name: variant id -> spec. Every variant runs every check.
SPECS: dict[str, dict[str, PluginSpec]] = {
    "BF16MixedPrecision": {
        "default": PluginSpec(),  # Lightning's behaviour: the plain loop
        "guarded": PluginSpec(kwargs=dict(_GUARD), guard=True, nan_batches=_NAN_BATCHES),
    },
    "FP16MixedPrecision": {
        "default": PluginSpec(kwargs=dict(_SCALER), dtype=torch.float16, scaler=dict(_SCALER),
                              overflow_batches=_OVERFLOW_BATCHES),
    },
    # XPUPrecision targets "xpu", which does not exist here; `device="cpu"` runs the same logic for the CPU.
    "XPUPrecision": {
        "bf16": PluginSpec(kwargs={"device": "cpu"}),
        "bf16-guarded": PluginSpec(kwargs={"device": "cpu", **_GUARD}, guard=True, nan_batches=_NAN_BATCHES),
        "fp16": PluginSpec(kwargs={"device": "cpu", "dtype": "fp16", "scaler": ScalerConfig(**_SCALER)}, dtype=torch.float16,
                           scaler=dict(_SCALER), overflow_batches=_OVERFLOW_BATCHES),
    },
    # torchao's fp8 numerics emulated on the CPU; `skip_small_layers=False` so that the 32x32 layer of the test net
    # is converted (it is far too small to gain on a GPU).
    "FP8Precision": {
        "torchao-tensorwise": PluginSpec(kwargs={"emulate": True, "skip_small_layers": False}, convert=_fp8_layer_2,
                                         converted=_fp8_converted, requires=("torchao",)),
        "torchao-tensorwise-guarded": PluginSpec(kwargs={"emulate": True, "skip_small_layers": False, **_GUARD},
                                                 convert=_fp8_layer_2, converted=_fp8_converted, requires=("torchao",),
                                                 guard=True, nan_batches=_NAN_BATCHES),
    },
    # FP8Precision with Transformer Engine's NVFP4 recipe: TE needs CUDA, NVFP4 a Blackwell GPU, and nothing emulates
    # it. Its own logic runs against the TE stand-in (tests/fp8/test_fp8_transformer_engine.py).
    # Always guarded (no `skip_nonfinite` argument): each variant is fed a batch to skip. The plugins' default,
    # stochastic rounding, runs every check but parity (it has no hand-written twin) in tests/core/test_true_precision.py.
    "BF16TruePrecision": {
        "nearest": PluginSpec(kwargs={"update": "nearest"}, true_step="lightning", guard=True, nan_batches=_NAN_BATCHES),
        "compensated-float32": PluginSpec(kwargs={"update": "compensated", "optimizer_states": "float32"},
                                          true_step="master", guard=True, nan_batches=_NAN_BATCHES),
    },
    "FP16TruePrecision": {
        "nearest-float32": PluginSpec(kwargs={"update": "nearest", "optimizer_states": "float32", **_SCALER},
                                      dtype=torch.float16, scaler=dict(_SCALER), true_step="widened",
                                      overflow_batches=_OVERFLOW_BATCHES),
    },
    "NVFP4Precision": {
        "te-nvfp4": PluginSpec(cannot_run_here="needs Transformer Engine and compute capability 10.0 (no emulation)"),
    },
}

_EXTRAS = {"torchao": "fp8"}
# The checks of PluginTester, as `known_bugs` keys name them.
CHECKS = ("parity", "state_round_trip", "pickling", "no_grad_forward", "optimizer_params")


def default_spec(cls: type) -> PluginSpec | None:
    """The first spec variant of ``cls`` (what other shared tests build it with), or None without a spec."""
    return next(iter(SPECS.get(cls.__name__, {}).values()), None)


def make_runnable(cls: type, **overrides: Any) -> Any:
    """``cls`` built to run here (its default spec's keyword arguments), with ``overrides``."""
    spec = default_spec(cls)
    return spec.make(cls, **overrides) if spec is not None else cls(**overrides)


def missing_spec_message(cls: type) -> str:
    return (
        f"{cls.__module__}.{cls.__qualname__} is a discovered precision plugin without a spec: add an entry"
        f" {cls.__name__!r} to SPECS in tests/plugin_tester.py (keyword arguments that run it on a CPU, the autocast"
        " dtype and scaler arguments of its hand-written reference loop, and any model conversion), so that it gets"
        " parity, state round-trip, pickling, no_grad-forward and optimizer-parameter checks."
    )


def cases(classes: list[type], check: str) -> list[Any]:
    """One ``pytest.param(cls, spec)`` per class and spec variant for ``check``; a class without a spec gets
    ``spec=None`` (the test then fails with ``missing_spec_message``); a spec that cannot run here is skipped with its
    reason; a known bug of the package is a strict xfail."""
    assert check in CHECKS, check
    params = []
    for cls in classes:
        variants = SPECS.get(cls.__name__)
        if not variants:
            params.append(pytest.param(cls, None, id=f"{plugin_id(cls)}-NO-SPEC"))
            continue
        for name, spec in variants.items():
            marks = [pytest.mark.skip(reason=spec.cannot_run_here)] if spec.cannot_run_here else []
            bug = spec.known_bugs.get(f"{plugin_id(cls).split('.')[0]}.{check}")
            if bug:
                marks.append(pytest.mark.xfail(reason=f"package bug: {bug}", strict=True))
            params.append(pytest.param(cls, spec, id=f"{plugin_id(cls)}-{name}", marks=marks))
    return params


# ---- runs ------------------------------------------------------------------------------------------------------------

STEPS = 6
LR = 0.1


@dataclasses.dataclass
class Run:
    losses: list[float]
    net: nn.Module
    plugin: Any = None
    scaler: torch.amp.GradScaler | None = None
    optimizer: Any = None
    grads: list[list[torch.Tensor | None]] = dataclasses.field(default_factory=list)
    output_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)  # the Trainer's model outputs


def _sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)  # LitNet.configure_optimizers' optimizer


def _nearest_bf16_ties_away(value: torch.Tensor) -> torch.Tensor:
    """fp32 to its nearest bf16, a tie rounded away from zero (torch's cast rounds it to even): the upper half of the
    bits after adding half the lower half's range, which is how a compensated weight holds its fp32 value."""
    bits = value.view(torch.int32)
    return (bits + (1 << 15)).bitwise_right_shift(16).to(torch.int16).view(torch.bfloat16)


def true_reference_loop(spec: PluginSpec, steps: int = STEPS) -> Run:
    """The hand-written recipes of the true-precision plugins (module docstring): the model and the inputs in the
    16-bit dtype, no autocast, the loss in fp32, a step with inf/nan gradients skipped."""
    net = make_net(0).to(spec.dtype)
    params = list(net.parameters())
    if spec.true_step == "lightning":
        stepped = params
    else:  # the fp32 weights the optimizer steps: kept ("master") or taken from the 16-bit ones each step ("widened")
        stepped = [nn.Parameter(p.detach().float()) for p in params]
    optimizer = torch.optim.SGD(stepped, lr=LR, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **spec.scaler) if spec.scaler is not None else None
    losses = []
    for x, y in loader(spec.data(steps)):
        loss = nn.functional.cross_entropy(net(x.to(spec.dtype)).float(), y)
        losses.append(float(loss))
        net.zero_grad()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        with torch.no_grad():
            for wide, p in zip(stepped, params, strict=True):
                if spec.true_step == "widened":
                    wide.copy_(p.float())
                if wide is not p:
                    wide.grad = p.grad.float()
        if scaler is not None:
            scaler.unscale_(optimizer)  # fp32 gradients: unscaled in fp32
            scaler.step(optimizer)
            scaler.update()
        elif all(torch.isfinite(p.grad).all() for p in params):
            optimizer.step()
        if spec.true_step != "lightning":
            with torch.no_grad():
                for wide, p in zip(stepped, params, strict=True):
                    p.copy_(_nearest_bf16_ties_away(wide) if spec.true_step == "master" else wide.to(p.dtype))
    return Run(losses, net, scaler=scaler, optimizer=optimizer)


def reference_loop(spec: PluginSpec, steps: int = STEPS) -> Run:
    """The plain PyTorch recipe the plugin must reproduce: autocast, a GradScaler for fp16, the fp8 conversion."""
    if spec.true_step is not None:
        return true_reference_loop(spec, steps)
    net = make_net(0)
    if spec.convert is not None:
        spec.convert(net)
    optimizer = _sgd(net)
    scaler = torch.amp.GradScaler("cpu", **spec.scaler) if spec.scaler is not None else None
    losses = []
    for x, y in loader(spec.data(steps)):
        with torch.autocast(device_type="cpu", dtype=spec.dtype):
            loss = nn.functional.cross_entropy(net(x), y)
        losses.append(float(loss))
        optimizer.zero_grad()
        if scaler is None:
            loss.backward()
            # The guard by hand: a step whose gradients are not all finite is not taken.
            if not spec.guard or all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None):
                optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
    return Run(losses, net, scaler=scaler, optimizer=optimizer)


def _fabric(plugin: Any) -> L.Fabric:
    return L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])


def fabric_fit(plugin: Any, spec: PluginSpec, steps: int = STEPS, teacher_first: bool = False,
               one_region: bool = False, on_setup: Callable[[Any, nn.Module], None] | None = None) -> Run:
    """A real Fabric loop, the optimizer built before ``setup`` (as Fabric asks). ``one_region`` puts each iteration's
    forwards and loss in one autocast region (``fabric.autocast()``, as a Trainer's training_step is); otherwise only
    the wrapped model's own forward context autocasts. ``teacher_first`` runs a no_grad forward before the training
    forward, as a teacher or an EMA target would."""
    fabric = _fabric(plugin)
    net = make_net(0)
    model, optimizer = fabric.setup(net, _sgd(net))
    if on_setup is not None:
        on_setup(plugin, net)
    run = Run([], net, plugin=plugin, optimizer=optimizer)
    for x, y in fabric.setup_dataloaders(loader(spec.data(steps))):
        with fabric.autocast() if one_region else contextlib.nullcontext():
            if teacher_first:
                with torch.no_grad():
                    model(x)
            # The loss in fp32 (autocast runs it so anyway; a true-precision model's output is 16-bit in one region).
            loss = nn.functional.cross_entropy(model(x).float(), y)
        run.losses.append(float(loss))
        optimizer.zero_grad()
        fabric.backward(loss)
        run.grads.append([p.grad.clone() if p.grad is not None else None for p in net.parameters()])
        optimizer.step()
    return run


class _Recorder(LitNet):
    """LitNet that records its gradients as the optimizer sees them (unscaled), and with ``teacher_first`` runs a
    no_grad forward (a teacher, an EMA target, a metric) before the forward it trains on, in the same training_step
    (one autocast region)."""

    def __init__(self, teacher_first: bool = False) -> None:
        super().__init__(lr=LR)
        self.teacher_first = teacher_first
        self.grads: list[list[torch.Tensor | None]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.teacher_first:
            with torch.no_grad():
                self(x)
        out = self(x)
        self.output_dtypes.append(out.dtype)
        # The loss in fp32, as in the reference (autocast runs it so anyway; a true-precision output is 16-bit).
        loss = nn.functional.cross_entropy(out.float(), y)
        self.losses.append(float(loss))
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append([p.grad.clone() if p.grad is not None else None for p in self.net.parameters()])


def trainer_fit(plugin: Any, spec: PluginSpec, steps: int = STEPS, teacher_first: bool = False,
                one_region: bool = True, callbacks: tuple[Callback, ...] = ()) -> tuple[Run, L.Trainer]:
    """A real Trainer fit. The whole training_step runs in the plugin's forward context: one autocast region."""
    assert one_region, "the Trainer runs training_step in one autocast region"
    model = _Recorder(teacher_first)
    t = trainer(plugin, max_steps=steps, callbacks=list(callbacks))
    t.fit(model, loader(spec.data(steps)))
    return Run(model.losses, model.net, plugin=plugin, optimizer=t.optimizers[0], grads=model.grads,
               output_dtypes=set(model.output_dtypes)), t


def fit(cls: type, plugin: Any, spec: PluginSpec, **kwargs: Any) -> Run:
    """A real fit with the plugin: the Trainer for Trainer classes, Fabric for Fabric classes."""
    if is_trainer_plugin(cls):
        return trainer_fit(plugin, spec, **kwargs)[0]
    return fabric_fit(plugin, spec, **kwargs)


# ---- assertions ------------------------------------------------------------------------------------------------------


def assert_exactly_equal(actual: Any, expected: Any, what: str) -> None:
    # NaN == NaN here: the fp16 specs' overflow batch has a NaN loss in both runs (module docstring: why exact).
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def assert_same_params(a: nn.Module, b: nn.Module, what: str) -> None:
    pa, pb = list(a.parameters()), list(b.parameters())
    assert len(pa) == len(pb), f"{what}: {len(pa)} parameters vs {len(pb)}"
    for i, (x, y) in enumerate(zip(pa, pb, strict=True)):
        assert_exactly_equal(x.detach(), y.detach(), f"{what}, parameter {i}")


def _probe_input() -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(7))


def forward_in(plugin: Any, net: nn.Module) -> torch.Tensor:
    with torch.no_grad(), plugin.forward_context():
        return net(plugin.convert_input(_probe_input()))  # (a true-precision plugin's model takes 16-bit inputs)


class PluginTester:
    """The checks, each for one plugin class and one spec; Trainer classes run real Trainer fits, Fabric classes real
    Fabric loops."""

    def __init__(self, cls: type, spec: PluginSpec | None) -> None:
        if spec is None:
            pytest.fail(missing_spec_message(cls), pytrace=False)
        for package in spec.requires:
            if importlib.util.find_spec(package) is None:
                pytest.skip(f"{cls.__name__} needs {package}: pip install 'lightning-precision[{_EXTRAS[package]}]'")
        self.cls, self.spec = cls, spec
        self.trainer_class = is_trainer_plugin(cls)

    def make(self, **overrides: Any) -> Any:
        return self.spec.make(self.cls, **overrides)

    # (1)
    def run_parity(self) -> None:
        """A few steps of a real fit give the very losses and weights of the hand-written loop (exact: see the
        module docstring), and the same final loss scale."""
        expected = reference_loop(self.spec)
        plugin = self.make()
        run = fit(self.cls, plugin, self.spec)
        assert len(run.losses) == STEPS
        if self.spec.converted is not None:
            assert self.spec.converted(run.net), f"{self.cls.__name__} did not convert the model as the reference"
        if self.trainer_class:  # the whole training_step ran in autocast, for the CPU, in the reference's dtype
            assert run.output_dtypes == {self.spec.dtype}
        assert_exactly_equal(run.losses, expected.losses, "losses")
        assert_same_params(run.net, expected.net, "weights after the fit")
        if expected.scaler is None:
            assert plugin.loss_scale is None
        else:
            assert plugin.loss_scale == expected.scaler.get_scale() != self.spec.scaler["init_scale"]
        assert plugin.skipped_steps == self.spec.skips
        assert self.spec.skips > 0 or not (self.spec.guard or self.spec.scaler), "give the spec a step to skip"

    # (2)
    def run_state_round_trip(self) -> None:
        """After some steps, the state loads into a fresh instance and comes out the same; where the plugin keeps
        state (a loss scale, its counters), it did move, so loading is not a no-op."""
        plugin = self.make()
        fit(self.cls, plugin, self.spec, steps=4)
        state = plugin.state_dict()
        fresh = self.make()
        untouched = fresh.state_dict()
        if self.spec.scaler is not None or self.spec.guard:
            assert state != untouched, "the scaler state (or the guard's counters) did not move during the fit"
        else:  # no state to round-trip: say so, rather than compare {} with {} as if it were one
            assert state == untouched == {}, "a plugin without a scaler grew state: give its spec what it keeps"
        fresh.load_state_dict(state)
        assert fresh.state_dict() == state
        assert fresh.loss_scale == plugin.loss_scale and fresh.skipped_steps == plugin.skipped_steps

    # (3)
    def run_pickling(self) -> None:
        """``pickle`` (ddp_spawn pickles the plugin) after setup and after steps: the copy has the same state and still
        works, a forward in its autocast giving the dtype and the values of the original's."""
        checked = []

        def check(plugin: Any, net: nn.Module) -> None:
            copy = pickle.loads(pickle.dumps(plugin))
            assert type(copy) is type(plugin)
            assert copy.state_dict() == plugin.state_dict()
            out, expected = forward_in(copy, net), forward_in(plugin, net)
            assert out.dtype == expected.dtype == self.spec.dtype
            assert torch.equal(out, expected)
            checked.append(True)

        plugin = self.make()
        if self.trainer_class:

            class PickleAtStart(Callback):
                def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                    check(trainer.precision_plugin, pl_module.net)

            run, _ = trainer_fit(plugin, self.spec, steps=3, callbacks=(PickleAtStart(),))
        else:
            run = fabric_fit(plugin, self.spec, steps=3, on_setup=check)
        check(plugin, run.net)
        assert len(checked) == 2

    # (4)
    def run_no_grad_forward(self) -> None:
        """A no_grad forward inside the plugin's forward context before the training forward leaves the gradients
        exactly as without it. Before pytorch#165068 (torch < 2.10 or so), autocast's weight cache kept the no_grad
        forward's casts, without grad history, for the rest of the autocast region: the next backward failed ("element
        0 of tensors does not require grad") or left those weights without gradients (Lightning #20644). Only torch
        releases before the fix show it (checked: with `cache_enabled=True` in the plugin, every case here fails on
        torch 2.7 and passes on 2.13): run this on the oldest torch the package admits."""
        # The cause, checked on every torch: the plugin's autocast keeps no weight cache (torch's attribute, read only).
        assert self.make().autocast_context_manager()._cache_enabled is False
        with_teacher = fit(self.cls, self.make(), self.spec, steps=2, teacher_first=True, one_region=True)
        without = fit(self.cls, self.make(), self.spec, steps=2, one_region=True)
        assert len(with_teacher.grads) == len(without.grads) == 2
        for step, (got, expected) in enumerate(zip(with_teacher.grads, without.grads, strict=True)):
            assert all(g is not None for g in got), f"step {step}: a parameter got no gradient"
            for i, (g, e) in enumerate(zip(got, expected, strict=True)):
                assert_exactly_equal(g, e, f"step {step}, gradient of parameter {i}")
        assert_exactly_equal(with_teacher.losses, without.losses, "losses")
        assert_same_params(with_teacher.net, without.net, "weights")

    # (5)
    def run_optimizer_params(self) -> None:
        """After setup (and the fp8 conversion it does) the optimizer's parameters are the very objects the model
        trains: Fabric builds the optimizer before `setup` converts the model, so a conversion that made new
        Parameters would leave the converted layers untrained. One step then changes every parameter."""
        plugin = self.make()
        if self.trainer_class:
            before = [p.detach().clone() for p in make_net(0).parameters()]  # _Recorder's net, before training
            run, t = trainer_fit(plugin, self.spec, steps=1)
            net, optimizer = run.net, t.optimizers[0]
        else:
            fabric, net = _fabric(plugin), make_net(0)
            before = [p.detach().clone() for p in net.parameters()]
            optimizer = _sgd(net)
            model, wrapped = fabric.setup(net, optimizer)
        if self.spec.converted is not None:
            assert self.spec.converted(net), f"{self.cls.__name__} did not convert the model"
        optimized = [p for group in optimizer.param_groups for p in group["params"]]
        trainable = [p for p in net.parameters() if p.requires_grad]
        assert len(optimized) == len(trainable) > 0
        assert all(a is b for a, b in zip(optimized, trainable, strict=True)), "the optimizer holds other Parameters than the model"
        if not self.trainer_class:
            x, y = next(iter(loader(make_data(1))))
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            wrapped.step()
        changed = [not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True)]
        assert all(changed), f"parameters {[i for i, c in enumerate(changed) if not c]} were not trained"
