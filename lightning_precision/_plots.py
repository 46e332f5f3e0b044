"""The callbacks' plots (matplotlib, an optional dependency): exponent histograms and amax histories, each file
written whole or not at all."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_precision._imports import MATPLOTLIB_AVAILABLE, require
from lightning_precision._io import atomic_write_bytes, check_writable_file
from lightning_precision.formats import BlockFormat, get_format
from lightning_precision.functional import HIST_MIN

__all__ = ["check_plot_path", "image_format", "plot_amax_history", "plot_exponent_histogram", "save_figure"]

_COLORS = {"fp16": "tab:red", "bf16": "tab:blue", "e4m3fn": "tab:green", "e5m2": "tab:purple", "tf32": "tab:orange"}


def image_format(path: str | os.PathLike[str]) -> str:
    """The format matplotlib writes for ``path``'s suffix (PNG without one)."""
    return Path(path).suffix.lower().lstrip(".") or "png"


def check_plot_path(path: str | os.PathLike[str], owner: str) -> Path:
    """Prove, before the work whose plot it is, that a plot can be written at ``path``: matplotlib is installed, it
    writes the suffix's format, and the file can be written (``_io.check_writable_file``). A ``ValueError`` (or the
    ImportError naming the extra) otherwise."""
    require(MATPLOTLIB_AVAILABLE, "matplotlib", owner)
    from matplotlib.backend_bases import FigureCanvasBase

    supported = FigureCanvasBase.get_supported_filetypes()
    if image_format(path) not in supported:
        raise ValueError(f"{owner}: {str(path)!r}: matplotlib writes no {image_format(path)!r} images; name a"
                         f" {', '.join('.' + s for s in sorted(supported))} file (.png is usual).")
    return check_writable_file(path, owner)


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int) -> str:
    """Write the figure to ``path`` whole or not at all (``atomic_write_bytes``): a full disk or a kill mid-write
    leaves the previous plot, never a truncated one. Without a suffix, PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=image_format(path), dpi=dpi)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())
    return str(path)


def plot_exponent_histogram(
    histograms: Mapping[str, Tensor], path: str, formats: Sequence[str] = ("fp16", "bf16", "e4m3fn", "e5m2")
) -> str:
    """The distribution of log2|g|, with each format's representable range marked, as in the figure of the 2018
    mixed-precision paper (Micikevicius et al.). Values are unscaled; round-to-nearest sends those below half of a
    format's smallest subnormal to zero (between half and it they round up to it)."""
    require(MATPLOTLIB_AVAILABLE, "matplotlib", "Plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.2))
    lo, hi = 0, 0
    for label, hist in histograms.items():
        counts = hist.detach().double().cpu()
        total = counts.sum().item()
        nonzero = counts.nonzero().flatten()
        if total == 0 or len(nonzero) == 0:
            continue
        lo, hi = min(lo, int(nonzero[0]) + HIST_MIN), max(hi, int(nonzero[-1]) + HIST_MIN)
        exps = [HIST_MIN + i for i in range(len(counts))]
        ax.bar(exps, (counts / total).tolist(), width=1.0, alpha=0.55, label=f"{label} ({int(total):,} values)")
    ranges = []
    for rank, name in enumerate(formats):
        f = get_format(name)
        if isinstance(f, BlockFormat):
            continue  # its range moves with each block's scale: no fixed window to draw
        color = _COLORS.get(f.name, "gray")
        y = 1.03 + 0.08 * rank
        ax.axvline(f.min_exponent, color=color, ls="--", lw=1)
        ranges.append((f, color, y))
        if f.min_exponent > -64:  # bf16/fp32-wide ranges would squeeze the data into a sliver: they run off the axis
            lo, hi = min(lo, f.min_exponent), max(hi, f.max_exponent + 1)
    left, right = max(lo - 4, HIST_MIN), hi + 4
    ax.set_xlim(left, right)
    for f, color, y in ranges:
        ax.plot([max(f.min_exponent, left), min(f.max_exponent + 1, right)], [y, y], color=color, lw=3,
                transform=ax.get_xaxis_transform(), clip_on=False)
        ax.text(max(f.min_exponent, left) + 0.5, y + 0.025, f"{f.name}: 2^{f.min_exponent} .. 2^{f.max_exponent + 1}",
                color=color, fontsize=8, transform=ax.get_xaxis_transform(), clip_on=False)
    ax.set_yscale("log")
    ax.set_xlabel("log2 |gradient|, unscaled (divided by the loss scale in effect)\n"
                  "dashed: each format's smallest subnormal; round-to-nearest sends values below half of it to zero")
    ax.set_ylabel("fraction of non-zero values")

    # The title would collide with the format ranges drawn above the axes: the legend says what is shown.
    ax.legend(loc="upper left", fontsize=8, title="gradients, unscaled (activation gradients too)", title_fontsize=8)
    fig.tight_layout()
    try:
        return save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)


