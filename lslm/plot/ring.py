"""Picture of a ring all-reduce, one panel per step (from :mod:`lslm.collectives.ring_trace`)."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from lslm.collectives.ring_trace import RingStep


def plot_ring_trace(trace: list[RingStep], figsize_per_panel: float = 2.3) -> Any:
    """Draw each rank's chunks after every step; shade = how many ranks' data the chunk holds.

    Each cell is labelled with the ranks summed into it; arrows list the step's sends
    ``src->dst:chunk``. Returns the figure.
    """
    n = len(trace[0].holds)
    cols = len(trace)
    fig, axes = plt.subplots(1, cols, figsize=(figsize_per_panel * cols, 0.75 * n + 1.4), dpi=80)
    cmap = plt.get_cmap("Blues")
    for ax, st in zip(axes, trace):
        for r in range(n):
            for c in range(n):
                k = len(st.holds[r][c])
                ax.add_patch(Rectangle((c, n - 1 - r), 0.95, 0.9, fc=cmap(0.15 + 0.75 * k / n),
                                       ec="black" if k == n else "grey", lw=1.5 if k == n else 0.5))
                label = "all" if k == n else "+".join(str(i) for i in sorted(st.holds[r][c]))
                ax.text(c + 0.47, n - 1 - r + 0.45, label, ha="center", va="center", fontsize=7,
                        color="white" if k > n / 2 else "black")
        ax.set_xlim(0, n)
        ax.set_ylim(0, n)
        ax.set_xticks([c + 0.47 for c in range(n)], [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks([n - 1 - r + 0.45 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=7)
        ax.tick_params(length=0)
        title = "start" if st.phase == "start" else f"{st.phase}\nstep {st.step}"
        ax.set_title(title, fontsize=8)
        if st.sends:
            ax.set_xlabel(" ".join(f"{s}→{d}:c{c}" for s, d, c in st.sends), fontsize=6)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(f"Ring all-reduce on {n} ranks: chunk c of each rank holds the sum of the listed ranks' data "
                 f"(x-axis: chunk index; below each panel: sends src→dst:chunk)", fontsize=9)
    fig.tight_layout()
    return fig
