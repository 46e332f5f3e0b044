"""The figures say what they show: titles, labelled axes with units, fixed colours per precision, no axis stretched by
values that are not data. Each figure is caught as it is saved and its axes are read."""

import os

import matplotlib
import matplotlib.figure
import pytest
import torch
from matplotlib.colors import to_hex

from lightning_precision import _plots
from lightning_precision.cli.compare import plots as lp_plots
from lightning_precision.cli.compare.rows import Row
from lightning_precision.functional import exponent_histogram

matplotlib.use("Agg")


@pytest.fixture
def figures(monkeypatch):
    saved, drawn = {}, []
    real, real_write = matplotlib.figure.Figure.savefig, _plots.atomic_write_bytes

    def capture(fig, target, *args, **kwargs):
        if isinstance(target, (str, os.PathLike)):
            saved[os.path.basename(target)] = fig
        else:  # drawn in memory first, then written whole by `atomic_write_bytes`, which names the file
            drawn.append(fig)
        return real(fig, target, *args, **kwargs)

    def write(path, data):
        saved[os.path.basename(path)] = drawn.pop()
        return real_write(path, data)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    monkeypatch.setattr(_plots, "atomic_write_bytes", write)
    return saved


META = {"recipe": "vit", "device": "cpu", "steps": 4, "batch_size": 8}


def _row(precision, losses, **extra):
    return Row(precision, losses=losses, samples_per_s=100.0, peak_memory_mb=3.0, step_ms_q1=70.0, step_ms_q3=90.0,
               steps_done=len(losses), **extra)


def _lines(ax):
    return {line.get_label(): to_hex(line.get_color()) for line in ax.get_lines() if not line.get_label().startswith("_")}


def test_compare_plots_have_titles_units_and_fixed_colours(figures, tmp_path):
    rows = [_row("32-true", [1.0, 0.9, 0.8, 0.7]), _row("bf16-mixed", [1.0, 0.91, 0.79, 0.7])]
    lp_plots.plot_compare(rows, tmp_path, META)
    loss, diff = figures["loss.png"].axes
    assert "vit on cpu" in loss.get_title() and "4 steps" in loss.get_title()
    assert loss.get_ylabel() and diff.get_ylabel() == "loss minus 32-true's loss" and diff.get_xlabel()
    assert [round(v, 6) for v in diff.get_lines()[-1].get_ydata()] == [0.0, 0.01, -0.01, 0.0]  # where curves overlap
    first = _lines(loss)
    for name in ("throughput.png", "memory.png"):
        ax = figures[name].axes[0]
        assert ax.get_ylabel() and "vit on cpu" in ax.get_title()
    assert "(MiB)" in figures["memory.png"].axes[0].get_ylabel()

    figures.clear()  # another report, other order: the same colour per precision
    lp_plots.plot_compare(list(reversed(rows)), tmp_path, META)
    assert _lines(figures["loss.png"].axes[0]) == first == {"32-true": to_hex("tab:gray"), "bf16-mixed": to_hex("tab:blue")}


def test_a_failed_precision_stays_in_the_plots(figures, tmp_path):
    rows = [_row("32-true", [1.0, 0.9, 0.8, 0.7]),
            Row("fp8", error="boom", losses=[1.0, 0.95], steps_done=2)]
    lp_plots.plot_compare(rows, tmp_path, META)
    assert "fp8 (failed after 2 steps)" in _lines(figures["loss.png"].axes[0])
    labels = [t.get_text() for t in figures["throughput.png"].axes[0].texts]
    assert "failed" in labels


def test_amax_plot_has_a_y_label_and_zeros_do_not_stretch_it(figures, tmp_path):
    history = torch.tensor([[[0.0, 2.0, 1e-3]], [[4.0, 3.0, 2e-3]], [[5.0, 0.0, 0.0]]])  # (steps, layers, tensors)
    _plots.plot_amax_history(history, ["fc1"], ["input", "weight", "grad_output"], {}, str(tmp_path / "a.png"))
    axes = figures["a.png"].axes
    for ax in axes[:3]:
        assert ax.get_ylabel().startswith("amax")
        assert ax.get_ylim()[0] > 1e-5  # not 1e-30 from the steps where the layer held 0