# Line styles after the 10 colours run out: 40 layers (DistilBERT's 37 linear layers) get 40 distinct lines.
_LINE_STYLES = ("-", "--", ":", "-.")


def _what_if_lines(what_if: Mapping[str, Tensor | float], tensors: Sequence[str]) -> list[str]:
    """The what-if statistics as a table: a row per tensor (in the panels' order) and scaling (delayed, current, then
    the block formats), underflow and overflow side by side."""
    first = {name: n for n, name in enumerate([*tensors, "delayed", "current"])}
    cells: dict[tuple[str, str], dict[str, float]] = {}
    other = []
    order = lambda key: [(first.get(part, len(first)), part) for part in key.split("/")]  # noqa: E731
    for key, value in sorted(what_if.items(), key=lambda item: order(item[0])):
        parts = key.removeprefix("precision/fp8_whatif/").split("/")
        if len(parts) == 3 and parts[2] in ("underflow", "overflow"):
            cells.setdefault((parts[0], parts[1]), {})[parts[2]] = float(value)
        else:
            other.append(f"{key}: {float(value):.3%}")
    if not cells and not other:
        return ["no what-if yet (none was logged)"]
    lines = ["fp8 cast at the last logging step: the share", "of values that flush to zero or overflow", "",
             f"{'tensor':<12}{'scale':<9}{'underflow':>10}{'overflow':>10}"]
    tensor_before = None
    for (tensor, scale), stats in cells.items():
        shown = tensor if tensor != tensor_before else ""
        tensor_before = tensor
        lines.append(f"{shown:<12}{scale:<9}" + "".join(
            f"{stats[stat]:>10.3%}" if stat in stats else f"{'-':>10}" for stat in ("underflow", "overflow")))
    lines += ["", "delayed: scale from the amax history", "current: scale from the step's own amax",
              "mxfp8, nvfp4: a scale per block", *other]
    return lines


def plot_amax_history(
    history: Tensor, layers: Sequence[str], tensors: Sequence[str], what_if: Mapping[str, Tensor | float], path: str
) -> str:
    """amax over the recorded steps, one panel per tensor (input, weight, output gradient), one line per layer (named
    in the legend under the panels), and the what-if table of the last logging step: fp8 underflow/overflow with the
    delayed scale versus the current one. The figure grows with the legend and the table, so no text is cut off."""
    require(MATPLOTLIB_AVAILABLE, "matplotlib", "Plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = history.detach().float().cpu()
    # A layer that never ran (or a step it skipped) holds amax 0: no point on a log axis, rather than 1e-30 that would
    # stretch the axis over 30 decades.
    ran = [i for i in range(len(layers)) if bool((h[:, i] > 0).any())]
    table = _what_if_lines(what_if, tensors)
    width = 5.0 * len(tensors) + 4.2
    # Legend columns as wide as the longest layer name (about 17 characters an inch at 7 points), rows as needed.
    columns = max(1, min(len(ran), int(width / ((max(map(len, layers), default=1) + 5) / 17))))
    legend_rows = -(-len(ran) // columns)
    height = max(4.2, 3.6 + 0.2 * legend_rows, 0.16 * len(table) + 1.0)
    fig, axes = plt.subplots(1, len(tensors) + 1, figsize=(width, height), layout="constrained",
                             width_ratios=[5.0] * len(tensors) + [4.2])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (ax, tensor) in enumerate(zip(axes[:-1], tensors, strict=True)):  # the last axes holds the table
        for n, i in enumerate(ran):
            values = h[:, i, k]
            ax.plot(range(h.shape[0]), values.where(values > 0, float("nan")).tolist(), label=layers[i], lw=1.2,
                    color=colors[n % len(colors)], ls=_LINE_STYLES[n // len(colors) % len(_LINE_STYLES)])
        ax.set_yscale("log")
        ax.set_title(f"amax of {tensor}", fontsize=10)
        ax.set_xlabel("step in the history window (oldest first)", fontsize=9)
        ax.set_ylabel("amax: max |value| in the step (log scale)", fontsize=9)
    if ran:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=columns, fontsize=7,
                   title="layer", title_fontsize=8, frameon=False)
    skipped = len(layers) - len(ran)
    fig.suptitle(f"fp8 amax history, {len(ran)} layers" + (f" ({skipped} that never ran left out)" if skipped else ""),
                 fontsize=10)
    axes[-1].axis("off")
    axes[-1].text(0, 1, "\n".join(table), va="top", family="monospace", fontsize=8, transform=axes[-1].transAxes)
    try:
        return save_figure(fig, path, dpi=100)
    finally:
        plt.close(fig)
