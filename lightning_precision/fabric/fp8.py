"""fp8 training for Fabric: fp8 linear layers (torchao or Transformer Engine) inside bf16 autocast.

``FP8Precision`` is a thin plugin over three parts, each a private module of one concern: the backend that runs the
layers (the protocol of ``_core.fp8.backend``; torchao's and Transformer Engine's in ``_core.fp8.backends``), the layer
book (``_core.fp8.layers``: what each layer runs and why, the plan in force, moving layers in place) and
``layers="auto"``'s measuring (``_core.fp8.calibration``). Its arguments are checked in ``_core.fp8.args``."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_precision._core import fsdp
from lightning_precision._core.autocast import MatmulPrecision
from lightning_precision._core.fp8.args import check_eval_gather, check_fp8_args, check_precision_args, shown_layers
from lightning_precision._core.fp8.backend import FP8Backend
from lightning_precision._core.fp8.backends import make_backend
from lightning_precision._core.fp8.calibration import (
    Calibration,
    PlanSetup,
    ShapeTiming,
    decide,
    runs_here,
    start_calibration,
    start_timing,
    timed_plan,
)
from lightning_precision._core.fp8.layers import CONVERTED, LayerBook, families_of
from lightning_precision._core.scaled import SKIP_NONFINITE_DEFAULT, ScaledPrecision
from lightning_precision._core.scaling.scaler import ScalerConfig
from lightning_precision._warnings import warn
from lightning_precision.fp8._decision import chooses_formats
from lightning_precision.fp8._plan import PlanLike, PlanRule, PrecisionPlan, high_label
from lightning_precision.fp8._selection import (
    TE_NVFP4,
    FP8LayerPolicy,
    LayerDecision,
    ModuleFilter,
    RecipeLike,
    select_fp8_layers,
)
from lightning_precision.fp8._step_shapes import CompileWatch
from lightning_precision.fp8._timing import Timer, timer_for

__all__ = ["FP8Precision", "NVFP4Precision"]


def _set_backend(plugin: FP8Precision, name: str) -> None:
    """The same resolved recipe under another backend's rules (tests see a backend's refusals without its package)."""
    plugin._backend = make_backend(name, type(plugin).__name__, like=plugin._backend)


class FP8Precision(ScaledPrecision):
    """fp8 linear layers inside high-precision autocast: ``Fabric(plugins=[FP8Precision()])``.

    Args:
        backend: ``"torchao"`` (default; ``convert_to_float8_training``) or ``"transformer_engine"``
            (``te.autocast(recipe=...)``, TE >= 2.9; ``nn.Linear``/``nn.LayerNorm`` replaced by TE modules).
        recipe: torchao: ``"tensorwise"`` (default), ``"rowwise"``, ``"rowwise_with_gw_hp"``, a ``Float8LinearConfig``,
            or ``"mxfp8"`` (torchao's MXFP8 training layer; compute capability >= 10.0, or ``emulate=True``; dims
            divisible by 32). TE: ``"delayed"`` (default), ``"current"``, ``"mxfp8"``, ``"block"``, a mapping
            ``{"name": "delayed", "amax_history_len": 16, ...}`` or a TE recipe object.
        emulate: run torchao's fp8 numerics without fp8 hardware (CPU included), slowly. torchao only.
        compute_dtype: the high-precision dtype of everything that is not an fp8 GEMM (bf16 or fp16). With fp16 the
            loss is scaled by ``FP16MixedPrecision``'s bounded scaler (its skipped steps, logging, held schedulers and
            checkpoints): without it, gradients below fp16's range flush to zero in the high-precision layers.
        scaler: fp16 compute only: the loss scaler's arguments as one :class:`~lightning_precision.ScalerConfig`
            (``None``: its defaults). With bf16 compute a ``ValueError``: bf16 needs no loss scaling.
        skip_nonfinite: bf16 compute: ``True`` skips an optimizer step whose gradients hold inf or nan instead of
            writing NaN into every weight, counted in ``skipped_steps`` (as ``BF16MixedPrecision``; default ``False``).
            With fp16 compute the loss scaler always skips them.
        max_consecutive_skips: skipped steps in a row before ``SkippedStepsError`` (default 50; None: never). With fp16
            compute it is the scaler's (or give it in ``scaler``); with bf16, ``skip_nonfinite=True`` only.
        layer_policy: which linear layers run in fp8, as one :class:`~lightning_precision.fp8.FP8LayerPolicy`; or
            the same three choices flat (not both):
        module_filter: ``(module, fqn) -> bool`` choosing the linear layers that run in fp8; replaces the defaults.
        skip_small_layers: leave layers too small to gain in high precision (thresholds in ``lightning_precision.fp8``).
        skip_first_last: leave the first and last linear layers that run as modules in high precision.
        layers: which eligible layers run in fp8. ``None`` (default): all that the shape rules leave. ``"auto"``: the
            first ``calibration_batches`` training batches run in ``compute_dtype`` while each eligible layer's fp8
            numerics are measured (``lightning_precision.fp8.fp8_sensitivity``; none is reported fp8 meanwhile; a batch
            whose loss is not finite is left out); at the first optimizer step after them the layers ``plan_rule``
            accepts are converted (same Parameter objects: the optimizer is untouched) and the plan is logged and kept
            in ``plan`` and in checkpoints. A plan made here belongs to its model: set up with another model, the plugin
            measures again. A ``PrecisionPlan`` or the path of a saved one (YAML/JSON): its fp8 layers, as saved
            (``skip_small_layers``/``skip_first_last`` do not apply; a plan with ``module_filter`` is refused). A plan's
            layer may name its own format (``precision: rowwise``; ``"fp8"`` is the plugin's ``recipe``): under torchao
            each layer is converted in its format, tensorwise, rowwise, rowwise_with_gw_hp and MXFP8 side by side.
        calibration_batches: with ``layers="auto"``, how many batches to measure (default 8): Trainer training steps
            (whatever the optimizers or the gradient accumulation), Fabric backward passes. With fp16 compute, batches
            whose step the loss scaler skipped (its overflows) are measured again.
        plan_rule: with ``layers="auto"``, the thresholds (``PlanRule()`` by default).
        candidates: with ``layers="auto"``, the formats each layer chooses among (high precision is always a choice):
            torchao's ``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``, ``"mxfp8"``. Default: the ``recipe``
            when one is passed (fp8 in it or high precision, as before), else what the backend and the device run.
            Transformer Engine runs one recipe per model: its only candidate is the plugin's ``recipe``.
        fsdp_float8_all_gather: torchao, tensorwise: FSDP2 all-gathers the fp8 layers' weights in fp8 (a quarter of
            fp32's bytes), and their scales are precomputed after each optimizer step. ``None`` (default): on when the
            model is known to be sharded by FSDP2 at conversion (the Trainer's ``ModelParallelStrategy``, with
            ``convert_module`` called in ``configure_model``); off otherwise, since the weights then become torchao
            tensor subclasses that a plain ``torch.load`` cannot read without torchao. Fabric with FSDP2: pass True.
        eval_precision: what validation, test and predict run in: ``None`` (default) as it trains, fp8 included;
            ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``: without fp8 (the fp8 layers compute as plain linear
            layers meanwhile; docs/evaluation.md).
        device, matmul_precision, reduce_dtype: as for every plugin.
    """

    _nvfp4 = False  # NVFP4Precision's recipes are NVFP4's, and only those

    def __init__(
        self,
        *,
        backend: Literal["torchao", "transformer_engine"] = "torchao",
        recipe: RecipeLike | None = None,
        emulate: bool = False,
        compute_dtype: torch.dtype = torch.bfloat16,
        layer_policy: FP8LayerPolicy | None = None,
        module_filter: ModuleFilter | None = None,
        skip_small_layers: bool = True,
        skip_first_last: bool = True,
        device: str | None = None,
        matmul_precision: MatmulPrecision | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        fsdp_float8_all_gather: bool | None = None,
        layers: PlanLike | None = None,
        calibration_batches: int | None = None,
        plan_rule: PlanRule | None = None,
        scaler: ScalerConfig | None = None,
        skip_nonfinite: bool = SKIP_NONFINITE_DEFAULT,
        max_consecutive_skips: int | None = ScalerConfig.max_consecutive_skips,
        candidates: tuple[str, ...] | None = None,
        eval_precision: str | None = None,
    ) -> None:
        owner = type(self).__name__
        self.layer_policy, config = check_precision_args(owner, backend, compute_dtype, layer_policy, module_filter,
                                                         skip_small_layers, skip_first_last, scaler,
                                                         max_consecutive_skips)
        check_eval_gather(owner, eval_precision, fsdp_float8_all_gather)
        super().__init__(compute_dtype, config, True, device, matmul_precision, reduce_dtype,
                         skip_nonfinite=skip_nonfinite, max_consecutive_skips=max_consecutive_skips,
                         eval_precision=eval_precision)
        # Resolved now, so a bad recipe or a missing package fails at construction, not mid-setup.
        self._backend: FP8Backend = make_backend(backend, owner, recipe, emulate)
        self._recipe_shown = None if recipe is None else self._backend_recipe_name(recipe)
        self.precision = cast(Any, self._backend.lightning_precision(compute_dtype))  # Lightning's Literal of them
        self._args = check_fp8_args(owner, self._backend, self._nvfp4, recipe, compute_dtype, self.layer_policy,
                                    fsdp_float8_all_gather, layers, calibration_batches, plan_rule, candidates)
        self._book = LayerBook(owner, "NVFP4" if self._nvfp4 else "fp8", compute_dtype, self._high, self._args)
        self._calibration: Calibration | None = None
        self._compile_watch: CompileWatch | None = None  # whether the model runs compiled: seen at its first forward
        self._compiled = False
        self._models: list[weakref.ref[Module]] = []  # every model set up (a GAN's two): evaluated without fp8

    # Read-only: what the backend resolved, the checked layer arguments, the layer book's records, `layer_policy`'s.
    backend = property(lambda self: self._backend.name, _set_backend)
    recipe = property(lambda self: self._backend.recipe)
    emulate = property(lambda self: self._backend.emulate)
    scaling_family = property(lambda self: self._backend.scaling_family)
    moves_layers = property(lambda self: self._backend.moves_layers)  # in place: `demote`, `step_down`, FP8Guard
    fsdp_float8_all_gather = property(lambda self: self._args.fsdp_float8_all_gather)
    layers = property(lambda self: self._args.layers)
    calibration_batches = property(lambda self: self._args.calibration_batches)
    plan_rule = property(lambda self: self._args.plan_rule)
    candidates = property(lambda self: self._args.candidates)
    layer_decisions = property(lambda self: self._book.decisions)
    plan = property(lambda self: self._book.plan)
    _float8_all_gather = property(lambda self: self._book.float8_all_gather)
    _high = property(lambda self: high_label(self.compute_dtype))  # a plan's label of a layer in `compute_dtype`
    module_filter = property(lambda self: self.layer_policy.module_filter)
    skip_small_layers = property(lambda self: self.layer_policy.skip_small_layers)
    skip_first_last = property(lambda self: self.layer_policy.skip_first_last)

    def _to_be_sharded(self, module: Module) -> bool:
        """Whether FSDP2 is about to shard ``module`` (the plugin then converts before ``fully_shard``): unseen here,
        Fabric shards in ``parallelize_fn`` (``fsdp_float8_all_gather=True`` asks); the Trainer's plugin knows."""
        return False

    @property
    def peak_flops_dtype(self) -> torch.dtype:
        """ThroughputMonitor's MFU counts against the fp8 peak (Lightning's tables list it under ``torch.int8``, as for
        its own TransformerEnginePrecision) when layers really run in fp8; against ``compute_dtype`` when emulated or
        when no layer was chosen."""
        no_fp8 = self.emulate or (self.layer_decisions and not any(d.fp8 for d in self.layer_decisions))
        return self.compute_dtype if no_fp8 else torch.int8

    @override
    def convert_module(self, module: Module) -> Module:
        """Convert the chosen linear layers to fp8 (once: a converted model is left as it is). Under FSDP2 this must
        run before ``fully_shard``: Fabric does it in ``setup``; with the Trainer, call
        ``self.trainer.precision_plugin.convert_module(self)`` at the top of ``configure_model``."""
        if not getattr(module, CONVERTED, False):  # validate/test after fit: converting twice would nest
            module = self._convert(module)
        self._models = [ref for ref in self._models if ref() not in (None, module)] + [weakref.ref(module)]
        return super().convert_module(module)

    def _convert(self, module: Module) -> Module:
        if self.layers in (None, "auto"):  # a plan given as `layers=` is applied to whatever model
            self._book.meet(module, measured=self.layers == "auto")
        if self.plan is not None and self.layers == "auto":  # restored from a checkpoint before conversion
            return self._apply_plan(module, restored=True)
        decisions = (self._book.decisions_of_plan(module, self._backend) if self.plan is not None
                     else select_fp8_layers(module, self.scaling_family, layer_policy=self.layer_policy))
        if self.layers == "auto":  # and no plan: measure first
            return self._start_calibration(module)
        if self.plan is None and self._timer() is not None and not self._sharding(module):
            self._calibration = start_timing(module, decisions, self._calibration)  # time first (a CUDA GPU)
            self._book.measure(module, self._calibration.measuring())
            self._watch_compile(module, self._calibration.decisions)
            return module
        module = self._book.convert(module, decisions, self._backend, lambda: self._to_be_sharded(module))
        self._watch_compile(module, self._book.decisions)
        return module

    def _timer(self) -> Timer | None:
        """This CUDA GPU's timer where fp8 runs for real on it through torchao (``fp8._timing``'s seam); None
        elsewhere: on a CPU, with ``emulate=True``, or with Transformer Engine (whose recipes torchao cannot time:
        the shape rules' thresholds stand)."""
        return timer_for(self._backend.name, self.emulate)

    def _sharding(self, module: Module) -> bool:
        """Whether FSDP2 shards ``module`` (or is known to be about to): its layers convert before ``fully_shard``, so
        before any batch could show their shapes: the shape rules' thresholds decide, as without a GPU."""
        return self._to_be_sharded(module) or fsdp.is_sharded(module) or self.fsdp_float8_all_gather is True

    def _watch_compile(self, module: Module, decisions: list[LayerDecision]) -> None:
        """Watch the first forward of any eligible layer: does the model run under ``torch.compile``? (The plugin never
        sees the compiled wrapper: Fabric unwraps it, the Trainer compiles the LightningModule's forward.) torchao
        only: Transformer Engine fuses its casts in its own kernels, compiled or not, and its layers are not timed."""
        if self._compile_watch is not None:
            self._compile_watch.close()
        eligible = [module.get_submodule(d.fqn) for d in decisions if d.fp8]
        watched = eligible and self._backend.name == "torchao"
        self._compile_watch = CompileWatch(eligible) if watched else None

    @property
    def _choosing(self) -> bool:
        """Whether ``layers="auto"`` chooses among formats (several candidates, or an error budget), not fp8-or-not."""
        return chooses_formats(self.candidates, self.plan_rule)  # the one rule, `make_plan`'s too

    def _plan_setup(self) -> PlanSetup:
        timer = self._timer()
        allowed = self.candidates if self._choosing and self.candidates else (self._backend.recipe_format,)
        timed = tuple(f for f in allowed if runs_here(f)) if timer is not None else ()  # this GPU's own capability
        return PlanSetup(type(self).__name__, self.layer_policy, self._choosing, self.candidates, self.plan_rule,
                         self.scaling_family, self._backend.name, self._high, self._probe_config, timer, timed,
                         self._compiled)

    def _probe_config(self) -> Any:
        return self._backend.probe_config()

    def _start_calibration(self, module: Module) -> Module:
        self._calibration = start_calibration(module, self._plan_setup(), self.calibration_batches or 8,
                                              self._to_be_sharded(module), self._calibration)
        self._book.measure(module, self._calibration.measuring())
        self._watch_compile(module, self._calibration.decisions)
        return module

    def _decide(self, decisions: list[LayerDecision], sensitivity: dict[str, Any],
                not_measured: str | None = None, speed: Any = None) -> PrecisionPlan:
        """``layers="auto"``'s plan (the one place it is made: ``fp8_calibration.decide``); ``speed``: the layers timed
        on this GPU (a ``MeasuredSpeed``), else the savings are predicted."""
        return decide(decisions, sensitivity, not_measured, self._plan_setup(), speed)

    def _finish_calibration(self) -> None:
        calibration, self._calibration = self._calibration, None
        assert calibration is not None
        if isinstance(calibration, ShapeTiming):  # layers=None on a CUDA GPU: convert the layers measured faster
            setup, timings = self._plan_setup(), calibration.models()
            for timing in timings:  # each model set up on the plugin (the book follows the last)
                module = timing.module
                decisions, speed = timing.timed(setup, self._backend.recipe_format)
                self._book.convert(module, decisions, self._backend, functools.partial(self._to_be_sharded, module))
            # Kept in checkpoints so a resume converts alike, untimed; a plan names one model's paths: with several
            # models (whose paths may coincide) none is kept, and a resumed run times again (the cache answers).
            if speed is not None and len(timings) == 1:
                self._book.adopt(timed_plan(decisions, speed, setup))
            if self._device_type is not None:
                self._on_device_resolved(self._device_type)
            return
        self._book.adopt(calibration.plan(self._plan_setup(), self._decide))
        self._apply_plan(calibration.module)

    def _apply_plan(self, module: Module, restored: bool = False) -> Module:
        module = self._book.apply_plan(module, self._backend, lambda: self._to_be_sharded(module), restored)
        if self._device_type is not None:
            self._on_device_resolved(self._device_type)
        return module

    @override
    def _on_sharded(self, module: Module) -> None:
        if isinstance(self._calibration, ShapeTiming):
            raise RuntimeError(
                f"{type(self).__name__}: the model was sharded by FSDP2 after the plugin set it up to time its layers"
                " on this GPU (after the first batch), when they can no longer be converted. Tell the plugin it is"
                " sharded: `fsdp_float8_all_gather=True` (Fabric with FSDP2), and the shape rules decide, as before.")
        super()._on_sharded(module)
        self._book.on_sharded(module)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with super().forward_context():
            if self._eval_depth:  # evaluation without fp8: no fp8 scales to precompute, no fp8 autocast
                yield
                return
            self._book.before_forward()  # after `super().forward_context()` resolved the device (and `_on_sharded`)
            with self._backend.forward_context():
                yield

    @override
    @contextmanager
    def _evaluation_scope(self) -> Generator[None, None, None]:
        with contextlib.ExitStack() as stack:
            for model in [ref() for ref in self._models]:
                stack.enter_context(self._backend.high_precision_context(model))
            yield

    @override
    def _repr_kept(self) -> dict[str, Any]:
        given = self._recipe_shown is not None
        candidates = None if self.candidates == self._backend.default_candidates(given) else self.candidates
        return {**super()._repr_kept(), "recipe": self._recipe_shown, "candidates": candidates}

    def _backend_recipe_name(self, recipe: Any) -> Any:
        """A recipe as ``repr`` shows it: by its format's name (a config or a TE recipe object is long)."""
        return recipe if isinstance(recipe, str) else self._backend.recipe_format

    def fp8_modules(self) -> dict[str, Module]:
        """The layers that compute in fp8 now, by path: none before conversion, nor while ``layers="auto"`` measures."""
        return {} if self._calibration is not None else self._book.fp8_modules()

    def plan_in_force(self) -> PrecisionPlan | None:
        """The plan the converted model runs: made by ``layers="auto"``, given, restored, or the shape rules' choice,
        with ``demote``'s changes. None before conversion and while ``layers="auto"`` has not decided (it measures, or
        the fit ended first): nothing unmeasured is a plan."""
        return self.plan if self._calibration is not None else self._book.plan_in_force(self.scaling_family)

    def demote(self, layers: Mapping[str, str], numbers: Mapping[str, dict[str, float]] | None = None) -> list[str]:
        """Move fp8 layers back to ``compute_dtype``, in place: ``layers`` maps a path to the reason. Each stays the
        same module with the same Parameters, so the optimizer and its state are untouched. Recorded in ``plan`` and
        ``layer_decisions`` (and so in checkpoints: a resumed run keeps them in high precision); ``numbers`` are the
        measurements behind each. Returns the paths moved (layers in high precision are left; a converted one reported
        not fp8 for now, an expert not run yet or an MXFP8 layer whose calls all fell back, moves too). Call it on
        every process at the same step (``FP8Guard`` does)."""
        return [] if self._calibration is not None else self._book.demote(layers, numbers, self._backend)

    def step_down(self, layers: Mapping[str, str], numbers: Mapping[str, dict[str, float]] | None = None
                  ) -> dict[str, str]:
        """Move each named low-precision layer ONE rung down the ladder (``fp8._selection.LADDER``): MXFP8 -> the
        per-tensor or per-row fp8 format (the plugin's recipe if it is one, else ``"tensorwise"``) -> ``compute_dtype``.
        In place, as ``demote``: the same module and Parameters, the optimizer's state untouched; ``layers`` maps a
        path to the reason, recorded with ``numbers`` in ``plan`` (the layer's precision becomes its new format, or
        the high label) and ``layer_decisions``, and so in checkpoints. Returns ``{path: the format it moved to, or
        the high label}``. torchao only: Transformer Engine's layers (NVFP4 included) cannot change format in place.
        Call it on every process at the same step (``FP8Guard`` does)."""
        return {} if self._calibration is not None else self._book.step_down(layers, numbers, self._backend)

    @override
    def _after_optimizer_step(self) -> None:
        self._book.after_optimizer_step()
        if self._calibration is not None and self._calibration.done:
            self._finish_calibration()  # every rank at the same step: each counted the same batches

    @override
    def _scaler_step(self, optimizer: Any, closure_step: Any = None, **kwargs: Any) -> Any:
        output = super()._scaler_step(optimizer, closure_step, **kwargs)
        if self._calibration is not None and self.scaler_config is not None:
            self._calibration.stepped(self.step_was_skipped)  # known on the host already (schedulers are held)
        return output

    # A batch of `layers="auto"`: a Fabric backward pass (the Trainer's plugin: a training step, `train_step_context`).
    _batch_per_backward = True

    def _measured_batch(self) -> None:
        if self._calibration is not None:
            self._calibration.measured_batch(self.compute_dtype, self._book.report)

    @override
    def _before_backward(self, loss: Tensor) -> None:
        if self._calibration is not None:  # a non-finite loss leaves its batch out of the measuring
            self._calibration.loss(loss)

    @override
    def _after_backward(self) -> None:
        if self._batch_per_backward:
            self._measured_batch()
        self._book.after_backward()
        if self._compile_watch is not None:
            self._settle_compile(self._compile_watch)

    def _settle_compile(self, watch: CompileWatch) -> None:
        """After the first backward: whether the model runs compiled (what its layers are timed under); on a CUDA
        GPU with real fp8, an eager model is told that fp8 will be slower than bf16 there."""
        compiled = watch.settle()
        if compiled is None:  # the watched layer has not run yet
            return
        self._compile_watch, self._compiled = None, compiled
        if not compiled and self._timer() is not None:
            warn(f"{type(self).__name__}: the model runs without torch.compile on a CUDA GPU: fp8's casts are not"
                 " fused there (each a kernel of its own), so fp8 will be slower than bf16. Compile the model:"
                 " `torch.compile(model)` before `trainer.fit`, or with Fabric `fabric.setup(torch.compile(model))`.")

    @override
    def teardown(self) -> None:
        if self._calibration is not None:
            self._calibration.end_fit(type(self).__name__, self.compute_dtype, self._book.report)
        super().teardown()

    @override
    def metrics(self) -> dict[str, Tensor]:
        """``precision/fp8_layers``: how many linear layers compute in fp8 (emulated or not), from the first backward
        on; nothing before it, when layers chosen for fp8 may still turn out never to run. With fp16 compute, the loss
        scaler's ``precision/loss_scale`` and ``precision/skipped_steps`` too."""
        # the loss scale and skipped steps, where there are, then the layers
        return {**super().metrics(), **self._book.metrics(self._backend.recipe_format)}

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        super()._on_device_resolved(device_type)  # the loss scaler, built for cpu, moves to the model's device
        # While `layers="auto"` measures, the layers that will run in fp8 are its eligible ones: checked now.
        eligible = self._calibration.decisions if self._calibration is not None else self.layer_decisions
        self._backend.check_hardware(device_type, families_of(eligible, self.scaling_family), type(self).__name__)

    _own_state_keys = ("plan",)  # beside the loss scaler's (fp16 compute)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The plan in force (made by ``layers="auto"``, given, timed on a CUDA GPU, or changed by ``demote``): a
        resumed fit applies it instead of measuring or timing again, and keeps demoted layers in high precision. With
        fp16 compute, the loss scaler's state beside it."""
        return {**super().state_dict(), **self._book.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # the loss scaler's part (fp16 compute)
        if "plan" not in state_dict:
            return
        self._book.resume(state_dict["plan"], self._backend, shown_layers(self.layers), self._calibration is not None)
        if self._calibration is not None:  # restored after setup started measuring: convert now, as the run did
            calibration, self._calibration = self._calibration, None
            if isinstance(calibration, ShapeTiming):  # models set up before this one are timed as they were to be
                calibration.earlier, self._calibration = None, calibration.earlier
            calibration.close()
            self._apply_plan(calibration.module, restored=True)

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_calibration"] = None  # hooks too; a spawned process starts measuring at its own setup
        state["_compile_watch"] = None  # a hook of this process's model
        state["_models"] = []  # weak references do not pickle: the copy knows the models it sets up
        return state


class NVFP4Precision(FP8Precision):
    """NVFP4 linear layers through Transformer Engine's ``NVFP4BlockScaling`` (TE >= 2.8, compute capability >= 10.0):
    ``Fabric(plugins=[NVFP4Precision()])``. Each block of 16 values is stored as 4-bit e2m1 (0.5 to 6) with an e4m3
    scale, under one fp32 scale per tensor; TE adds its own safeguards (random Hadamard transforms, 2D weight blocks,
    stochastic rounding of gradients; see its ``NVFP4BlockScaling``). Not fp8, hence its own name; everything else is
    ``FP8Precision``'s (layer rules, with dims divisible by 32; ``nn.Linear``/``nn.LayerNorm`` replaced by TE modules).

    There is no emulation: on a bf16 run, ``GradientUnderflowMonitor(formats=("nvfp4",))`` and
    ``underflow_stats(x, "nvfp4")`` measure what NVFP4's casts would lose first.

    Args:
        recipe: ``"nvfp4"`` (default), a mapping ``{"name": "nvfp4", **NVFP4BlockScaling_kwargs}`` or TE's
            ``NVFP4BlockScaling`` object.
        compute_dtype, layer_policy, module_filter, skip_small_layers, skip_first_last, layers, device,
            matmul_precision, reduce_dtype, scaler, skip_nonfinite, max_consecutive_skips, eval_precision: as for
            ``FP8Precision``
            (the layer choice as one ``layer_policy`` or the three flat arguments, not both). Every argument is
            keyword-only.
    """

    _nvfp4 = True

    def __init__(
        self,
        *,
        recipe: RecipeLike | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        # Which layers: a policy, or its shorthands (as FP8Precision); or a plan.
        layer_policy: FP8LayerPolicy | None = None, module_filter: ModuleFilter | None = None,
        skip_small_layers: bool = True, skip_first_last: bool = True,
        layers: PlanLike | None = None,
        device: str | None = None,
        matmul_precision: MatmulPrecision | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        scaler: ScalerConfig | None = None,
        skip_nonfinite: bool = SKIP_NONFINITE_DEFAULT,
        max_consecutive_skips: int | None = ScalerConfig.max_consecutive_skips,
        eval_precision: str | None = None,
    ) -> None:
        super().__init__(
            backend="transformer_engine", recipe=recipe if recipe is not None else TE_NVFP4,
            compute_dtype=compute_dtype, layer_policy=layer_policy, module_filter=module_filter,
            skip_small_layers=skip_small_layers, skip_first_last=skip_first_last, layers=layers, device=device,
            matmul_precision=matmul_precision, reduce_dtype=reduce_dtype, scaler=scaler, skip_nonfinite=skip_nonfinite,
            max_consecutive_skips=max_consecutive_skips, eval_precision=eval_precision,
        )
        self._recipe_shown = None if recipe is None else self._recipe_shown
