"""Draw the course's diagrams (run `python images/make_images.py`; PNGs are committed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from diagram import box  # noqa: E402  (images/diagram.py)
from matplotlib.patches import FancyBboxPatch  # noqa: E402

HERE = Path(__file__).resolve().parent


def _box(ax, x, y, w, h, text, color, fontsize=10):
    box(ax, x, y, w, h, text, color, fontsize, lw=1)


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


COLORS = ["#8ecae6", "#ffb703", "#90be6d", "#f28482"]


def _rank_column(ax, x, cells, title):
    """Draw one column of 4 ranks; each rank holds a list of (label, color) cells."""
    ax.text(x + 0.9, 4.35, title, ha="center", fontsize=8, style="italic")
    for r, row in enumerate(cells):
        y = 3.3 - r * 1.0
        ax.text(x - 0.15, y + 0.35, f"r{r}", ha="right", va="center", fontsize=8)
        width = 1.8 / max(1, len(row))
        for i, (label, color) in enumerate(row):
            ax.add_patch(FancyBboxPatch((x + i * width, y), width * 0.92, 0.7, boxstyle="round,pad=0.01",
                                        fc=color, ec="black", lw=0.6))
            ax.text(x + i * width + width * 0.46, y + 0.35, label, ha="center", va="center", fontsize=7)


def collectives_overview(path: Path) -> None:
    """Before/after contents of 4 ranks for each of the eight collectives."""
    n = 4
    c = COLORS
    whole = [[(f"x{r}", c[r])] for r in range(n)]
    chunks = [[(f"x{r}{j}", c[r]) for j in range(n)] for r in range(n)]
    empty = [[("", "white")] for _ in range(n)]
    total = ("Σx", "#cdb4db")
    panels = {
        "broadcast (root r0)": (whole[:1] + empty[1:], [[("x0", c[0])]] * n),
        "scatter (root r0)": ([[(f"x0{j}", c[0]) for j in range(n)]] + empty[1:],
                              [[(f"x0{r}", c[0])] for r in range(n)]),
        "gather (root r0)": (whole, [[(f"x{j}", c[j]) for j in range(n)]] + empty[1:]),
        "reduce (root r0)": (whole, [[total]] + empty[1:]),
        "all-gather": (whole, [[(f"x{j}", c[j]) for j in range(n)]] * n),
        "reduce-scatter": (chunks, [[(f"Σx·{r}", "#cdb4db")] for r in range(n)]),
        "all-reduce": (whole, [[total]] * n),
        "all-to-all": (chunks, [[(f"x{j}{r}", c[j]) for j in range(n)] for r in range(n)]),
    }
    fig, axes = plt.subplots(2, 4, figsize=(13, 5.4), dpi=100)
    for ax, (name, (before, after)) in zip(axes.flat, panels.items()):
        ax.set_xlim(-0.5, 4.6)
        ax.set_ylim(-0.4, 4.7)
        ax.axis("off")
        _rank_column(ax, 0.1, before, "before")
        _rank_column(ax, 2.6, after, "after")
        ax.annotate("", xy=(2.5, 2.0), xytext=(2.0, 2.0), arrowprops={"arrowstyle": "->", "lw": 1.2})
        ax.set_title(name, fontsize=10, weight="bold")
    fig.suptitle("The eight collectives on 4 ranks "
                 "(xij: chunk j of rank i's data; Σx: sum over ranks; Σx·j: its chunk j)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    torchrun_ranks(HERE / "torchrun_ranks.png")
    collectives_overview(HERE / "collectives.png")
    print("wrote", HERE / "torchrun_ranks.png", HERE / "collectives.png")
