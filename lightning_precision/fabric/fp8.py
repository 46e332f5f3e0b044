"""fp8 training for Fabric: fp8 linear layers (torchao or Transformer Engine) inside bf16 autocast."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Literal, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_precision import fp8 as _fp8
from lightning_precision.fabric._autocast import MatmulPrecision, _AutocastPrecision

_PRECISION_OF = {
    # Lightning's standard strings: strategies and ThroughputMonitor read them. The torchao backend keeps the
    # high-precision parts in bf16/fp16 autocast; the TE backend uses Lightning's own TE strings.
    ("torchao", torch.bfloat16): "bf16-mixed",
    ("torchao", torch.float16): "16-mixed",
    ("transformer_engine", torch.bfloat16): "transformer-engine",
    ("transformer_engine", torch.float16): "transformer-engine-float16",
}


_CONVERTED = "_lightning_precision_fp8_converted"


class FP8Precision(_AutocastPrecision):
    """fp8 linear layers inside high-precision autocast: ``Fabric(plugins=[FP8Precision()])``.

    Args:
        backend: ``"torchao"`` (default; ``convert_to_float8_training``) or ``"transformer_engine"``
            (``te.autocast(recipe=...)``, TE >= 2.9; ``nn.Linear``/``nn.LayerNorm`` replaced by TE modules).
        recipe: torchao: ``"tensorwise"`` (default), ``"rowwise"``, ``"rowwise_with_gw_hp"`` or a
            ``Float8LinearConfig``. TE: ``"delayed"`` (default), ``"current"``, ``"mxfp8"``, ``"block"``, a mapping
            ``{"name": "delayed", "amax_history_len": 16, ...}`` or a TE recipe object.
        emulate: run torchao's fp8 numerics without fp8 hardware (CPU included), slowly. torchao only.
        compute_dtype: the high-precision dtype of everything that is not an fp8 GEMM (bf16 or fp16).
        module_filter: ``(module, fqn) -> bool`` choosing the linear layers that run in fp8; replaces the defaults.
        skip_small_layers: leave layers too small to gain in high precision (thresholds in ``lightning_precision.fp8``).
        skip_first_last: leave the first and last linear layers that run as modules in high precision.
        device, matmul_precision: as for every plugin.
    """

    def __init__(
        self,
        backend: Literal["torchao", "transformer_engine"] = "torchao",
        recipe: Any = None,
        emulate: bool = False,
        compute_dtype: torch.dtype = torch.bfloat16,
        module_filter: Optional[_fp8.ModuleFilter] = None,
        skip_small_layers: bool = True,
        skip_first_last: bool = True,
        device: Optional[str] = None,
        matmul_precision: Optional[MatmulPrecision] = None,
    ) -> None:
        owner = type(self).__name__
        if backend not in _fp8.BACKENDS:
            raise ValueError(f"`{owner}(backend={backend!r})`: use 'torchao' or 'transformer_engine'.")
        if compute_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"`{owner}(compute_dtype={compute_dtype})`: the high-precision parts run in torch.bfloat16 (default)"
                " or torch.float16."
            )
        _fp8.check_module_filter(owner, module_filter)
        super().__init__(compute_dtype, device=device, matmul_precision=matmul_precision)
        self.precision = _PRECISION_OF[(backend, compute_dtype)]
        self.backend = backend
        self.emulate = emulate
        self.module_filter = module_filter
        self.skip_small_layers = skip_small_layers
        self.skip_first_last = skip_first_last
        # Resolved now, so a bad recipe or a missing package fails at construction, not mid-setup.
        if backend == "torchao":
            self.recipe = _fp8.torchao_config(recipe if recipe is not None else "tensorwise", emulate)
        else:
            if emulate:
                _fp8.check_fp8_hardware("cpu", backend, "", emulate=True)
            self.recipe = _fp8.te_recipe(recipe if recipe is not None else "delayed")
        self.recipe_name = _fp8.recipe_name_of(backend, self.recipe)
        self.layer_decisions: list[_fp8.LayerDecision] = []
        self._forward_watch: Optional[_fp8.ForwardWatch] = None
        self._fp8_layers: Optional[int] = None  # known once the first backward has shown which layers run

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
        if not getattr(module, _CONVERTED, False):  # validate/test after fit: converting twice would nest
            module = self._convert(module)
        return super().convert_module(module)

    def _convert(self, module: Module) -> Module:
        self.layer_decisions = _fp8.select_fp8_layers(
            module, self.recipe_name, self.module_filter, self.skip_small_layers, self.skip_first_last
        )
        rank_zero_info(_fp8.format_summary(self.layer_decisions))
        _fp8.warn_if_no_fp8(self.layer_decisions)
        if self.backend == "torchao":
            module = _fp8.convert_with_torchao(module, self.recipe, self.layer_decisions)
        else:
            module = _fp8.convert_with_te(module, self.layer_decisions)
        fp8_layers = {d.fqn: module.get_submodule(d.fqn) for d in self.layer_decisions if d.fp8}
        if self.backend == "torchao":
            for layer in fp8_layers.values():
                _fp8.run_outside_inference_mode(layer)
        self._forward_watch = _fp8.ForwardWatch(fp8_layers)
        self._fp8_layers = None
        setattr(module, _CONVERTED, True)
        return module

    @override
    def _after_backward(self) -> None:
        # After the first backward every layer that runs has run its forward: the others are not fp8, whatever was
        # decided (a weight used functionally elsewhere). Say so, and make the decisions tell the truth.
        watch, self._forward_watch = self._forward_watch, None
        if watch is None:
            return
        idle = watch.close()
        if idle:
            self.layer_decisions = [
                dataclasses.replace(d, fp8=False, reason=_fp8.NEVER_RAN) if d.fqn in idle else d
                for d in self.layer_decisions
            ]
            _fp8.warn_never_ran(idle)
        self._fp8_layers = sum(d.fp8 for d in self.layer_decisions)

    @override
    def metrics(self) -> dict[str, Tensor]:
        """``precision/fp8_layers``: how many linear layers compute in fp8 (emulated or not), from the first backward
        on; nothing before it, when layers chosen for fp8 may still turn out never to run. fp8 keeps no loss scale."""
        if self._fp8_layers is None:
            return {}
        return {"precision/fp8_layers": torch.tensor(float(self._fp8_layers))}

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        if any(d.fp8 for d in self.layer_decisions):
            _fp8.check_fp8_hardware(device_type, self.backend, self.recipe_name, self.emulate)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with super().forward_context():
            if self.backend == "torchao":  # Float8Linear casts to fp8 by itself
                yield
            else:
                te, _ = _fp8._te()
                with te.autocast(enabled=True, recipe=self.recipe):
                    yield

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_forward_watch"] = None  # hook handles stay with the process that set them
        return state
