"""fp8 training for Fabric: fp8 linear layers (torchao or Transformer Engine) inside bf16 autocast."""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, cast

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Linear, Module
from typing_extensions import override

from lightning_precision import _imports
from lightning_precision._core import fsdp
from lightning_precision._core.accumulator import all_reduce
from lightning_precision._core.autocast import MatmulPrecision
from lightning_precision._core.scaled import SKIP_NONFINITE_DEFAULT, ScaledPrecision
from lightning_precision._core.scaler import ScalerConfig, resolve_scaler_config
from lightning_precision._warnings import NoEffectWarning, warn
from lightning_precision.fp8._edges import EdgeRecorder
from lightning_precision.fp8._hardware import check_fp8_hardware
from lightning_precision.fp8._plan import (
    FP8,
    HIGH_LABELS,
    HighLabel,
    PlanLike,
    PlanRule,
    PrecisionPlan,
    as_plan,
    check_candidates,
    edge_recorder,
    high_label,
    planning_policies,
)
from lightning_precision.fp8._selection import (
    BACKENDS,
    BLOCK_SCALED,
    LADDER,
    TE_CANDIDATES,
    TE_NVFP4,
    TORCHAO_CANDIDATES,
    FP8LayerPolicy,
    LayerDecision,
    ModuleFilter,
    RecipeLike,
    ScalingFamily,
    format_family,
    format_summary,
    replace_modules,
    resolve_layer_policy,
    select_fp8_layers,
    warn_if_no_fp8,
)
from lightning_precision.fp8._sensitivity import MultiProbe, SensitivityProbe
from lightning_precision.fp8._te import convert_with_te, import_te, scaling_family_of, te_recipe
from lightning_precision.fp8._torchao import (
    MXFP8_TOKENS,
    convert_with_torchao,
    float8_all_gather_possible,
    layer_format,
    mxfp8_after_first_step,
    recipe_format,
    run_outside_inference_mode,
    set_layer_format,
    torchao_config,
    torchao_format_name,
    with_float8_all_gather,
)
from lightning_precision.fp8._watch import NEVER_RAN, ForwardWatch, warn_never_ran

__all__ = ["FP8Precision", "NVFP4Precision"]

_PRECISION_OF = {
    # Lightning's standard strings: strategies and ThroughputMonitor read them. The torchao backend keeps the
    # high-precision parts in bf16/fp16 autocast; the TE backend uses Lightning's own TE strings.
    ("torchao", torch.bfloat16): "bf16-mixed",
    ("torchao", torch.float16): "16-mixed",
    ("transformer_engine", torch.bfloat16): "transformer-engine",
    ("transformer_engine", torch.float16): "transformer-engine-float16",
}


_CONVERTED = "_lightning_precision_fp8_converted"

# Transformer Engine's layers compute in the one recipe of the `te.autocast` around the forward.
_TE_ONE_RECIPE = (
    "Transformer Engine runs every layer in the one recipe of `te.autocast(recipe=...)`. A different format per layer"
    " needs Transformer Engine >= 2.16's experimental `CustomRecipe` (its quantizer factory sees each module's name,"
    " `QuantizerRole.name`), which lightning-precision does not drive. Mixed per-layer formats run under"
    " `backend='torchao'` (tensorwise, rowwise, rowwise_with_gw_hp and mxfp8 side by side; `emulate=True` anywhere)."
)


def _default_candidates() -> tuple[str, ...]:
    """The torchao formats ``layers="auto"`` chooses among when neither ``candidates`` nor ``recipe`` is given: those
    this process's GPU runs (an H100's when there is none: the plan's savings are then predicted for one)."""
    from lightning_precision.fp8._speed import speed_device, supported_candidates

    return supported_candidates(speed_device()[0], "torchao") or ("tensorwise",)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_not_sharded(module: Module, decisions: list[LayerDecision]) -> None:
    """A layer already sharded by ``fully_shard`` cannot be converted: the fp8 layer would lose FSDP's hooks and fail
    at the first forward with a DTensor error. Say what order works instead."""
    from torch.distributed.tensor import DTensor

    sharded = [d.fqn for d in decisions if d.fp8 and isinstance(module.get_submodule(d.fqn).weight, DTensor)]
    if sharded:
        raise RuntimeError(
            f"FP8Precision: {len(sharded)} layer(s) chosen for fp8 are already sharded by FSDP2"
            f" ({', '.join(sharded[:3])}"
            f"{', ...' if len(sharded) > 3 else ''}); fp8 conversion must come before `fully_shard`. With the Trainer,"
            " call `self.trainer.precision_plugin.convert_module(self)` at the top of `configure_model`, before"
            " `fully_shard`. With Fabric, shard in `ModelParallelStrategy(parallelize_fn=...)`, which runs after the"
            " conversion."
        )


class _Calibration:
    """``layers="auto"``: the first ``batches`` training batches run in the high-precision dtype while a
    ``SensitivityProbe`` measures the layers the shape rules left; at the first optimizer step after them (so never
    inside a gradient accumulation), the plan is made from what was measured and applied.

    A batch is a Trainer ``training_step`` (whatever the number of optimizers it steps, or of batches accumulated per
    step) and a Fabric backward pass: the unit the probe measures, counted on the host (no device read)."""

    def __init__(self, module: Module, decisions: list[LayerDecision], probe: Callable[[dict[str, Linear]], Any],
                 batches: int, recorder: EdgeRecorder | None = None) -> None:
        self.module, self.decisions, self.batches = module, decisions, batches
        self.seen = 0  # batches that ran while measured
        self.counted = 0  # of them, those up to the last optimizer step the loss scaler took
        self.retaken = 0  # batches measured again because the loss scaler skipped their step
        self.ended = False  # a fit stopped before the plan was made (teardown); a later fit measures on
        layers = {d.fqn: cast(Linear, module.get_submodule(d.fqn)) for d in decisions if d.fp8}
        self.probe = probe(layers)  # a SensitivityProbe (one format), or a MultiProbe (choosing among several)
        self.recorder = recorder  # which layers read the model's input and write its logits (its first forward)

    def close(self) -> None:
        self.probe.close()
        if self.recorder is not None:
            self.recorder.close()  # its record stays

    def next_batch(self) -> None:
        """A batch boundary: what the probe staged since the last one is committed (dropped if not finite), and one
        more batch is counted."""
        self.probe.commit()
        self.seen += 1

    def stepped(self, skipped: bool) -> None:
        """An optimizer step of the loss scaler (fp16 compute). One it skipped overflowed the scale in its batches,
        which is the scaler backing off (its first steps do, routinely), not a fault of the data: they are measured
        again. Every process skips alike, so every one still counts the same batches."""
        if skipped:
            self.retaken += self.seen - self.counted
            self.seen = self.counted
        else:
            self.counted = self.seen

    @property
    def done(self) -> bool:
        return self.seen >= self.batches

    def unmeasured(self, why: str) -> list[LayerDecision]:
        """The shape rules' decisions, with every layer they left reported as not fp8 (nothing unmeasured is)."""
        return [dataclasses.replace(d, fp8=False, reason=f"layers='auto': {why}") if d.fp8 else d
                for d in self.decisions]

    def measuring(self) -> list[LayerDecision]:
        return self.unmeasured(f"not measured yet (the first {self.batches} training batches are measured in high"
                               " precision, then the plan decides)")


