"""Draw the course's diagrams (run `python images/make_images.py`; PNGs are committed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

HERE = Path(__file__).resolve().parent


def _box(ax, x, y, w, h, text, color, fontsize=10):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black", lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def torchrun_ranks(path: Path) -> None:
    """Two nodes, one torchrun agent each, two workers each: global, local and node ranks."""
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=100)
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 5)
    ax.axis("off")
    for node in range(2):
        x0 = 0.3 + node * 5
        _box(ax, x0, 0.3, 4.4, 4.0, "", "#eef3fb")
        ax.text(x0 + 2.2, 4.0, f"node {node}  (GROUP_RANK={node})", ha="center", fontsize=11, weight="bold")
        _box(ax, x0 + 0.7, 2.8, 3.0, 0.7, "torchrun agent\n(rendezvous, monitors workers)", "#ffe9c7", 9)
        for local in range(2):
            rank = node * 2 + local
            _box(ax, x0 + 0.3 + local * 2.0, 0.7, 1.8, 1.5,
                 f"worker\nRANK={rank}\nLOCAL_RANK={local}\ncuda:{local} or CPU", "#d9f2d9", 9)
            ax.annotate("", xy=(x0 + 1.2 + local * 2.0, 2.2), xytext=(x0 + 2.2, 2.8),
                        arrowprops={"arrowstyle": "->", "lw": 1})
    ax.annotate("", xy=(5.3, 3.15), xytext=(4.4, 3.15), arrowprops={"arrowstyle": "<->", "lw": 1.5, "ls": "--"})
    ax.text(4.85, 3.5, "c10d\nrendezvous", ha="center", fontsize=8)
    ax.set_title("torchrun --nnodes=2 --nproc-per-node=2: WORLD_SIZE=4, LOCAL_WORLD_SIZE=2", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    torchrun_ranks(HERE / "torchrun_ranks.png")
    print("wrote", HERE / "torchrun_ranks.png")