def test_histogram_says_values_are_unscaled_and_states_the_rounding_rule(figures, tmp_path):
    hist = exponent_histogram(torch.tensor([1e-8, 1e-3, 0.5]), 1.0)
    _plots.plot_exponent_histogram({"activation gradients": hist}, str(tmp_path / "h.png"))
    ax = figures["h.png"].axes[0]
    assert "unscaled" in ax.get_xlabel() and "below half of it" in ax.get_xlabel()
    assert "unscaled" in ax.get_legend().get_title().get_text()


def _fits(fig) -> bool:
    """Whether everything drawn lies inside the figure: what the saved PNG would otherwise cut off. The tight box is
    what ``savefig(bbox_inches="tight")`` would crop to (drawn artists only), in inches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # the figure was closed after saving
    fig.draw(renderer)
    drawn, figure = fig.get_tightbbox(renderer), fig.bbox_inches
    return bool(drawn.x0 >= figure.x0 - 0.01 and drawn.y0 >= figure.y0 - 0.01 and drawn.x1 <= figure.x1 + 0.01
                and drawn.y1 <= figure.y1 + 0.01)


def test_amax_plot_names_every_layer_and_cuts_no_text(figures, tmp_path):
    """The amax figure had no legend (none past 12 layers) and its what-if table ran off the bottom: DistilBERT's 37
    linear layers each get a distinct line named in a legend, and every text fits the figure."""
    layers = [f"distilbert.transformer.layer.{n}.{m}" for n in range(6)
              for m in ("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin", "ffn.lin1", "ffn.lin2")]
    layers.append("pre_classifier")
    tensors = ["input", "weight", "grad_output"]
    history = torch.rand(8, len(layers), 3) + 1e-3
    what_if = {f"precision/fp8_whatif/{t}/{k}/{s}": torch.tensor(0.01) for t in tensors
               for k in ("delayed", "current", "mxfp8", "nvfp4") for s in ("underflow", "overflow")}
    _plots.plot_amax_history(history, layers, tensors, what_if, str(tmp_path / "a.png"))
    fig = figures["a.png"]
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == layers
    styles = {(to_hex(line.get_color()), line.get_linestyle()) for line in fig.axes[0].get_lines()}
    assert len(styles) == len(layers)  # no two layers drawn alike
    assert _fits(fig)
    table = fig.axes[-1].texts[0].get_text()
    assert "input       delayed      1.000%    1.000%" in table and "grad_output" in table


def test_throughput_labels_carry_the_tables_marks(figures, tmp_path):
    """throughput.png wrote a bare `0.96x` under a bar the table marked "~" (not measurable) and "emulated": each label
    is now the table's own cell (the same function), a word a line, and a "~" bar is hatched."""
    from lightning_precision.cli.compare import report as lp_report

    timed = {"median_step_ms": 80.0}
    rows = [_row("32-true", [1.0], speedup=1.0, speedup_resolved=None, **timed),
            _row("bf16-mixed", [1.0], speedup=0.96, speedup_q1=0.66, speedup_q3=1.05, speedup_resolved=False, **timed),
            _row("fp8", [1.0], speedup=0.4, speedup_q1=0.36, speedup_q3=0.48, speedup_resolved=True, emulated=True,
                 **timed)]
    lp_plots.plot_compare(rows, tmp_path, META)
    ax = figures["throughput.png"].axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["32-true\n1.00x", "bf16-mixed\n~0.96x\n[0.66-1.05]", "fp8\n0.40x\n[0.36-0.48]\nemulated"]
    assert [label.split("\n", 1)[1].replace("\n", " ") for label in labels] == [lp_report.cells(r)[3] for r in rows]
    assert [bar.get_hatch() for bar in ax.patches] == [None, "//", None]
    assert "~ and hatched: not" in ax.get_xlabel() and "emulated: no hardware arithmetic" in ax.get_xlabel()
