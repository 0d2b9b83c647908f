"""Pipeline figures: a Gantt chart of a timeline (measured or simulated) and the two side by side."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from lslm.pipeline.timeline import Timeline

__all__ = ["KIND_COLORS", "gantt", "plot_side_by_side"]

KIND_COLORS = {"F": "#8ecae6", "B": "#219ebc", "I": "#ffb703", "W": "#90be6d",
               "SEND_F": "#cccccc", "RECV_F": "#aaaaaa", "SEND_B": "#cccccc", "RECV_B": "#aaaaaa"}
_LABELS = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad"}


def _time_unit(timeline: Timeline) -> str:
    unit = timeline.meta.get("time_unit")
    if unit:
        return str(unit)
    return "cost units" if timeline.source == "simulated" else "s"


def gantt(ax: Any, timeline: Timeline, title: str | None = None, show_comm: bool = True) -> Any:
    """Draw ``timeline`` on ``ax``: one row per rank (rank 0 on top), a bar per event coloured by kind.

    Compute bars carry their micro-batch number (and stage, ``s<stage>``, when a rank holds several stages);
    communication events, when present and ``show_comm``, are thin grey bars under the row. The title gives
    the bubble fraction (timeline.py's definition).
    """
    multi = len({(e.rank, e.stage) for e in timeline.compute()}) > timeline.num_ranks
    t0 = timeline.span()[0] if timeline.compute() else 0.0
    span = max(timeline.makespan(), 1e-12) if timeline.compute() else 1.0
    kinds = []
    for e in timeline.events:
        y = e.rank
        if e.is_compute:
            ax.barh(y, e.duration, left=e.start - t0, height=0.7, color=KIND_COLORS[e.kind], edgecolor="black",
                    linewidth=0.4)
            if e.kind not in kinds:
                kinds.append(e.kind)
            if e.duration > 0.012 * span:
                label = f"{e.mb}" if not multi else f"{e.mb}\ns{e.stage}"
                ax.text(e.start - t0 + e.duration / 2, y, label, ha="center", va="center", fontsize=7)
        elif show_comm:
            ax.barh(y + 0.42, max(e.duration, 0.002 * span), left=e.start - t0, height=0.12,
                    color=KIND_COLORS.get(e.kind, "#999999"))
    ax.set_yticks(range(timeline.num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(timeline.num_ranks)])
    ax.set_ylim(timeline.num_ranks - 0.4, -0.6)
    ax.set_xlabel(f"time ({_time_unit(timeline)})")
    ax.set_ylabel("pipeline rank")
    bubble = timeline.bubble_fraction() if timeline.compute() else 0.0
    head = title or f"{timeline.source} timeline"
    ax.set_title(f"{head}: bubble {bubble:.1%}", fontsize=10)
    order = [k for k in ("F", "B", "I", "W") if k in kinds]
    if order:
        ax.legend(handles=[Patch(color=KIND_COLORS[k], label=_LABELS[k]) for k in order], fontsize=7,
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return ax


def plot_side_by_side(measured: Timeline, simulated: Timeline, title: str | None = None) -> Any:
    """A figure with the measured timeline (seconds) above the simulated one (cost units), same rank rows."""
    rows = max(measured.num_ranks, simulated.num_ranks)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.2 + 0.9 * rows), dpi=80)
    gantt(top, measured, title="measured")
    gantt(bottom, simulated, title="simulated")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
