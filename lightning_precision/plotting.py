"""Plots (matplotlib, an optional dependency: `pip install 'lightning-precision[plots]'`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import Tensor

from lightning_precision._imports import _MATPLOTLIB_AVAILABLE, require
from lightning_precision.formats import get_format
from lightning_precision.functional import HIST_MIN

_COLORS = {"fp16": "tab:red", "bf16": "tab:blue", "e4m3fn": "tab:green", "e5m2": "tab:purple", "tf32": "tab:orange"}


def plot_exponent_histogram(
    histograms: Mapping[str, Tensor], path: str, formats: Sequence[str] = ("fp16", "bf16", "e4m3fn", "e5m2")
) -> str:
    """The distribution of log2|g|, with each format's representable range marked, as in the figure of the 2018
    mixed-precision paper (Micikevicius et al.): values left of a format's subnormal limit flush to zero in it."""
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
    ax.set_xlabel("log2 |gradient|   (dashed: smallest subnormal of each format; values left of it flush to zero)")
    ax.set_ylabel("fraction of non-zero values")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
