"""GradientUnderflowMonitor's measures, counted into its state (``state``): each parameter gradient's cast
statistics in every format (the fp8 ones at the dynamic scale, keyed ``<fmt>/dynamic``), its fp16 figures at the loss
scale and its exponent histogram, compared with the probe's; each activation gradient's the same way."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from lightning_precision._core.accumulator import Accumulator
from lightning_precision.callbacks._underflow.plugin import unscaled
from lightning_precision.callbacks._underflow.scaling import Scaling, fp8_formats, label
from lightning_precision.callbacks._underflow.state import ACTIVATION, PARAM, add_counts, add_histogram, module_path
from lightning_precision.functional import (
    CastStats,
    dynamic_scale_stats,
    exponent_histogram,
    gradient_stats,
    measurable_values,
    multi_format_stats,
)

if TYPE_CHECKING:
    from lightning_precision.callbacks._underflow.probe import Probe

__all__ = ["Measures", "Skip"]

Skip = Callable[[str, Exception], None]  # told once what could not be measured, and why


@dataclass(frozen=True)
class Measures:
    """What the monitor measures now: ``formats`` (names), the fp8 ones at ``dynamic`` (None: unscaled), and per
    module the first format's figures when ``top_k``."""

    formats: Sequence[str]
    dynamic: Scaling | None
    top_k: int

    def label(self, fmt: str) -> str:
        return label(fmt, self.formats, self.dynamic)

    def at_fp8_scale(self, g: Tensor, per_format: dict[str, CastStats]) -> dict[str, CastStats]:
        """``per_format`` with each fp8 format's counts taken at the dynamic scale instead, keyed ``<fmt>/dynamic``."""
        fp8 = fp8_formats(self.formats, self.dynamic)
        if not fp8:
            return per_format
        assert self.dynamic is not None
        dynamic = dynamic_scale_stats(g, fp8, *self.dynamic)
        return {self.label(name): dynamic.get(name, stats) for name, stats in per_format.items()}

    def count_gradients(self, state: Accumulator, named_grads: Mapping[str, Tensor | None],
                        loss_scale: Tensor | float | None, carries_scale: bool, probe: Probe | None, histogram: bool,
                        skip: Skip) -> None:
        """``GradientUnderflowMonitor.measure_gradients``, into ``state``, with this step's ``probe`` (if any)."""
        hist = None
        for name, g in named_grads.items():
            if g is None:
                continue
            try:
                if carries_scale:
                    g = unscaled(g, loss_scale)  # type: ignore[arg-type]  # not None: the monitor checked
                per_format, scaled, h = gradient_stats(g, self.formats, loss_scale)
                per_format = self.at_fp8_scale(g, per_format)
            except (RuntimeError, TypeError, ValueError) as err:
                skip(name, err)
                continue
            values = measurable_values(g)
            if probe is not None:
                probe.compare(name, values)
            for fmt, stats in per_format.items():
                add_counts(state, f"param/{fmt}", stats)
            if self.top_k:
                add_counts(state, f"layer/{module_path(name)}", per_format[self.label(self.formats[0])])
            if scaled is not None:
                add_counts(state, "param_scaled/fp16", scaled)
            hist = h if hist is None else hist + h
        if probe is not None and (lost := probe.lost()) is not None:
            add_counts(state, "lost/fp16", lost)
            hist = probe.histogram_or(hist) if hist is not None else hist
        if hist is not None and histogram:
            add_histogram(state, PARAM, hist)
        activations = probe.judged_activations() if probe is not None else None
        if activations is not None:
            add_histogram(state, ACTIVATION, activations)

    def count_activation(self, state: Accumulator, grad: Tensor, scale: Tensor | None, probe: Probe | None,
                         skip: Skip) -> None:
        """An activation gradient of a real backward, carrying the loss scale ``scale``, into ``state``; its histogram
        waits for this step's ``probe`` to be judged, where one ran with activation hooks."""
        kind = "act_scaled" if scale is not None else "act"
        try:
            per_format = self.at_fp8_scale(grad, multi_format_stats(grad, self.formats))
            hist = exponent_histogram(grad, 1.0 / scale if scale is not None else 1.0)
        except (RuntimeError, TypeError, ValueError) as err:
            skip("activation gradients", err)
            return
        for fmt, stats in per_format.items():
            add_counts(state, f"{kind}/{fmt}", stats)
        if probe is not None and probe.activation_histogram is not None:  # judged with the probe, at measure time
            probe.add_real_activations(hist)
        else:
            add_histogram(state, ACTIVATION, hist)
