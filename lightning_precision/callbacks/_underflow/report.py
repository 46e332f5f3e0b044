"""What GradientUnderflowMonitor logs, from the window's synced counts: its keys and fractions (0-d device tensors,
read once by the caller), and the one-time warning with the loss scale to use."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_precision._core.scaling.scaler import ScalerConfig
from lightning_precision.callbacks._underflow.plugin import loss_scale_of, scale_in_gradients
from lightning_precision.functional import CastStats, LossScaleAdvice

__all__ = ["gradient_metrics", "underflow_warning", "warning_key"]


def gradient_metrics(counts: dict[str, Tensor], top_k: int, first_format: str) -> tuple[dict[str, Tensor], bool]:
    """The gradient keys of the window's synced counts by key (``param/fp16``, ``layer/<module path>``, ...; the
    ``top_k`` layers with the most underflow in ``first_format``, as keyed), and whether a probe of the window
    overflowed."""
    stats = {key: CastStats(*row.unbind()) for key, row in counts.items()}
    lost = stats.get("lost/fp16")
    overflowed = lost is not None and int(lost.nonfinite) > 0  # read here, on a logging step
    if lost is not None and int(lost.numel) == 0:
        stats.pop("lost/fp16")  # every probe of the window overflowed: what was lost is unknown, not 0
        lost = None
    metrics = _format_metrics(stats, lost)
    layers = {k.split("/", 1)[1]: s.underflow_fraction for k, s in stats.items() if k.startswith("layer/")}
    # one read for every layer's fraction, not one each (on a GPU each read is a synchronisation)
    fractions = dict(zip(layers, torch.stack([v.double() for v in layers.values()]).tolist(), strict=True)) \
        if layers else {}
    for path in sorted(layers, key=lambda p: -fractions[p])[:top_k]:
        metrics[f"precision/underflow/{first_format}/{path}"] = layers[path]
    return metrics, overflowed


def _format_metrics(stats: dict[str, CastStats], lost: CastStats | None) -> dict[str, Tensor]:
    """The keys of each format: parameter gradients (unscaled, loss-scaled, lost to fp16) and activation gradients;
    what the probe found lost to fp16 counts as underflow at the loss scale, not as exact zeros."""
    metrics: dict[str, Tensor] = {}
    for key, s in stats.items():
        kind, name = key.split("/", 1)
        if kind == "param":
            metrics[f"precision/underflow/{name}"] = s.underflow_fraction
            metrics[f"precision/overflow/{name}"] = s.overflow_fraction
            zeros = s.exact_zero - lost.underflow if lost is not None else s.exact_zero
            metrics["precision/exact_zero"] = zeros.double() / s.numel.clamp(min=1).double()
        elif kind == "param_scaled":
            under = s.underflow + lost.underflow if lost is not None else s.underflow
            metrics[f"precision/underflow/{name}/scaled"] = under.double() / s.numel.clamp(min=1).double()
            metrics[f"precision/overflow/{name}/scaled"] = s.overflow_fraction
        elif kind == "lost":
            metrics[f"precision/underflow/{name}/lost"] = s.underflow_fraction
        elif kind.startswith("act"):
            suffix = "/scaled" if kind == "act_scaled" else ""
            metrics[f"precision/act_underflow/{name}{suffix}"] = s.underflow_fraction
            metrics[f"precision/act_overflow/{name}{suffix}"] = s.overflow_fraction
            metrics["precision/act_exact_zero"] = s.exact_zero_fraction
    return metrics


def warning_key(metrics: dict[str, float], threshold: float) -> str | None:
    """The fp16 figure that warns (the one at the current scale, if logged), when it exceeds ``threshold``."""
    key = next((k for k in ("precision/underflow/fp16/scaled", "precision/act_underflow/fp16/scaled",
                            "precision/underflow/fp16") if k in metrics), None)
    return None if key is None or metrics[key] <= threshold else key


def underflow_warning(metrics: dict[str, float], key: str, advice: LossScaleAdvice, plugin: Any) -> str:
    """The warning for ``metrics[key]`` under ``plugin``, with ``advice`` (``recommend_loss_scale``): the scale to
    pass to the fp16 plugin in use, or bf16 where no scale keeps the gradients."""
    scale, under, _ = advice
    current = loss_scale_of(plugin)
    at = f"at loss scale {float(current):g}" if current is not None else "without loss scaling"
    if not ScalerConfig.min_scale <= scale <= ScalerConfig.max_scale:
        text = (f"No loss scale within [{ScalerConfig.min_scale:g}, {ScalerConfig.max_scale:g}] keeps them"
                f" without overflow (it would take {scale:g}): train in bf16 (BF16MixedPrecision).")
    else:
        # The plugin to pass it to: the true one when the run is in true fp16, else the mixed one.
        name = "FP16TruePrecision" if scale_in_gradients(plugin) is not None else "FP16MixedPrecision"
        text = f"A loss scale of {scale:g} would leave {under:.3%}: `{name}(init_scale={scale:g})`, or train in bf16."
    return f"{metrics[key]:.2%} of gradients flush to zero in fp16 {at} ({key}). {text}"
