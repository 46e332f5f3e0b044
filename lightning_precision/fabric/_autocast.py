"""The one autocast core every plugin builds on.

It owns what all mixed-precision plugins share: the autocast device (taken from where the model lives, never
guessed from the accelerator), the explicit dtype, the ``float32_matmul_precision`` of the run, and casting outputs
back to the default dtype. Scaling, fp8 and XPU specifics live in the small modules beside it.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Literal, Optional

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
_MATMUL_PRECISIONS = ("highest", "high", "medium")
MatmulPrecision = Literal["highest", "high", "medium"]


def _module_device_type(module: Optional[Module]) -> Optional[str]:
    """The device type of the first parameter or buffer, or None when the module holds no tensor."""
    if module is None:
        return None
    for tensor in module.parameters():
        return tensor.device.type
    for tensor in module.buffers():
        return tensor.device.type
    return None


def _validate_device(owner: str, device: Optional[str]) -> None:
    if device is not None and device not in _AUTOCAST_DEVICES:
        raise ValueError(
            f"`{owner}(device={device!r})` is not an autocast device. Use one of {_AUTOCAST_DEVICES}, or leave"
            " `device=None` to autocast for the device the model lives on."
        )


def _validate_matmul_precision(owner: str, matmul_precision: Optional[str]) -> None:
    if matmul_precision is not None and matmul_precision not in _MATMUL_PRECISIONS:
        raise ValueError(
            f"`{owner}(matmul_precision={matmul_precision!r})` is not a float32 matmul precision. Use one of"
            f" {_MATMUL_PRECISIONS} (see `torch.set_float32_matmul_precision`), or None to leave it as it is."
        )


class _AutocastPrecision(FabricPrecision):
    """Fabric base of every autocast plugin: ``torch.autocast(device_type, dtype)`` with both always explicit.

    Subclasses set ``precision`` and pass ``compute_dtype``; the device type is resolved once, from the model, the first
    time it is needed after the model has been moved (Fabric and the Trainer both move it after ``convert_module``).
    """

    def __init__(
        self,
        compute_dtype: torch.dtype,
        device: Optional[str] = None,
        matmul_precision: Optional[MatmulPrecision] = None,
    ) -> None:
        owner = type(self).__name__
        _validate_device(owner, device)
        _validate_matmul_precision(owner, matmul_precision)
        self.compute_dtype = compute_dtype
        self.device = device
        self.matmul_precision = matmul_precision
        self._device_type: Optional[str] = device
        self._module_ref: Optional[weakref.ref] = None
        self._resolved = False
        self._previous_matmul_precision: Optional[str] = None

    @property
    def device_type(self) -> str:
        """The device type autocast runs for: the explicit ``device``, else where the model lives (cpu if unknown)."""
        if self._device_type is None:
            module = self._module_ref() if self._module_ref is not None else None
            found = _module_device_type(module)
            if found is None:
                # Nothing to look at (no model set up yet, or a model without tensors): do not cache the guess.
                return "cpu"
            self._device_type = found
        if not self._resolved:
            self._resolved = True
            self._on_device_resolved(self._device_type)
        return self._device_type

    def _on_device_resolved(self, device_type: str) -> None:
        """Hook for subclasses that hold device-bound state (the fp16 scaler) or must check the hardware."""

    @override
    def convert_module(self, module: Module) -> Module:
        # Called before the model is moved, so only remember it; the device is read on first use.
        self._module_ref = weakref.ref(module)
        self._device_type = self.device
        self._resolved = False
        if self.matmul_precision is not None and self._previous_matmul_precision is None:
            self._previous_matmul_precision = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(self.matmul_precision)
        return module

    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.autocast_context_manager():
            yield

    @override
    def convert_output(self, data: Any) -> Any:
        # Casting a low-precision output up is exact, and code after the model (a loss outside the model, metrics)
        # then runs in full precision as it would without the plugin.
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    @override
    def teardown(self) -> None:
        if self._previous_matmul_precision is not None:
            torch.set_float32_matmul_precision(self._previous_matmul_precision)
            self._previous_matmul_precision = None
        self._module_ref = None
        self._device_type = self.device
        self._resolved = False

    def __getstate__(self) -> dict[str, Any]:
        # A weak reference cannot be pickled (ddp_spawn pickles the plugin); the module is found again at setup.
        state = self.__dict__.copy()
        state["_module_ref"] = None
        return state
