"""The comparison's plots (matplotlib): loss, throughput and memory per precision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_precision._imports import MATPLOTLIB_AVAILABLE, require
from lightning_precision.cli.compare.rows import Row, rate_text, speedup_text

__all__ = ["plot_compare"]

_PRECISION_COLORS = {"32-true": "tab:gray", "bf16-mixed": "tab:blue", "bf16-true": "tab:cyan", "16-mixed": "tab:red",
                     "16-true": "tab:orange", "fp8": "tab:green", "fp8-auto": "tab:olive",
                     "lightning-bf16-true": "tab:brown"}


def _precision_color(precision: str) -> str:
    """The same colour for a precision in every report."""
    return _PRECISION_COLORS.get(precision, "tab:purple")


def _title(meta: Mapping[str, Any], what: str) -> str:
    return f"{meta['recipe']} on {meta['device']}: {what} ({meta['steps']} steps, batch {meta['batch_size']})"


def _label(r: Row) -> str:
    status = "interrupted" if r.interrupted else "failed" if r.error is not None else ""
    return r.precision + (f" ({status} after {r.steps_done} steps)" if status else "")


def plot_compare(rows: Sequence[Row], out: Path, meta: Mapping[str, Any]) -> list[str]:
    """``loss.png`` (training loss per precision, and its difference from 32-true, where overlapping curves part),
    ``throughput.png`` (samples/s from the table's ms/step, with the interquartile range over turns, and the table's
    speedup cell under each name, its "~" and "emulated" marks included; a "~" bar hatched) and ``memory.png``
    (with the table's bytes/param); failed and interrupted precisions are drawn with what they reached and marked,
    not dropped."""
    require(MATPLOTLIB_AVAILABLE, "matplotlib", "Plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = [_loss_plot(plt, rows, out, meta)]
    memory = ("peak resident memory gained in training (MiB)" if meta["device"] == "cpu"
              else "peak GPU memory allocated (MiB)")
    throughput = "samples / s (batch / ms/step)"
    for key, name, ylabel, what in (
        ("samples_per_s", "throughput.png", throughput, "throughput"),
        ("peak_memory_mb", "memory.png", memory, "memory, each precision in its own process"),
    ):
        files.append(_bar_plot(plt, rows, out, meta, key, name, ylabel, what))
    return files


def _saved(plt: Any, fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _loss_plot(plt: Any, rows: Sequence[Row], out: Path, meta: Mapping[str, Any]) -> str:
    """``loss.png``: each precision's training loss and, where 32-true has one, each one's difference from it."""
    base = next((r for r in rows if r.precision == "32-true" and r.losses), None)
    fig, axes = plt.subplots(2 if base else 1, 1, figsize=(8, 6.4 if base else 4), sharex=True, squeeze=False)
    ax = axes[0, 0]
    for r in rows:
        if r.losses:
            ax.plot(range(1, len(r.losses) + 1), r.losses, label=_label(r), lw=1.2,
                    color=_precision_color(r.precision), ls="--" if r.error is not None else "-")
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
            if r is not base and r.losses:
                n = min(len(r.losses), len(base.losses))
                diff.plot(range(1, n + 1), [a - b for a, b in zip(r.losses[:n], base.losses[:n], strict=True)],
                          label=_label(r), lw=1.2, color=_precision_color(r.precision))
        diff.set_ylabel("loss minus 32-true's loss")
        diff.set_title("difference from 32-true at the same step (same seed, same batches)", fontsize=9)
    axes[-1, 0].set_xlabel("optimizer step")
    return _saved(plt, fig, out / "loss.png")


def _bar_plot(plt: Any, rows: Sequence[Row], out: Path, meta: Mapping[str, Any], key: str, name: str, ylabel: str,
              what: str) -> str:
    """A bar per precision of ``key`` (``samples_per_s`` or ``peak_memory_mb``), marked where the run failed or was
    interrupted before it had the figure."""
    fig, ax = plt.subplots(figsize=(7, 4.4))
    names = [r.precision for r in rows]
    figures = [r.samples_per_s if key == "samples_per_s" else r.peak_memory_mb for r in rows]
    values = [v or 0.0 for v in figures]
    errors, hatches = None, None
    labels = ["failed" if r.failed and not v else "interrupted" if r.interrupted and not v
              else rate_text(v) if key == "samples_per_s" else f"{v:.0f}" for r, v in zip(rows, values, strict=True)]
    if key == "samples_per_s":
        # the turn medians' quartiles turned into samples/s (the slower quartile gives the lower bound): the same
        # statistic as the bar, and as the table's ms/step
        errors = [[max(0.0, v - meta["batch_size"] * 1e3 / r.turn_ms_q3) if r.turn_ms_q3 is not None else 0.0
                   for v, r in zip(values, rows, strict=True)],
                  [max(0.0, meta["batch_size"] * 1e3 / r.turn_ms_q1 - v) if r.turn_ms_q1 is not None else 0.0
                   for v, r in zip(values, rows, strict=True)]]
        # the table's own cell, marks included, a word a line so that neighbouring labels do not run together
        names = [n + ("\n" + speedup_text(r).replace(" ", "\n") if r.speedup is not None else "")
                 for n, r in zip(names, rows, strict=True)]
        hatches = ["//" if r.speedup_resolved is False else "" for r in rows]
        ax.set_xlabel("under each name its speedup as in the table: the median paired ratio over 32-true [their"
                      " interquartile range]; ~ and hatched: not\nmeasurably different from 32-true; emulated: no"
                      " hardware arithmetic for it here. bars: batch / ms/step, the median of the turns' median step"
                      " times;\nwhiskers: the middle half of the turns", fontsize=7)
    elif any(r.bytes_per_param is not None for r in rows):
        names = [n + (f"\n{r.bytes_per_param:.1f} B/param" if r.bytes_per_param is not None else "")
                 for n, r in zip(names, rows, strict=True)]
        ax.set_xlabel("under each name its bytes/param, as in the table: weights, gradients and optimizer states"
                      " per parameter", fontsize=8)
    bars = ax.bar(names, values, yerr=errors, capsize=4, color=[_precision_color(r.precision) for r in rows])
    for bar, hatch in zip(bars, hatches or [], strict=False):
        if hatch:  # set bar by bar, as every matplotlib the extra allows (>=3.7) does
            bar.set_hatch(hatch)
            bar.set_edgecolor("black")
    ax.bar_label(bars, label_type="center", labels=labels)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(_title(meta, what), fontsize=10)
    return _saved(plt, fig, out / name)
