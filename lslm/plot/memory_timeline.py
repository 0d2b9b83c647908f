"""The memory profiler's timeline drawn as a stacked area: bytes by category over one step's time."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt

from lslm.metrics.memory_timeline import MemoryTimeline

__all__ = ["CATEGORY_COLORS", "plot_memory_timeline"]

#: One colour per profiler category (:data:`lslm.metrics.step_memory.PROFILER_CATEGORIES`).
CATEGORY_COLORS = {"parameter": "#4361ee", "optimizer_state": "#7209b7", "input": "#adb5bd",
                   "temporary": "#f4a261", "activation": "#2a9d8f", "gradient": "#e63946",
                   "autograd_detail": "#e9c46a", "unknown": "#6c757d"}


def plot_memory_timeline(timeline: MemoryTimeline, ax: Any = None, title: str | None = None,
                         range_label: Any = None, skip_empty: bool = True) -> Any:
    """Draw ``timeline`` as a stacked area (a step function: bytes change at each sample), in MB
    (10^6 bytes) over milliseconds since its start, one colour per category, the peak marked.

    ``timeline.ranges`` are drawn as labelled spans along the top (``range_label(name)`` gives the
    text, default the name after its last ``:``; return ``None`` to draw a range without text).
    ``skip_empty`` leaves categories that stay at zero out of the legend.
    """
    if not timeline.times_us:
        raise ValueError("an empty memory timeline: the profiler saw no allocation on its device "
                         f"({timeline.device}); profile a step that allocates there")
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.6), dpi=80)
    t0 = timeline.start_us
    xs = [(t - t0) / 1e3 for t in timeline.times_us]
    names = [c for c in timeline.categories if not skip_empty or any(timeline.category(c))]
    ys = [[b / 1e6 for b in timeline.category(c)] for c in names]
    ax.stackplot(xs, *ys, labels=[c.replace("_", " ") for c in names], step="post",
                 colors=[CATEGORY_COLORS.get(c, "#999999") for c in names], alpha=0.85, lw=0)
    i = timeline.peak_index()
    total = sum(timeline.bytes[i]) / 1e6
    ax.plot([xs[i]], [total], marker="v", color="black", ms=6)
    ax.annotate(f"peak {total:.2f} MB", (xs[i], total), xytext=(4, 4), textcoords="offset points", fontsize=8)
    top = max(sum(r) for r in timeline.bytes) / 1e6 or 1.0
    label = range_label or (lambda n: n.rsplit(":", 1)[-1])
    for k, (name, a, b) in enumerate(timeline.ranges):
        lo, hi = (a - t0) / 1e3, (b - t0) / 1e3
        y = top * (1.08 + 0.06 * (k % 2))
        ax.plot([lo, hi], [y, y], color="#343a40", lw=2, solid_capstyle="butt")
        text = label(name)
        if text:
            ax.text((lo + hi) / 2, y, text, fontsize=7, ha="center", va="bottom")
    ax.set_ylim(0, top * 1.25)
    ax.set_xlim(0, max(xs[-1], max(((b - t0) / 1e3 for _, _, b in timeline.ranges), default=0.0)))
    ax.set_xlabel("time since the profile began (ms)")
    ax.set_ylabel("live bytes (MB)")
    ax.set_title(title or f"Memory by category over time ({timeline.device}, PyTorch's memory profiler)",
                 loc="left", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)  # clear of the ranges
    ax.figure.tight_layout()
    return ax