class FP8Precision(ScaledPrecision):
    """fp8 linear layers inside high-precision autocast: ``Fabric(plugins=[FP8Precision()])``.

    Args:
        backend: ``"torchao"`` (default; ``convert_to_float8_training``) or ``"transformer_engine"``
            (``te.autocast(recipe=...)``, TE >= 2.9; ``nn.Linear``/``nn.LayerNorm`` replaced by TE modules).
        recipe: torchao: ``"tensorwise"`` (default), ``"rowwise"``, ``"rowwise_with_gw_hp"``, a
            ``Float8LinearConfig``, or ``"mxfp8"`` (torchao's MXFP8 training layer; compute capability >= 10.0, or
            ``emulate=True``; dims divisible by 32). TE: ``"delayed"`` (default), ``"current"``, ``"mxfp8"``,
            ``"block"``, a mapping
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
            numerics are measured (``lightning_precision.fp8.fp8_sensitivity``; none is reported fp8 meanwhile); at
            the first
            optimizer step after them the layers ``plan_rule`` accepts are converted (same Parameter objects: the
            optimizer is untouched) and the plan is logged and kept in ``plan`` and in checkpoints. A plan made here
            belongs to its model: set up with another model, the plugin measures again. A ``PrecisionPlan`` or the
            path of a saved one (YAML/JSON): its fp8 layers, as saved (``skip_small_layers``/``skip_first_last`` do
            not apply; a plan with ``module_filter`` is refused). A plan's layer may name its own format
            (``precision: rowwise``; ``"fp8"`` is the plugin's ``recipe``): under torchao each layer is converted in
            its format, tensorwise, rowwise, rowwise_with_gw_hp and MXFP8 side by side.
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
    ) -> None:
        owner = type(self).__name__
        if backend not in BACKENDS:
            raise ValueError(f"`{owner}(backend={backend!r})`: use 'torchao' or 'transformer_engine'.")
        if compute_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"`{owner}(compute_dtype={compute_dtype})`: the high-precision parts run in torch.bfloat16 (default)"
                " or torch.float16."
            )
        self.layer_policy = resolve_layer_policy(owner, layer_policy, module_filter=module_filter,
                                                      skip_small_layers=skip_small_layers,
                                                      skip_first_last=skip_first_last)
        if scaler is not None and compute_dtype != torch.float16:
            raise ValueError(
                f"`{owner}(scaler={scaler!r})`: bf16 has fp32's exponent range, so gradients do not underflow and need"
                " no loss scaling. Remove `scaler`, or pass `compute_dtype=torch.float16` to scale the loss."
            )
        # fp16 compute always scales the loss: fp16 flushes gradients below 2**-24 where bf16 keeps them.
        config = (resolve_scaler_config(owner, scaler, max_consecutive_skips=max_consecutive_skips)
                  if compute_dtype == torch.float16 else None)
        super().__init__(compute_dtype, config, True, device, matmul_precision, reduce_dtype,
                         skip_nonfinite=skip_nonfinite, max_consecutive_skips=max_consecutive_skips)
        self.precision = cast(Any, _PRECISION_OF[(backend, compute_dtype)])  # Lightning's Literal of them
        self.backend = backend
        self.emulate = emulate
        # Resolved now, so a bad recipe or a missing package fails at construction, not mid-setup.
        if backend == "torchao":
            self.recipe = torchao_config(recipe if recipe is not None else "tensorwise", emulate)
        else:
            if emulate:
                check_fp8_hardware("cpu", backend, "", emulate=True)
            self.recipe = te_recipe(recipe if recipe is not None else "delayed", owner)
        self.scaling_family: ScalingFamily = scaling_family_of(backend, self.recipe)
        # The format name of the plugin's recipe: a plan's layer in this format runs the recipe as configured. A torchao
        # config that is none of the named recipes goes by its scaling family.
        self._recipe_format: str = ((torchao_format_name(self.recipe) if backend == "torchao" else None)
                                    or self.scaling_family)
        if (self.scaling_family == TE_NVFP4) != self._nvfp4:
            raise ValueError(f"`{owner}(recipe={recipe!r})`: NVFP4 is 4-bit, not fp8: use `NVFP4Precision()`."
                             if not self._nvfp4 else
                             f"`{owner}(recipe={recipe!r})`: an NVFP4 recipe ('nvfp4', a mapping"
                             " {'name': 'nvfp4', ...} or TE's NVFP4BlockScaling); `FP8Precision` takes the fp8 ones.")
        if fsdp_float8_all_gather not in (None, True, False):
            raise ValueError(f"`{owner}(fsdp_float8_all_gather={fsdp_float8_all_gather!r})`: pass None, True or False.")
        if fsdp_float8_all_gather and (backend != "torchao" or self.scaling_family != "tensorwise"):
            raise ValueError(
                f"`{owner}(fsdp_float8_all_gather=True)`: torchao all-gathers in fp8 with tensorwise scaling only; this"
                f" plugin uses {backend} ({self.scaling_family}). Use `backend='torchao', recipe='tensorwise'`, or"
                " leave"
                " `fsdp_float8_all_gather` unset."
            )
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.layers, self.calibration_batches, self.plan_rule = layers, calibration_batches, plan_rule
        self.plan: PrecisionPlan | None = self._check_layers(owner)
        # With `layers="auto"`, the formats each layer chooses among (high precision is always a choice).
        self.candidates: tuple[str, ...] = self._check_candidates(owner, candidates, recipe is not None)
        self._check_fp16_mxfp8(owner, recipe, candidates is None)
        self._calibration: _Calibration | None = None
        self._float8_all_gather = False  # whether the converted layers all-gather in fp8
        self._scales: fsdp.Float8ScalePrecompute | None = None
        self.layer_decisions: list[LayerDecision] = []
        self._forward_watch: ForwardWatch | None = None
        self._idle_decisions: dict[str, LayerDecision] = {}  # the decisions of chosen layers not run yet
        self._short_mxfp8: dict[str, LayerDecision] = {}  # MXFP8 layers reported not fp8 until a call runs in it
        self._fp8_layers: int | None = None  # known once the first backward has shown which layers run
        self._root: weakref.ref | None = None  # the module converted: `layer_decisions` name paths in it

    def _check_layers(self, owner: str) -> PrecisionPlan | None:
        """Validate ``layers`` and its companions now; load a plan file now (a bad path fails here, not mid-fit)."""
        layers, auto = self.layers, self.layers == "auto"
        if self.calibration_batches is not None:
            if not auto:
                raise ValueError(f"`{owner}(calibration_batches=...)` applies to `layers='auto'` only.")
            if isinstance(self.calibration_batches, bool) or not isinstance(self.calibration_batches, int) \
                    or self.calibration_batches < 1:
                raise ValueError(f"`{owner}(calibration_batches={self.calibration_batches!r})`: a positive number of"
                                 " training steps, e.g. 8.")
        if self.plan_rule is not None and not auto:
            raise ValueError(f"`{owner}(plan_rule=...)` applies to `layers='auto'` only.")
        if self.plan_rule is not None and not isinstance(self.plan_rule, PlanRule):
            raise ValueError(f"`{owner}(plan_rule={self.plan_rule!r})`: pass a `lightning_precision.fp8.PlanRule`.")
        if layers is None:
            return None
        if auto:
            _imports.require(_imports.TORCHAO_AVAILABLE, "torchao",
                             f"{owner}(layers='auto'), which measures with torchao,")
            if self.fsdp_float8_all_gather:
                raise ValueError(f"`{owner}(layers='auto', fsdp_float8_all_gather=True)`: layers cannot be chosen"
                                 " during sharded training. Measure first and pass the plan: see docs/plan.md.")
            return None
        if not isinstance(layers, (PrecisionPlan, str)) and not hasattr(layers, "__fspath__"):
            raise ValueError(f"`{owner}(layers={layers!r})`: None, 'auto', a PrecisionPlan or the path of a saved"
                             " plan.")
        if self.module_filter is not None:
            raise ValueError(f"`{owner}(layers=<plan>, module_filter=...)`: a plan names its fp8 layers itself; pass"
                             " one or the other.")
        plan = as_plan(layers)
        shown = "<PrecisionPlan>" if isinstance(layers, PrecisionPlan) else repr(str(layers))
        self._check_plan_formats(plan, f"`{owner}(layers={shown})`")
        # Warned, not refused: the plan is still a valid choice of layers, and some plugins can only be given a plan
        # measured with another cast (Transformer Engine under FSDP2, block-scaled recipes that cannot be measured).
        mismatch = plan.recipe_mismatch(self.scaling_family)
        if mismatch:
            warn(f"`{owner}(layers={shown})`: {mismatch}")
        return plan

    def _layer_format(self, precision: str) -> str | None:
        """The ``LayerDecision.format`` of a plan's low-precision layer: None where it runs the plugin's recipe
        (``"fp8"``, or the recipe's own name), else the format's name."""
        return None if precision in (FP8, self._recipe_format) else precision

    def _check_plan_formats(self, plan: PrecisionPlan, where: str) -> None:
        """The formats a plan names must run on this backend: torchao's side by side; under Transformer Engine, the
        plugin's one recipe."""
        formats = {p.fqn: self._layer_format(p.precision) for p in plan.layers if p.low}
        if self.backend == "torchao":
            other = {fqn: f for fqn, f in formats.items() if f is not None and f not in TORCHAO_CANDIDATES}
            if other:
                fqn, fmt = next(iter(other.items()))
                raise ValueError(f"{where}: the plan runs {len(other)} layer(s) in a format torchao does not have"
                                 f" ({fqn!r}: {fmt!r}); torchao's are {', '.join(TORCHAO_CANDIDATES)} (or 'fp8': the"
                                 f" plugin's recipe). Write one of them, or use the backend whose format it is.")
            if self.fsdp_float8_all_gather and any(
                    format_family(f) != "tensorwise" for f in formats.values() if f is not None):
                raise ValueError(f"{where}, fsdp_float8_all_gather=True: torchao all-gathers in fp8 with tensorwise"
                                 " scaling only, and the plan runs layers in other formats. Leave"
                                 " `fsdp_float8_all_gather` unset, or make those layers tensorwise.")
            return
        named = {fqn: f for fqn, f in formats.items() if f is not None}
        if not named:
            return
        unknown = {f for f in named.values() if f not in TE_CANDIDATES}
        distinct = sorted(set(named.values()))
        if unknown:
            fix = (f"Transformer Engine's are {', '.join(TE_CANDIDATES)} (or 'fp8': the plugin's recipe); torchao's"
                   " formats run with `backend='torchao'`.")
        elif len(distinct) == 1:
            fix = (f"This plugin's recipe is {self._recipe_format!r}: pass `recipe={distinct[0]!r}` to run them in"
                   f" it. {_TE_ONE_RECIPE}")
        else:
            fix = _TE_ONE_RECIPE
        shown = ", ".join(f"{fqn}: {f}" for fqn, f in list(named.items())[:4]) + (", ..." if len(named) > 4 else "")
        raise ValueError(f"{where}: the plan runs layers in {', '.join(map(repr, distinct))} beside this plugin's"
                         f" {self._recipe_format!r} ({shown}). {fix}")

    def _check_fp16_mxfp8(self, owner: str, recipe: Any, default_candidates: bool) -> None:
        """torchao's MXFP8 casts take bf16 or fp32 ("torch.float16 is not supported yet"): with fp16 compute an MXFP8
        recipe, candidate or plan layer is refused now, not at its first forward (after ``layers="auto"`` measured);
        the default candidates leave MXFP8 out."""
        if self.backend != "torchao" or self.compute_dtype != torch.float16:
            return
        fix = "pass `compute_dtype=torch.bfloat16` (the default), or leave MXFP8 out"
        if self._recipe_format == "mxfp8":
            raise ValueError(f"`{owner}(recipe={recipe!r}, compute_dtype=torch.float16)`: torchao's MXFP8 casts take"
                             f" bf16 or fp32, not fp16; {fix}.")
        if default_candidates:
            self.candidates = tuple(c for c in self.candidates if c != "mxfp8") or ("tensorwise",)
        elif "mxfp8" in self.candidates:
            raise ValueError(f"`{owner}(layers='auto', candidates={self.candidates!r}, compute_dtype=torch.float16)`:"
                             f" torchao's MXFP8 casts take bf16 or fp32, not fp16; {fix} of `candidates`.")
        mx = [p.fqn for p in self.plan.layers if self._layer_format(p.precision) == "mxfp8"] if self.plan else []
        if mx:
            shown = "<PrecisionPlan>" if isinstance(self.layers, PrecisionPlan) else repr(str(self.layers))
            raise ValueError(f"`{owner}(layers={shown}, compute_dtype=torch.float16)`: the plan runs {len(mx)}"
                             f" layer(s) in MXFP8 ({mx[0]!r}: 'mxfp8'), whose torchao casts take bf16 or fp32, not"
                             f" fp16; {fix} of the plan (write another format for those layers).")

    def _check_candidates(self, owner: str, candidates: Any, recipe_given: bool) -> tuple[str, ...]:
        """``candidates`` checked, or its default: the recipe asked for (one candidate: fp8 or high precision, as
        before), else what the backend and the device run."""
        if candidates is None:
            # Transformer Engine runs one recipe per model: the plugin's is its one candidate.
            # Emulated, the choice would be one of speed that emulation does not have: the recipe asked for alone.
            choose = not recipe_given and self.backend == "torchao" and not self.emulate
            return _default_candidates() if choose else (self._recipe_format,)
        if self.layers != "auto":
            raise ValueError(f"`{owner}(candidates={candidates!r})` applies to `layers='auto'` only: the formats it"
                             " chooses among. A plan names each layer's format itself.")
        call = f"`{owner}(layers='auto', candidates={candidates!r})`"
        known = TORCHAO_CANDIDATES if self.backend == "torchao" else TE_CANDIDATES
        example = "candidates=('tensorwise', 'rowwise')" if self.backend == "torchao" else \
            f"candidates=({self._recipe_format!r},)"
        candidates = check_candidates(call, candidates, known, self.backend, example)
        if self.backend != "torchao" and tuple(candidates) != (self._recipe_format,):
            raise ValueError(f"{call}: this plugin's recipe is {self._recipe_format!r}. {_TE_ONE_RECIPE}")
        return tuple(candidates)

    # The layer choice is `layer_policy`; these read it, for code written against the flat arguments.
    module_filter = property(lambda self: self.layer_policy.module_filter)
    skip_small_layers = property(lambda self: self.layer_policy.skip_small_layers)
    skip_first_last = property(lambda self: self.layer_policy.skip_first_last)

    @property
    def _high(self) -> HighLabel:
        """What a plan says of a layer kept in high precision: the dtype it runs in, ``compute_dtype``."""
        return high_label(self.compute_dtype)

    def _to_be_sharded(self, module: Module) -> bool:
        """Whether FSDP2 is about to shard ``module`` (the plugin then converts before ``fully_shard``). Fabric shards
        in ``parallelize_fn``, after the conversion, and says nothing of it here: ``fsdp_float8_all_gather=True``
        asks for it. The Trainer's plugin knows (its strategy)."""
        return False

    @property
    def peak_flops_dtype(self) -> torch.dtype:
        """ThroughputMonitor's MFU counts against the fp8 peak (Lightning's tables list it under ``torch.int8``, as for
        its own TransformerEnginePrecision) when layers really run in fp8; against ``compute_dtype`` when emulated or
        when no layer was chosen."""
        if self.emulate or (self.layer_decisions and not any(d.fp8 for d in self.layer_decisions)):
            return self.compute_dtype
        return torch.int8

    @override
    def convert_module(self, module: Module) -> Module:
        """Convert the chosen linear layers to fp8 (once: a converted model is left as it is). Under FSDP2 this must
        run before ``fully_shard``: Fabric does it in ``setup``; with the Trainer, call
        ``self.trainer.precision_plugin.convert_module(self)`` at the top of ``configure_model``."""
        if not getattr(module, _CONVERTED, False):  # validate/test after fit: converting twice would nest
            module = self._convert(module)
        return super().convert_module(module)

    def _convert(self, module: Module) -> Module:
        converted = self._root() if self._root is not None else None
        if self._root is not None and converted is not module and self.layers in (None, "auto"):
            # This plugin converted another model before. The plan it holds was made on that model (measured on its
            # weights and batches, or changed by `demote`): it says nothing about this one, whose layers may even
            # share its paths. Start from what was asked, as a new plugin would. A plan given as `layers=` is applied.
            if self.plan is not None:
                how = "it is measured again" if self.layers == "auto" else "the shape rules choose"
                rank_zero_info(f"{type(self).__name__}: a new model; the plan made for the previous one is not applied"
                               f" to it ({how}). To apply a plan to another model, pass it: `layers=plugin.plan`.")
            self.plan = None
        if self.plan is not None and self.layers == "auto":  # restored from a checkpoint before conversion
            return self._apply_plan(module, restored=True)
        if self.plan is not None:
            decisions = self._decisions_of_plan(module, self.plan)
        else:
            decisions = select_fp8_layers(module, self.scaling_family, layer_policy=self.layer_policy)
        if self.layers == "auto" and self.plan is None:
            return self._start_calibration(module)
        return self._swap(module, decisions)

    def _decisions_of_plan(self, module: Module, plan: PrecisionPlan) -> list[LayerDecision]:
        """fp8 where the plan says so, each layer in the format it names, where the rules that always hold for that
        format (divisibility, a forward that runs) allow."""
        self._check_plan_formats(plan, type(self).__name__)  # a plan restored from a checkpoint is checked here
        every = lambda m, fqn: True  # noqa: E731  (the hard rules alone)
        hard = select_fp8_layers(module, self.scaling_family, module_filter=every)
        unknown = sorted(plan.fp8_layers - {d.fqn for d in hard})
        if unknown:
            raise ValueError(f"{type(self).__name__}: the plan puts layers in fp8 that this model does not have as"
                             f" nn.Linear: {', '.join(unknown)}. Is it the plan of another model?")
        entries = {p.fqn: p for p in plan.layers}
        rules = {self.scaling_family: {d.fqn: d for d in hard}}  # the hard rules per scaling family, made once each
        out = []
        for d in hard:
            entry = entries.get(d.fqn)
            low = entry is not None and entry.low
            fmt = self._layer_format(entry.precision) if entry is not None and low else None
            family = format_family(fmt) if fmt is not None else self.scaling_family
            if family not in rules:
                rules[family] = {r.fqn: r for r in select_fp8_layers(module, family, module_filter=every)}
            rule = rules[family][d.fqn]
            if not rule.fp8:
                out.append(rule)
            elif entry is None:
                out.append(dataclasses.replace(rule, fp8=False, reason="not in the plan"))
            else:
                out.append(dataclasses.replace(rule, fp8=low, reason=f"plan: {entry.reason}", format=fmt))
        return out

    @property
    def _choosing(self) -> bool:
        """Whether ``layers="auto"`` chooses among formats (several candidates, or an error budget) rather than between
        the plugin's recipe and high precision."""
        return len(self.candidates) > 1 or math.isfinite((self.plan_rule or PlanRule()).error_budget)

    def _start_calibration(self, module: Module) -> Module:
        if self._to_be_sharded(module) or fsdp.is_sharded(module):
            raise RuntimeError(
                f"{type(self).__name__}(layers='auto') cannot choose layers under FSDP2: they must be converted before"
                " `fully_shard`. Measure on one process first (`lightning-precision plan`, or"
                " `fp8_sensitivity` + `PrecisionPlan.decide`) and pass the saved plan: `layers='plan.yaml'`."
            )
        batches = self.calibration_batches or 8
        if self._calibration is not None:  # a model whose measuring never finished: its hooks go
            self._calibration.close()
        final, measure = planning_policies(self.layer_policy, self._choosing)
        decisions = select_fp8_layers(module, self._planning_family, layer_policy=measure)
        probe: Callable[[dict[str, Linear]], Any] = (
            (lambda layers: MultiProbe(layers, self.candidates)) if self._choosing
            else (lambda layers: SensitivityProbe(layers, self._probe_config())))
        self._calibration = _Calibration(module, decisions, probe, batches, edge_recorder(module, final))
        self.layer_decisions = self._calibration.measuring()
        self._fp8_layers = 0  # none runs in fp8 while measuring: `metrics()` says so, as `layer_decisions` does
        setattr(module, _CONVERTED, True)
        return module

    @property
    def _planning_family(self) -> str:
        """The scaling family whose GEMM rules choose the layers to plan: the recipe's, or (choosing among formats,
        each held to its own rules by the choice) fp8's 16."""
        return "tensorwise" if self._choosing else self.scaling_family

    def _probe_config(self) -> Any:
        if self.backend == "torchao":
            return self.recipe
        # Transformer Engine's block-scaled recipes are measured with their own block casts; its per-tensor ones
        # through torchao's emulation of the same per-tensor scaling.
        if self.scaling_family in (*BLOCK_SCALED, "block"):
            return self.scaling_family
        return torchao_config("tensorwise", emulate=True)

    def _finish_calibration(self) -> None:
        calibration, self._calibration = self._calibration, None
        assert calibration is not None
        probe = calibration.probe
        probe.close()
        sensitivity = probe.result(all_reduce)  # every rank at the same step: the sums are all-reduced
        owner = f"{type(self).__name__}(layers='auto')"
        # Batches of skipped steps were measured again: non-finite, they are the loss scale's overflows (at most one
        # per process each), not the data's.
        faults = max(0, probe.dropped - calibration.retaken * _world_size())
        if faults:
            warn(f"{owner}: {faults} of the {probe.dropped + probe.batches} batches measured (over all"
                 " processes) had a non-finite input, gradient or fp32 result in a measured layer: a fault of the data"
                 " or the loss, not of fp8. They were left out; the plan is made from the other"
                 f" {probe.batches}.")
        not_measured = (f"not measured: all {probe.dropped} batches measured had non-finite values"
                        if probe.dropped and not probe.batches else None)
        final, _ = planning_policies(self.layer_policy, self._choosing)
        edges = calibration.recorder.edges() if calibration.recorder is not None else None
        decisions = select_fp8_layers(calibration.module, self._planning_family, layer_policy=final, edges=edges)
        self.plan = self._decide(decisions, sensitivity, not_measured)
        self._apply_plan(calibration.module)

    def _decide(self, decisions: list[LayerDecision], sensitivity: dict[str, Any],
                not_measured: str | None = None) -> PrecisionPlan:
        """``layers="auto"``'s plan from the shape rules' ``decisions`` and what was measured: with one candidate,
        each layer in fp8 where ``plan_rule`` accepts its numbers, else in high precision; with several (or an error
        budget), the exact choice of ``PrecisionPlan.choose`` (savings predicted for this process's GPU)."""
        if self._choosing:
            return PrecisionPlan.choose(decisions, sensitivity, self.plan_rule, None, self._high,
                                        self.layer_policy.skip_small_layers, self.backend, not_measured=not_measured)
        return PrecisionPlan.decide(decisions, sensitivity, self.plan_rule, self.scaling_family,
                                    not_measured=not_measured, high=self._high)

    def _apply_plan(self, module: Module, restored: bool = False) -> Module:
        """Convert as ``layers="auto"``'s plan says, and print it once: the plan's table, with its numbers."""
        assert self.plan is not None  # made, or restored, just before
        table = self.plan.table()
        if restored:
            table = f"fp8 (layers='auto'): the plan restored from the checkpoint, not measured again:\n{table}"
        module = self._swap(module, self._decisions_of_plan(module, self.plan), table)
        if self._device_type is not None:
            self._on_device_resolved(self._device_type)
        return module

    def _swap(self, module: Module, decisions: list[LayerDecision], table: str | None = None) -> Module:
        """Convert the layers ``decisions`` choose (in place below the root); ``table``: what to print, by default the
        decisions' summary."""
        self.layer_decisions = decisions
        _check_not_sharded(module, self.layer_decisions)
        rank_zero_info(table if table is not None else format_summary(self.layer_decisions))
        warn_if_no_fp8(self.layer_decisions, type(self).__name__, "NVFP4" if self._nvfp4 else "fp8")
        if self.backend == "torchao":
            recipe = self.recipe
            self._float8_all_gather = self._wants_float8_all_gather(module)
            if self._float8_all_gather:
                recipe = with_float8_all_gather(recipe)
            module = convert_with_torchao(module, recipe, self.layer_decisions)
        else:
            module = convert_with_te(module, self.layer_decisions)
        fp8_layers = {d.fqn: module.get_submodule(d.fqn) for d in self.layer_decisions if d.fp8}
        if self.backend == "torchao":
            for layer in fp8_layers.values():
                run_outside_inference_mode(layer)
        if self._forward_watch is not None:  # a watch of an earlier conversion
            self._forward_watch.close()
        self._forward_watch, self._idle_decisions, self._short_mxfp8 = ForwardWatch(fp8_layers), {}, {}
        self._fp8_layers = None
        self._root = weakref.ref(module)
        setattr(module, _CONVERTED, True)
        return module

    def _wants_float8_all_gather(self, module: Module) -> bool:
        if self.fsdp_float8_all_gather is False:
            return False
        if self.fsdp_float8_all_gather is None and not self._to_be_sharded(module):
            return False
        # Every fp8 layer must be tensorwise: one layer of another format is enough to refuse.
        families = sorted(self._families(self.layer_decisions) or {self.scaling_family})
        why_not = next(filter(None, map(float8_all_gather_possible, families)), None)
        if why_not is None:
            return True
        if self.fsdp_float8_all_gather:  # asked for explicitly (tensorwise is checked at construction)
            raise RuntimeError(f"`{type(self).__name__}(fsdp_float8_all_gather=True)`: {why_not}. Leave it unset to"
                               " all-gather in the policy's dtype.")
        rank_zero_info(f"fp8: weights are all-gathered in the policy's dtype, not in fp8: {why_not}.")
        return False

    def _families(self, decisions: list[LayerDecision]) -> set[str]:
        """The scaling families the fp8 layers of ``decisions`` compute in (their own formats, or the recipe's)."""
        return {format_family(d.format) if d.format is not None else self.scaling_family for d in decisions if d.fp8}

    @override
    def _on_sharded(self, module: Module) -> None:
        super()._on_sharded(module)
        if not self._float8_all_gather:
            return
        self._scales = fsdp.Float8ScalePrecompute(module)
        if fsdp.process_group_backend() == "gloo":
            fsdp.install_byte_all_gather(module)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with super().forward_context():
            if self._scales is not None:  # after `super().forward_context()` resolved the device (and `_on_sharded`)
                self._scales.before_forward()
            if self.backend == "torchao":  # Float8Linear casts to fp8 by itself
                yield
            else:
                te, _ = import_te()
                with te.autocast(enabled=True, recipe=self.recipe):
                    yield

    def fp8_modules(self) -> dict[str, Module]:
        """The layers that compute in fp8 now, by path: none before conversion, nor while ``layers="auto"`` measures."""
        module = self._root() if self._root is not None else None
        if module is None or self._calibration is not None:
            return {}
        return {d.fqn: module.get_submodule(d.fqn) for d in self.layer_decisions if d.fp8}

    def plan_in_force(self) -> PrecisionPlan | None:
        """The plan the converted model runs: made by ``layers="auto"``, given, restored, or the shape rules' choice,
        with ``demote``'s changes. None before conversion and while ``layers="auto"`` has not decided (it measures, or
        the fit ended first): nothing unmeasured is a plan."""
        if self.plan is not None:
            return self.plan
        if self._calibration is not None or not self.layer_decisions:
            return None
        return PrecisionPlan.from_decisions(self.layer_decisions, self.scaling_family, self._high)

    def demote(self, layers: Mapping[str, str], numbers: Mapping[str, dict[str, float]] | None = None) -> list[str]:
        """Move fp8 layers back to ``compute_dtype``, in place: ``layers`` maps a path to the reason. Each stays the
        same module with the same Parameters, so the optimizer and its state are untouched. Recorded in ``plan`` and
        ``layer_decisions`` (and so in checkpoints: a resumed run keeps them in high precision); ``numbers`` are the
        measurements behind each. Returns the paths moved (layers in high precision are left; a converted one reported
        not fp8 for now, an expert not run yet or an MXFP8 layer whose calls all fell back, moves too). Call it on
        every process at the same step (``FP8Guard`` does)."""
        return list(self._move_layers("demote", layers, numbers, lambda fqn, module: None))

    def step_down(self, layers: Mapping[str, str], numbers: Mapping[str, dict[str, float]] | None = None
                  ) -> dict[str, str]:
        """Move each named low-precision layer ONE rung down the ladder (``fp8._selection.LADDER``): MXFP8 -> the
        per-tensor or per-row fp8 format (the plugin's recipe if it is one, else ``"tensorwise"``) -> ``compute_dtype``.
        In place, as ``demote``: the same module and Parameters, the optimizer's state untouched; ``layers`` maps a
        path to the reason, recorded with ``numbers`` in ``plan`` (the layer's precision becomes its new format, or
        the high label) and ``layer_decisions``, and so in checkpoints. Returns ``{path: the format it moved to, or
        the high label}``. torchao only: Transformer Engine's layers (NVFP4 included) cannot change format in place.
        Call it on every process at the same step (``FP8Guard`` does)."""
        return self._move_layers("step_down", layers, numbers, lambda fqn, module: self._rung_below(module))

    def _rung_below(self, module: Module) -> str | None:
        """The format one rung below the one ``module`` computes in (None: high precision)."""
        here = layer_format(module)
        rung = here if here in LADDER else LADDER[-1]  # the per-tensor and per-row formats share the last rung
        below = LADDER[LADDER.index(rung) + 1] if rung != LADDER[-1] else None
        if below != LADDER[-1]:
            return below
        own = recipe_format(self.recipe) if self.backend == "torchao" else None
        return own if own in TORCHAO_CANDIDATES and own != "mxfp8" else "tensorwise"

    def _format_config(self, fmt: str | None) -> Any:
        """What ``set_layer_format`` takes for ``fmt``: the plugin's own recipe where it is that format (a custom
        ``Float8LinearConfig`` keeps its settings), else the name."""
        if fmt is not None and recipe_format(self.recipe) == fmt:
            return self.recipe
        return fmt

    def _move_layers(self, verb: str, layers: Mapping[str, str], numbers: Mapping[str, dict[str, float]] | None,
                     target: Callable[[str, Module], str | None]) -> dict[str, str]:
        """Move the named converted layers to the format ``target`` gives each (None: ``compute_dtype``), in place,
        and record it (``demote``, ``step_down``, and a resumed run's plan). A layer already in its target stays."""
        current = self.fp8_modules()
        root = self._root() if self._root is not None else None
        if root is not None and self._calibration is None:  # as `fp8_modules()`
            # Converted layers reported not fp8 for now still compute in fp8 when they run (an expert no token has
            # reached yet; an MXFP8 layer whose calls all fell back so far): they move too, or they would come back.
            current.update({fqn: root.get_submodule(fqn) for fqn in (*self._idle_decisions, *self._short_mxfp8)})
        # A layer registered under several names (tied) is one layer, decided under its first name: any name moves it.
        first = {alias: d.fqn for d in self.layer_decisions for alias in d.aliases}
        layers = {first.get(fqn, fqn): why for fqn, why in layers.items()}
        numbers = {first.get(fqn, fqn): n for fqn, n in numbers.items()} if numbers else None
        chosen = [fqn for fqn in layers if fqn in current]
        if not chosen:
            return {}
        if self.backend != "torchao":
            raise RuntimeError(f"{type(self).__name__}.{verb}: Transformer Engine layers cannot return to high"
                               " precision in place, nor change format (NVFP4 included); only torchao's can"
                               " (backend='torchao').")
        assert root is not None  # layers compute in fp8: the model is converted
        moved: dict[str, str | None] = {}
        for fqn in chosen:
            module = current[fqn]
            fmt = target(fqn, module)
            if fmt == layer_format(module):
                continue
            new = set_layer_format(module, self._format_config(fmt), self.emulate, fqn)
            if new is not module:
                replace_modules(root, {id(module): new})
            moved[fqn] = fmt
            self._short_mxfp8.pop(fqn, None)  # no longer an MXFP8 layer: its fallbacks are over
        if not moved:
            return {}
        plan = self.plan_in_force()
        assert plan is not None  # layers run in fp8: the model is converted and decided
        for fqn, fmt in moved.items():
            plan = plan.with_layer(fqn, fmt or self._high, layers[fqn], (numbers or {}).get(fqn))
        self.plan = plan

        def moved_decision(d: LayerDecision) -> LayerDecision:
            fmt = moved[d.fqn]
            if fmt is None:
                return dataclasses.replace(d, fp8=False, format=None, reason=f"demoted: {layers[d.fqn]}")
            return dataclasses.replace(d, fp8=True, format=fmt, reason=f"stepped down to {fmt}: {layers[d.fqn]}")

        for fqn in moved:  # an expert not run yet: reported not fp8 until it runs, then as it is now
            idle = self._idle_decisions.pop(fqn, None)
            if idle is not None and moved[fqn] is not None:
                self._idle_decisions[fqn] = moved_decision(idle)
        self.layer_decisions = [moved_decision(d) if d.fqn in moved and d.fqn not in self._idle_decisions else d
                                for d in self.layer_decisions]
        if self._fp8_layers is not None:
            self._fp8_layers = sum(d.fp8 for d in self.layer_decisions)
        return {fqn: fmt or self._high for fqn, fmt in moved.items()}

    @override
    def _after_optimizer_step(self) -> None:
        if self._scales is not None:
            self._scales.after_optimizer_step()
        if self._calibration is not None and self._calibration.done:
            self._finish_calibration()  # every rank at the same step: each counted the same batches

    # Where a batch ends for `layers="auto"`: Fabric has no training-step hook, so each backward pass is a batch; the
    # Trainer counts its training steps instead (`train_step_context`), so several backward passes in one step
    # (manual optimization) are one batch.
    _batch_per_backward = True

    def _measured_batch(self) -> None:
        calibration = self._calibration
        if calibration is None:
            return
        if calibration.ended:  # a new fit of the same model measures on
            calibration.ended = False
            self.layer_decisions = calibration.measuring()
        calibration.probe.reopen()  # taken off at teardown (or open still: nothing to do)
        if calibration.seen == 0:
            # Said when measuring really starts, not at conversion: a resumed fit restores its plan in between (and
            # then measures nothing).
            rank_zero_info(f"fp8: {sum(d.fp8 for d in calibration.decisions)} eligible linear layers; the first"
                           f" {calibration.batches} training batches run in {self.compute_dtype} while their fp8"
                           " numerics are measured (layers='auto'), and the plan is made at the optimizer step that"
                           " ends them.")
        calibration.next_batch()

    _own_state_keys = ("plan",)  # beside the loss scaler's (fp16 compute)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The plan in force (made by ``layers="auto"``, given, or changed by ``demote``): a resumed fit applies it
        instead of measuring again, and keeps demoted layers in high precision. With fp16 compute, the loss scaler's
        state beside it."""
        state = super().state_dict()
        if self.plan is not None:
            state["plan"] = self.plan.to_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # the loss scaler's part (fp16 compute)
        if "plan" not in state_dict:
            return
        owner = type(self).__name__
        saved = PrecisionPlan.from_dict(state_dict["plan"], source=f"the checkpoint's plan ({owner} state)")
        given = self.plan if self.layers is not None and self.layers != "auto" else None
        mismatch = saved.recipe_mismatch(self.scaling_family)
        # a given plan's mismatch was said at construction
        if mismatch and (given is None or given.scaling_family != saved.scaling_family):
            warn(f"{owner}: resuming: {mismatch}")
        if given is not None:
            # The checkpoint's plan is what the run trained with, FP8Guard's demotions included; the given one is what
            # the user asks for now (perhaps edited after a divergence). Neither is dropped: a layer stays in fp8 only
            # where both say fp8, and nothing is promoted to fp8 behind the optimizer's back.
            def runs_in(plan: PrecisionPlan, fqn: str) -> str | None:
                fmt = plan.format_of(fqn)
                return self._recipe_format if fmt == FP8 else fmt

            differ = sorted(f for f in given.fp8_layers | saved.fp8_layers if runs_in(given, f) != runs_in(saved, f))
            if differ:
                def says(plan: PrecisionPlan, fqn: str) -> str:
                    entry = plan.get(fqn)
                    if fqn in plan.fp8_layers:
                        return entry.precision if entry else FP8
                    return f"{entry.precision} ({entry.reason})" if entry else "not listed"

                shown = "<PrecisionPlan>" if isinstance(self.layers, PrecisionPlan) else repr(str(self.layers))
                warn(f"{owner}: the checkpoint's plan (what the run trained with, FP8Guard's demotions included)"
                     f" differs from `layers={shown}` for {len(differ)} layer(s): "
                     + "; ".join(f"{f}: {says(given, f)} given, {says(saved, f)} in the checkpoint" for f in differ)
                     + f". On resume a layer stays in fp8 only where both plans say so (else it runs in"
                     f" {self.compute_dtype}), and in the checkpoint's format where it names one of its own (FP8Guard"
                     " steps a failing layer down). To train a layer in a format the checkpoint moved it from, start a"
                     " new fit from the checkpoint's weights (not `ckpt_path=`).")
            moved = {p.fqn: p for p in saved.layers if p.precision != FP8 and p.fqn in given.fp8_layers}
        else:
            # in high precision, or in a format of its own (FP8Guard's steps down the ladder)
            moved = {p.fqn: p for p in saved.layers if p.precision != FP8}
        if self._calibration is not None:  # restored after setup started measuring: convert now, as the run did
            self.plan = saved
            calibration, self._calibration = self._calibration, None
            calibration.close()
            self._apply_plan(calibration.module, restored=True)
        elif not self.layer_decisions:  # not converted yet: convert as the saved run was (and as asked, if asked)
            if given is None:
                self.plan = saved
            else:
                for fqn, p in moved.items():
                    given = given.with_layer(fqn, self._high if p.precision in HIGH_LABELS else p.precision, p.reason,
                                             p.numbers)
                self.plan = given
        else:  # converted already: what the run moved (to high precision, or down the ladder) stays where it went
            self._move_layers("load_state_dict", {f: p.reason for f, p in moved.items()},
                              {f: p.numbers for f, p in moved.items()},
                              lambda fqn, module: saved.format_of(fqn))

    @override
    def _scaler_step(self, optimizer: Any, closure_step: Any = None, **kwargs: Any) -> Any:
        output = super()._scaler_step(optimizer, closure_step, **kwargs)
        if self._calibration is not None and self.scaler_config is not None:
            self._calibration.stepped(self.step_was_skipped)  # known on the host already (schedulers are held)
        return output

    @override
    def teardown(self) -> None:
        calibration = self._calibration
        if calibration is not None:
            # No hooks on the model between fits (nor the eager stance they hold): it pickles (`torch.save(model)`),
            # and a forward of the user's is not measured. The next training batch puts them back.
            calibration.close()
        if calibration is not None and calibration.seen:  # a run that trained but stopped before deciding
            ended = (f"training ended after {calibration.seen} of the {calibration.batches} batches to measure"
                     if not calibration.done else f"training ended after the {calibration.seen} batches measured,"
                     " before the optimizer step that makes the plan")
            calibration.ended = True
            self.layer_decisions = calibration.unmeasured(f"{ended}; not measured, not fp8")
            warn(f"{type(self).__name__}(layers='auto'): {ended}, so no layer was converted to fp8 and no plan was"
                 f" made: it all trained in {self.compute_dtype}. Train longer, or lower `calibration_batches`.",
                 NoEffectWarning)
        super().teardown()

    @override
    def _after_backward(self) -> None:
        if self._batch_per_backward:
            self._measured_batch()
        # After the first backward a layer that did not run its forward is not fp8, whatever was decided (a weight used
        # functionally elsewhere): say so, and make the decisions tell the truth. One that runs later (an expert no
        # token reached at first) computes in fp8 from then on: the decisions say so again.
        watch = self._forward_watch
        if watch is not None and not watch.settled:
            idle = watch.settle()
            if idle:
                self._idle_decisions = {d.fqn: d for d in self.layer_decisions if d.fqn in idle}
                self.layer_decisions = [dataclasses.replace(d, fp8=False, reason=NEVER_RAN) if d.fqn in idle
                                        else d for d in self.layer_decisions]
                warn_never_ran(idle)
            self._judge_mxfp8(watch, [fqn for fqn in watch.layers if fqn not in idle])
        elif watch is not None:
            ran = watch.ran()
            if ran:
                self._count_again({fqn: self._idle_decisions.pop(fqn) for fqn in ran if fqn in self._idle_decisions})
                # An MXFP8 expert's first step is judged as the others' was: every call short of a block is not fp8.
                self._judge_mxfp8(watch, ran)
        if watch is not None:
            if not watch.watching:
                self._forward_watch = None
            self._fp8_layers = sum(d.fp8 for d in self.layer_decisions)
        if self._short_mxfp8:
            self._recheck_short_mxfp8()

    def _count_again(self, restored: Mapping[str, LayerDecision]) -> None:
        """Layers reported not fp8 for a while (an idle expert, an MXFP8 layer whose calls all fell back) that have run
        in fp8: their decisions back. A plan ``demote`` took while they read "not fp8" (it keeps the plan from then on:
        FP8Guard's file, checkpoints) says fp8 for them again: left stale, a run resumed from it demoted them."""
        was = {d.fqn: d.reason for d in self.layer_decisions if d.fqn in restored}
        self.layer_decisions = [restored.get(d.fqn, d) for d in self.layer_decisions]
        for fqn, decision in restored.items():
            entry = self.plan.get(fqn) if self.plan is not None else None
            if self.plan is not None and entry is not None and not entry.low \
                    and entry.reason == was.get(fqn):
                self.plan = self.plan.with_layer(fqn, decision.format or FP8, decision.reason)

    def _judge_mxfp8(self, watch: ForwardWatch, ran: list[str]) -> None:
        """MXFP8 layers among ``ran`` (each in the backward after its first call) that ran but never in MXFP8 (too few
        tokens for a block, every call): not fp8 either, until a call runs in MXFP8 (``_recheck_short_mxfp8``)."""
        short = mxfp8_after_first_step(watch.layers, self.compute_dtype, type(self).__name__, ran=ran)
        if short:
            self._short_mxfp8.update({d.fqn: d for d in self.layer_decisions if d.fqn in short})
            self.layer_decisions = [dataclasses.replace(d, fp8=False, reason=short[d.fqn]) if d.fqn in short
                                    else d for d in self.layer_decisions]

    def _recheck_short_mxfp8(self) -> None:
        """An MXFP8 layer reported not fp8 (every call fell back) that has since run a call in MXFP8 (sequences of
        another length) is fp8 again: a host-side flag per such layer, read after each backward."""
        module = self._root() if self._root is not None else None
        if module is None:
            return
        ran = [fqn for fqn in self._short_mxfp8 if getattr(module.get_submodule(fqn), "_mxfp8_ran", False)]
        if not ran:
            return
        self._count_again({fqn: self._short_mxfp8.pop(fqn) for fqn in ran})
        self._fp8_layers = sum(d.fp8 for d in self.layer_decisions)
        rank_zero_info(f"fp8: {', '.join(ran)}: a training call of a multiple of {MXFP8_TOKENS} tokens ran in"
                       " MXFP8; counted as fp8 again.")

    @override
    def metrics(self) -> dict[str, Tensor]:
        """``precision/fp8_layers``: how many linear layers compute in fp8 (emulated or not), from the first backward
        on; nothing before it, when layers chosen for fp8 may still turn out never to run. With fp16 compute, the loss
        scaler's ``precision/loss_scale`` and ``precision/skipped_steps`` too."""
        metrics = super().metrics()  # the loss scale and skipped steps, where there are
        if self._fp8_layers is not None:
            metrics["precision/fp8_layers"] = torch.tensor(float(self._fp8_layers))
            if any(d.format is not None for d in self.layer_decisions if d.fp8):  # mixed formats: each one's count
                formats = [d.format or self._recipe_format for d in self.layer_decisions if d.fp8]
                for fmt in dict.fromkeys(formats):
                    metrics[f"precision/fp8_layers/{fmt}"] = torch.tensor(float(formats.count(fmt)))
        return metrics

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        super()._on_device_resolved(device_type)  # the loss scaler, built for cpu, moves to the model's device
        # While `layers="auto"` measures, its eligible layers are the ones that will run in fp8: checked now, not
        # after the measured batches.
        eligible = self._calibration.decisions if self._calibration is not None else self.layer_decisions
        # Each format the layers compute in, block-scaled first: MXFP8 asks the most of the device.
        for family in sorted(self._families(eligible), key=lambda family: (family not in BLOCK_SCALED, family)):
            check_fp8_hardware(device_type, self.backend, family, self.emulate, type(self).__name__)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_forward_watch"] = None  # its layers and pre-hook handles stay with the process that set them
        state["_scales"] = None  # found again when the model is sharded in the new process
        state["_calibration"] = None  # hooks too; a spawned process starts measuring at its own setup
        state["_root"] = None  # a weak reference; set again when the new process converts
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
            matmul_precision, reduce_dtype, scaler, skip_nonfinite, max_consecutive_skips: as for ``FP8Precision``
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
    ) -> None:
        super().__init__(
            backend="transformer_engine", recipe=recipe if recipe is not None else TE_NVFP4,
            compute_dtype=compute_dtype, layer_policy=layer_policy, module_filter=module_filter,
            skip_small_layers=skip_small_layers, skip_first_last=skip_first_last, layers=layers, device=device,
            matmul_precision=matmul_precision, reduce_dtype=reduce_dtype, scaler=scaler, skip_nonfinite=skip_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
        )
