"""Draw notebook 09's diagram (run `python images/make_3d_images.py`; the PNG is committed).

``09_3d_layout.png``: 8 ranks laid out as pp = 2, dp = 2, tp = 2 by lslm's rank grid
(:class:`lslm.runtime.grid.RankGrid`, axes outermost to innermost ``pp, dp, cp, tp``). Each pipeline stage is a
2 x 2 block (rows: data-parallel index, columns: tensor-parallel index); the three panels colour the same ranks
by their tensor-, data- and pipeline-parallel group. The groups are read from the grid, not typed in.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from diagram import box  # noqa: E402  (images/diagram.py)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from lslm.runtime.grid import RankGrid  # noqa: E402

COLORS = ("#8ecae6", "#ffb703", "#90be6d", "#f28482")
PANELS = (("tp", "tensor-parallel groups: consecutive ranks\n(the fastest links, innermost)"),
          ("dp", "data-parallel groups: stride tp = 2"),
          ("pp", "pipeline groups: stride dp · tp = 4"))


def main() -> None:
    """Draw the figure into images/09_3d_layout.png."""
    grid = RankGrid.build(8, tp=2, pp=2, dp=2)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=100)
    for ax, (axis, title) in zip(axes, PANELS):
        groups = grid.groups(axis)
        color = {r: COLORS[i % len(COLORS)] for i, g in enumerate(groups) for r in g}
        for rank in range(grid.world_size):
            c = grid.coords_of(rank)
            x = c.pp * 2.6 + c.tp * 1.1
            y = (grid.dp - 1 - c.dp) * 0.9
            box(ax, x, y, 1.0, 0.75, f"rank {rank}\n(pp{c.pp} dp{c.dp} tp{c.tp})", color[rank], fontsize=8)
        for stage in range(grid.pp):
            ax.text(stage * 2.6 + 1.05, 1.8, f"pipeline stage {stage}", ha="center", fontsize=9)
        ax.set_xlim(-0.2, 5.0)
        ax.set_ylim(-0.2, 2.1)
        ax.set_title(title + "\n" + ", ".join(str(g) for g in groups), fontsize=9)
        ax.axis("off")
    fig.suptitle("8 ranks as pp = 2 x dp = 2 x tp = 2 (lslm's RankGrid: rank = 4·pp + 2·dp + tp)", fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "09_3d_layout.png")


if __name__ == "__main__":
    main()
