"""A minimal stand-in for Transformer Engine, which cannot be installed on these CPU machines (it needs CUDA).

It mirrors the signatures of TE >= 2.9 that lightning_precision calls, read from TE's public source:
``transformer_engine.pytorch.Linear(in_features, out_features, bias=True, ..., params_dtype=None, device="cuda")``,
``transformer_engine.pytorch.LayerNorm(hidden_size, eps=1e-5, ..., params_dtype=None, zero_centered_gamma=False,
device="cuda")``, ``transformer_engine.pytorch.autocast(enabled=True, calibrating=False, recipe=None,
amax_reduction_group=None, _graph=False)``, and the recipes of ``transformer_engine.common.recipe``. Modules keep
``fp8_meta["scaling_fwd"/"scaling_bwd"]`` with ``amax_history`` [len, 3 * gemms] / [len, 2 * gemms] and ``scale``, and
serialise it as ``_extra_state``, as TE's delayed scaling does. No fp8 arithmetic happens: only the interface.
"""

from __future__ import annotations

import contextlib
import io
import sys
import types
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn


class Format(Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


class Recipe:
    pass


@dataclass
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: Any = None
    reduce_amax: bool = True


@dataclass
class Float8CurrentScaling(Recipe):
    fp8_format: Format = Format.HYBRID


@dataclass
class MXFP8BlockScaling(Recipe):
    fp8_format: Format = Format.E4M3


@dataclass
class Float8BlockScaling(Recipe):
    fp8_format: Format = Format.E4M3


@dataclass
class NVFP4BlockScaling(Recipe):
    fp4_format: str = "E2M1"
    disable_rht: bool = False


@dataclass
class _Scaling:
    amax_history: torch.Tensor
    scale: torch.Tensor


class _TEModule(nn.Module):
    def _init_fp8_meta(self, gemms: int, history_len: int = 8) -> None:
        self.fp8_meta = {
            "scaling_fwd": _Scaling(torch.zeros(history_len, 3 * gemms), torch.ones(3 * gemms)),
            "scaling_bwd": _Scaling(torch.zeros(history_len, 2 * gemms), torch.ones(2 * gemms)),
        }

    def get_extra_state(self) -> torch.Tensor:
        buffer = io.BytesIO()
        torch.save(self.fp8_meta, buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.fp8_meta = torch.load(io.BytesIO(state.numpy().tobytes()), weights_only=False)


class Linear(_TEModule):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, params_dtype: torch.dtype | None = None,
                 device: Any = "cuda", **kwargs: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device)) if bias else None
        self._init_fp8_meta(gemms=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool | None = None,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False, device: Any = "cuda") -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


AUTOCAST_CALLS: list[dict] = []


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Recipe | None = None,
             amax_reduction_group: Any = None, _graph: bool = False):
    AUTOCAST_CALLS.append({"enabled": enabled, "recipe": recipe})
    yield


def install(monkeypatch) -> types.ModuleType:
    """Put the stand-in where `import transformer_engine.pytorch` finds it, and make lightning_precision see TE."""
    from lightning_precision import _imports

    root = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    for name in ("Linear", "LayerNorm", "autocast"):
        setattr(pytorch, name, globals()[name])
    for name in ("Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling",
                 "Format"):
        setattr(recipe, name, globals()[name])
    root.pytorch, root.common, common.recipe = pytorch, common, recipe
    for name, mod in [("transformer_engine", root), ("transformer_engine.pytorch", pytorch),
                      ("transformer_engine.common", common), ("transformer_engine.common.recipe", recipe)]:
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(_imports, "TRANSFORMER_ENGINE_AVAILABLE", True)
    AUTOCAST_CALLS.clear()
    return pytorch
