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


def plot_amax_history(
    history: Tensor, layers: Sequence[str], tensors: Sequence[str], what_if: Mapping[str, Tensor | float], path: str
) -> str:
    """amax over the recorded steps, one panel per tensor (input, weight, output gradient), one line per layer, and
    the what-if table of the last logging step: fp8 underflow/overflow with the delayed scale versus the current one."""
    require(_MATPLOTLIB_AVAILABLE, "matplotlib", "Plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = history.detach().float().cpu()
    fig, axes = plt.subplots(1, len(tensors) + 1, figsize=(5 * (len(tensors) + 1), 4.2))
    for k, (ax, tensor) in enumerate(zip(axes, tensors)):
        for i, layer in enumerate(layers):
            ax.plot(range(h.shape[0]), h[:, i, k].clamp(min=1e-30).tolist(), label=layer, lw=1.2)
        ax.set_yscale("log")
        ax.set_title(f"amax of {tensor}")
        ax.set_xlabel("step in window (oldest first)")
    if len(layers) <= 12:
        axes[0].legend(fontsize=7)
    table = axes[-1]
    table.axis("off")
    rows = sorted(what_if.items())
    text = "\n".join(f"{k.removeprefix('precision/fp8_whatif/')}: {float(v):.3%}" for k, v in rows) or "no what-if yet"
    table.text(0, 1, "fp8 cast, delayed vs current scale\n\n" + text, va="top", family="monospace", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def plot_compare(rows: Sequence[Mapping], out: Path) -> list[str]:
    """``loss.png`` (training loss per precision), ``throughput.png`` (samples/s) and ``memory.png`` (peak MB)."""
    require(_MATPLOTLIB_AVAILABLE, "matplotlib", "Plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["precision"], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    files.append(str(out / "loss.png"))
    for key, name, label in (("samples_per_s", "throughput.png", "samples / s"), ("peak_memory_mb", "memory.png", "peak memory (MB)")):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        names = [r["precision"] for r in rows]
        values = [r[key] for r in rows]
        bars = ax.bar(names, values, color=["tab:gray", "tab:blue", "tab:red", "tab:green"][: len(rows)])
        ax.bar_label(bars, fmt="%.0f")
        ax.set_ylabel(label)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        files.append(str(out / name))
    return files
