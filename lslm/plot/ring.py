"""Picture of a ring all-reduce, one panel per step (from :mod:`lslm.collectives.ring_trace`)."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from lslm.collectives.ring_trace import RingStep

_FONT = 9  # every label at least 8 pt at the notebooks' 80 dpi


def _panel(ax: Any, st: RingStep, n: int) -> None:
    cmap = plt.get_cmap("Blues")
    for r in range(n):
        for c in range(n):
            k = len(st.holds[r][c])
            ax.add_patch(Rectangle((c, n - 1 - r), 0.95, 0.9, fc=cmap(0.15 + 0.75 * k / n),
                                   ec="black" if k == n else "grey", lw=1.5 if k == n else 0.5))
            label = "all" if k == n else "+".join(str(i) for i in sorted(st.holds[r][c]))
            ax.text(c + 0.47, n - 1 - r + 0.45, label, ha="center", va="center", fontsize=_FONT,
                    color="white" if k > n / 2 else "black")
    ax.set_xlim(0, n)
    ax.set_ylim(0, n)
    ax.set_xticks([c + 0.47 for c in range(n)], [f"c{c}" for c in range(n)], fontsize=_FONT)
    ax.set_yticks([n - 1 - r + 0.45 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=_FONT)
    ax.tick_params(length=0)
    ax.set_title("start" if st.phase == "start" else f"{st.phase}, step {st.step}", fontsize=_FONT + 1)
    if st.sends:  # one send per line: src -> dst, chunk
        ax.set_xlabel("\n".join(f"{s}→{d}: c{c}" for s, d, c in st.sends), fontsize=_FONT)
    for side in ax.spines.values():
        side.set_visible(False)


def plot_ring_trace(trace: list[RingStep], panel_size: float = 2.6) -> Any:
    """Draw each rank's chunks after every step; shade = how many ranks' data the chunk holds.

    Row 1: the start and the reduce-scatter steps; row 2: the all-gather steps. Each
    cell is labelled with the ranks summed into it; below each panel, the step's sends
    ``src→dst: chunk``, one per line. Returns the figure.
    """
    n = len(trace[0].holds)
    first = [st for st in trace if st.phase != "all-gather"]
    second = [st for st in trace if st.phase == "all-gather"]
    cols = max(len(first), len(second))
    height = panel_size * n / 4 + 0.25 * n + 0.8  # the grid, the send lines below it, the title
    fig, axes = plt.subplots(2 if second else 1, cols, figsize=(panel_size * cols, height * (2 if second else 1)),
                             dpi=80, squeeze=False)
    for row, steps in zip(axes, (first, second)):
        for j, ax in enumerate(row):
            if j < len(steps):
                _panel(ax, steps[j], n)
            else:
                ax.axis("off")
    fig.suptitle(f"Ring all-reduce on {n} ranks: chunk c of each rank holds the sum of the listed ranks' data\n"
                 "(below each step, its sends: source rank → destination rank: chunk)",
                 fontsize=_FONT + 2)
    fig.tight_layout()
    return fig
