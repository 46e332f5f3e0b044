"""Mixed precision on Intel XPU for Fabric: bf16 (default) or fp16 autocast for ``"xpu"``, the dtype always explicit
(XPU autocast defaults to fp16), a loss scaler only for fp16 (bf16 skips non-finite steps without one), and IPEX only
when it matches this torch."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.nn import Module
from typing_extensions import override

from lightning_precision import _imports
from lightning_precision._core.autocast import MatmulPrecision
from lightning_precision._core.devices import check_fp64
from lightning_precision._core.scaled import SKIP_NONFINITE_DEFAULT, ScaledPrecision
from lightning_precision._core.scaling.scaler import ScalerConfig, resolve_scaler_config
from lightning_precision._core.scaling.step_policy import PlainStep
from lightning_precision._warnings import NoEffectWarning, warn

__all__ = ["XPUPrecision"]

# The compute dtype and Lightning's precision label of each `dtype=`.
_DTYPES: dict[str, tuple[torch.dtype, Any]] = {
    "bf16": (torch.bfloat16, "bf16-mixed"),
    "fp16": (torch.float16, "16-mixed"),
}



def _check_choices(owner: str, dtype: str, ipex: object) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"`{owner}(dtype={dtype!r})`: use 'bf16' (recommended on XPU) or 'fp16'.")
    if ipex not in (False, True, "auto"):
        raise ValueError(f"`{owner}(ipex={ipex!r})`: use False, True or 'auto'.")

class XPUPrecision(ScaledPrecision):
    """Mixed precision on Intel GPUs: ``Fabric(strategy=XPUAccelerator.strategy(devices=1), plugins=[XPUPrecision()])``.

    Not an ``FP16MixedPrecision``: in bf16 (the default) it scales no loss (``loss_scale`` is ``None``). Every argument
    is keyword-only.

    Args:
        dtype: ``"bf16"`` (default; no scaler) or ``"fp16"`` (with ``torch.amp.GradScaler("xpu")``, the same
            skipped-step counting, logging and scheduler holding as ``FP16MixedPrecision``; needs fp64 on the device).
        ipex: ``False`` (default): upstream torch only. ``True``: ``intel_extension_for_pytorch.optimize`` the model
            (and optimizer, with the Trainer), or an error if IPEX is missing or built for another torch. ``"auto"``:
            IPEX
            when it matches, else upstream torch, quietly. IPEX is checked from package metadata before any import.
        scaler: fp16 only: the loss scaler's arguments as one ``ScalerConfig`` (``None``: its defaults). In bf16 it is
            a ``ValueError`` (bf16 scales no loss). There are no flat scaler arguments here: ``FP16MixedPrecision``'s
            ``init_scale=``, ... are that plugin's shorthand; every other plugin takes the one ``ScalerConfig``.
        skip_schedulers_on_overflow: fp16 only, as in ``FP16MixedPrecision``.
        skip_nonfinite: bf16: ``True`` skips an optimizer step whose gradients hold inf or nan instead of writing NaN
            into every weight, as ``BF16MixedPrecision(skip_nonfinite=True)`` does (default ``False``). fp16's scaler
            always skips them.
        max_consecutive_skips: skipped steps in a row before ``SkippedStepsError`` (default 50; None: never), in
            either dtype (in fp16 it may be given in ``scaler`` instead; in bf16 with ``skip_nonfinite=True`` only).
        matmul_precision: as for every plugin.
        reduce_dtype: as for every plugin (FSDP2's gradient reduction under ``mp_policy``).
        device: ``"xpu"``; another device type only to exercise the logic where no XPU exists (the tests do).
        eval_precision: as for every plugin: ``None``, ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``.
    """

    def __init__(
        self,
        *,
        dtype: Literal["bf16", "fp16"] = "bf16",
        ipex: bool | Literal["auto"] = False,
        # fp16 only: the loss scaler and what its skipped steps hold back.
        scaler: ScalerConfig | None = None, skip_schedulers_on_overflow: bool = True,
        matmul_precision: MatmulPrecision | None = None,
        device: str = "xpu",
        reduce_dtype: torch.dtype = torch.float32,
        # Skipped steps: the non-finite guard (bf16) and how many in a row stop the run (either dtype).
        skip_nonfinite: bool = SKIP_NONFINITE_DEFAULT,
        max_consecutive_skips: int | None = ScalerConfig.max_consecutive_skips,
        eval_precision: str | None = None,
    ) -> None:
        owner = type(self).__name__
        _check_choices(owner, dtype, ipex)
        if dtype == "bf16" and scaler is not None:
            # Refused, not ignored: a user who sets a scale believes the loss is scaled (as BF16MixedPrecision does).
            raise ValueError(
                f"`{owner}(dtype='bf16', scaler={scaler!r})`: bf16 has fp32's exponent range and runs without a loss"
                " scaler, so it would do nothing. Drop it, or pass `dtype='fp16'` to scale the loss."
            )
        config = resolve_scaler_config(owner, scaler, max_consecutive_skips=max_consecutive_skips)
        compute_dtype, self.precision = _DTYPES[dtype]
        super().__init__(compute_dtype, config if dtype == "fp16" else None, skip_schedulers_on_overflow, device,
                         matmul_precision, reduce_dtype, skip_nonfinite=skip_nonfinite,
                         max_consecutive_skips=max_consecutive_skips, eval_precision=eval_precision)
        self.dtype = dtype
        self.ipex = ipex
        self._ipex_module: Any = _imports.load_ipex(ipex)

    @override
    def _on_device_resolved(self, device_type: str) -> None:
        if device_type == "xpu" and self.scaler_config is not None:
            check_fp64(torch.xpu.get_device_properties())
        elif device_type == "xpu" and self.step_policy.scaler is not None and torch.xpu.is_available():
            props = torch.xpu.get_device_properties()
            if not getattr(props, "has_fp64", True):
                # torch's GradScaler computes 1/scale in fp64 even at the guard's scale of 1: no guard on such a device.
                warn(f"`{type(self).__name__}(dtype='bf16')`: {getattr(props, 'name', 'this XPU')!r} has no fp64, in"
                     " which torch's GradScaler (the `skip_nonfinite` check) computes, so steps whose gradients hold"
                     " inf or nan are not skipped on it: they reach the weights, as with Lightning. Pass"
                     " `skip_nonfinite=False` to say you know.", NoEffectWarning)
                self.step_policy, self.skip_nonfinite = PlainStep(type(self).__name__), False
        super()._on_device_resolved(device_type)

    def ipex_optimize(self, model: Module, optimizer: Any = None) -> Any:
        """``ipex.optimize`` in place with this plugin's dtype when IPEX is in use; the identity otherwise."""
        if self._ipex_module is None:
            return model if optimizer is None else (model, optimizer)
        return self._ipex_module.optimize(model, optimizer=optimizer, dtype=self.compute_dtype, inplace=True)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_ipex_module"] = None  # a module cannot be pickled; loaded again in the new process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ipex_module = _imports.load_ipex(self.ipex)
