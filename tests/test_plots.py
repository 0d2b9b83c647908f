"""Figures a learner can read: no colour twice in one panel, every label at least 8 pt (on committed results)."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from lslm.collectives.ring_trace import ring_all_reduce_trace  # noqa: E402
from lslm.plot.collectives import fit_errors, plot_collectives  # noqa: E402
from lslm.plot.ddp import plot_bucket_sweep, plot_step_breakdown, plot_timeline  # noqa: E402
from lslm.plot.ring import plot_ring_trace  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _small_texts(fig) -> list[str]:
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip() and t.get_visible()]
    return [t.get_text() for t in texts if t.get_fontsize() < 8]


def _series_colours(ax) -> list[str]:
    """One colour per drawn series: lines with data, grouped by their legend label or by identity."""
    seen: dict[str, str] = {}
    for line in ax.get_lines():
        if len(line.get_xdata()) == 0:
            continue
        seen.setdefault(line.get_label() if not line.get_label().startswith("_") else str(id(line)),
                        to_hex(line.get_color()))
    return list(seen.values())


def test_collectives_figure_readable():
    results = {int(n): r for n, r in json.loads((RESULTS / "collectives.json").read_text()).items()}
    fig = plot_collectives(results)
    assert _small_texts(fig) == []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        colours = [to_hex(h.get_color()) for h in legend.legend_handles]
        assert len(colours) == len(set(colours)), (ax.get_title(), colours)
    plt.close(fig)
    assert fit_errors(results[2])["all"] == results[2]["fit"]["median_rel_error"]  # the same definition


def test_ring_trace_and_ddp_figures_readable():
    fig = plot_ring_trace(ring_all_reduce_trace(4))
    assert _small_texts(fig) == []
    plt.close(fig)
    res = json.loads((RESULTS / "ddp.json").read_text())["2"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4))
    plot_step_breakdown(res, ax=axes[0])
    plot_bucket_sweep(res, ax=axes[1])
    plot_timeline(res["timeline"], ax=axes[2])
    assert _small_texts(fig) == []
    colours = _series_colours(axes[1])
    assert len(colours) == len(set(colours)), colours
    plt.close(fig)
