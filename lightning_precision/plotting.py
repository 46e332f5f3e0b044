"""Plots (matplotlib)."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_precision._imports import _MATPLOTLIB_AVAILABLE, require
from lightning_precision._io import atomic_write_bytes, check_writable_file
from lightning_precision.formats import BlockFormat, get_format
from lightning_precision.functional import HIST_MIN

__all__ = ["check_plot_path", "plot_amax_history", "plot_compare", "plot_exponent_histogram"]

_COLORS = {"fp16": "tab:red", "bf16": "tab:blue", "e4m3fn": "tab:green", "e5m2": "tab:purple", "tf32": "tab:orange"}


def _image_format(path: "str | os.PathLike[str]") -> str:
    """The format matplotlib writes for ``path``'s suffix (PNG without one)."""
    return Path(path).suffix.lower().lstrip(".") or "png"


def check_plot_path(path: "str | os.PathLike[str]", owner: str) -> Path:
    """Prove, before the work whose plot it is, that a plot can be written at ``path``: matplotlib is installed, it
    writes the suffix's format, and the file can be written (``_io.check_writable_file``). A ``ValueError`` (or the
    ImportError naming the extra) otherwise."""
    require(_MATPLOTLIB_AVAILABLE, "matplotlib", owner)
    from matplotlib.backend_bases import FigureCanvasBase

    supported = FigureCanvasBase.get_supported_filetypes()
    if _image_format(path) not in supported:
        raise ValueError(f"{owner}: {str(path)!r}: matplotlib writes no {_image_format(path)!r} images; name a"
                         f" {', '.join('.' + s for s in sorted(supported))} file (.png is usual).")
    return check_writable_file(path, owner)


def _save(fig: Any, path: "str | os.PathLike[str]", dpi: int) -> str:
    """Write the figure to ``path`` whole or not at all (``atomic_write_bytes``): a full disk or a kill mid-write
    leaves the previous plot, never a truncated one. Without a suffix, PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=_image_format(path), dpi=dpi)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())
    return str(path)


def plot_exponent_histogram(
    histograms: Mapping[str, Tensor], path: str, formats: Sequence[str] = ("fp16", "bf16", "e4m3fn", "e5m2")
) -> str:
    """The distribution of log2|g|, with each format's representable range marked, as in the figure of the 2018
    mixed-precision paper (Micikevicius et al.). Values are unscaled; round-to-nearest sends those below half of a
    format's smallest subnormal to zero (between half and it they round up to it)."""
    require(_MATPLOTLIB_AVAILABLE, "matplotlib", "Plotting")
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
        return _save(fig, path, dpi=110)
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
    require(_MATPLOTLIB_AVAILABLE, "matplotlib", "Plotting")
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
    for k, (ax, tensor) in enumerate(zip(axes, tensors)):
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
        return _save(fig, path, dpi=100)
    finally:
        plt.close(fig)


_PRECISION_COLORS = {"32-true": "tab:gray", "bf16-mixed": "tab:blue", "16-mixed": "tab:red", "fp8": "tab:green",
                    "fp8-auto": "tab:olive"}


def _precision_color(precision: str) -> str:
    """The same colour for a precision in every report."""
    return _PRECISION_COLORS.get(precision, "tab:purple")


def _title(meta: Mapping, what: str) -> str:
    return f"{meta['recipe']} on {meta['device']}: {what} ({meta['steps']} steps, batch {meta['batch_size']})"


def plot_compare(rows: Sequence[Mapping], out: Path, meta: Mapping) -> list[str]:
    """``loss.png`` (training loss per precision, and its difference from 32-true, where overlapping curves part),
    ``throughput.png`` (samples/s from the table's ms/step, with the interquartile range over turns and the table's
    speedup) and ``memory.png``; failed and interrupted precisions are drawn with what they reached and marked, not
    dropped."""
    require(_MATPLOTLIB_AVAILABLE, "matplotlib", "Plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(r: Mapping) -> str:
        status = "interrupted" if r.get("interrupted") else "failed" if "error" in r else ""
        return r["precision"] + (f" ({status} after {r.get('steps_done', 0)} steps)" if status else "")

    files = []
    base = next((r for r in rows if r["precision"] == "32-true" and r.get("losses")), None)
    fig, axes = plt.subplots(2 if base else 1, 1, figsize=(8, 6.4 if base else 4), sharex=True, squeeze=False)
    ax = axes[0, 0]
    for r in rows:
        if r.get("losses"):
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label(r), lw=1.2,
                    color=_precision_color(r["precision"]), ls="--" if "error" in r else "-")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title(_title(meta, "training loss"))
    if ax.lines:  # no precision reported a step (every one failed as it started): no legend of nothing, no warning
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no precision reported a training step", ha="center", va="center", transform=ax.transAxes)
    if base:
        diff = axes[1, 0]
        diff.axhline(0, color=_precision_color("32-true"), lw=1)
        for r in rows:
            if r is not base and r.get("losses"):
                n = min(len(r["losses"]), len(base["losses"]))
                diff.plot(range(1, n + 1), [a - b for a, b in zip(r["losses"][:n], base["losses"][:n])],
                          label=label(r), lw=1.2, color=_precision_color(r["precision"]))
        diff.set_ylabel("loss minus 32-true's loss")
        diff.set_title("difference from 32-true at the same step (same seed, same batches)", fontsize=9)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    files.append(str(out / "loss.png"))

    memory = ("peak resident memory gained in training (MiB)" if meta["device"] == "cpu"
              else "peak GPU memory allocated (MiB)")
    throughput = "samples / s (batch / ms/step)"
    for key, name, ylabel, what in (
        ("samples_per_s", "throughput.png", throughput, "throughput"),
        ("peak_memory_mb", "memory.png", memory, "memory, each precision in its own process"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.4))
        names = [r["precision"] for r in rows]
        values = [r.get(key) or 0.0 for r in rows]
        errors = None
        labels = ["failed" if "error" in r and not r.get("interrupted") and not r.get(key) else
                  "interrupted" if r.get("interrupted") and not r.get(key) else f"{v:.0f}" for r, v in zip(rows, values)]
        if key == "samples_per_s":
            # the turn medians' quartiles turned into samples/s (the slower quartile gives the lower bound): the same
            # statistic as the bar, and as the table's ms/step
            errors = [[max(0.0, v - meta["batch_size"] * 1e3 / r["turn_ms_q3"]) if "turn_ms_q3" in r else 0.0
                       for v, r in zip(values, rows)],
                      [max(0.0, meta["batch_size"] * 1e3 / r["turn_ms_q1"] - v) if "turn_ms_q1" in r else 0.0
                       for v, r in zip(values, rows)]]
            names = [n + (f"\n{r['speedup']:.2f}x" if r.get("speedup") is not None else "") for n, r in zip(names, rows)]
            ax.set_xlabel("under each name its speedup: 32-true's ms/step over its own, as in the table\nms/step: the"
                          " median of the turns' median step times; whiskers: the middle half of the turns", fontsize=8)
        bars = ax.bar(names, values, yerr=errors, capsize=4, color=[_precision_color(r["precision"]) for r in rows])
        ax.bar_label(bars, label_type="center", labels=labels)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_title(_title(meta, what), fontsize=10)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        files.append(str(out / name))
    return files
