"""Draw notebook 04's diagrams (run `python images/make_ddp_images.py`; PNGs are committed).

* ``04_ddp_overview.png``: every rank a full replica, its own share of the batch,
  gradients averaged by all-reduce, identical optimizer steps.
* ``04_overlap.png``: when to all-reduce: after backward (naive, fused) vs bucketed
  all-reduces launched during backward (schematic, not measured; the notebook
  measures the real one).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from diagram import arrow as _arrow  # noqa: E402  (images/diagram.py)
from diagram import box as _box

HERE = Path(__file__).resolve().parent
BLUE, ORANGE, GREEN, RED, GREY = "#8ecae6", "#ffb703", "#90be6d", "#f28482", "#e9ecef"


def overview(path: Path) -> None:
    """Two ranks: sampler shares, replicas, local gradients, all-reduce (mean), same update."""
    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=100)
    ax.set_xlim(0, 10)
    ax.set_ylim(0.5, 5.2)
    ax.axis("off")
    # the global batch
    for i in range(8):
        _box(ax, 0.2 + i * 0.32, 4.55, 0.28, 0.4, str(i), BLUE if i % 2 == 0 else ORANGE, 7)
    ax.text(1.5, 5.08, "global batch i (8 rows, the serial run's batch)", ha="center", fontsize=8)
    for r, (y, col) in enumerate(((2.9, BLUE), (0.7, ORANGE))):
        rows = ", ".join(str(k) for k in range(r, 8, 2))
        _box(ax, 0.2, y, 2.4, 0.9, f"DistributedSampler\nrank {r} takes rows {rows}", col, 8)
        if r == 0:
            _arrow(ax, (1.4, y + 0.9), (1.4, 4.5))
        else:  # around the left side, past rank 0's sampler
            ax.plot([0.66, 0.66, 0.08, 0.08], [4.55, 4.3, 4.3, y + 0.45], color="black", lw=1)
            _arrow(ax, (0.2, y + 0.45), (0.08, y + 0.45))
        _box(ax, 3.1, y, 2.0, 0.9, "full model replica\nforward + backward", GREY, 8)
        _arrow(ax, (3.1, y + 0.45), (2.6, y + 0.45))
        _box(ax, 5.6, y, 1.4, 0.9, f"local grads\n$g_{r}$", col, 9)
        _arrow(ax, (5.6, y + 0.45), (5.1, y + 0.45))
        _box(ax, 8.4, y, 1.4, 0.9, "AdamW step\n(identical)", GREEN, 8)
    _box(ax, 7.25, 1.2, 0.9, 2.9, "all-reduce\n(sum, ÷ n)\n\n$\\frac{g_0+g_1}{2}$", RED, 10)
    for y in (2.9, 0.7):
        _arrow(ax, (7.25, y + 0.45), (7.0, y + 0.45))
        _arrow(ax, (8.4, y + 0.45), (8.15, y + 0.45))
    ax.set_title("Distributed data parallel: each rank a full replica and a share of the batch; "
                 "gradients averaged, so every replica takes the same step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def overlap(path: Path) -> None:
    """Schematic timelines: all-reduce after backward vs bucket all-reduces during backward."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.8), dpi=100, sharex=True)
    layers = ["L4", "L3", "L2", "L1"]
    for ax, mode in zip(axes, ("after", "overlap")):
        ax.set_ylim(0, 2)
        ax.set_yticks([1.4, 0.5], ["compute", "network"])
        ax.barh(1.4, 2, left=0, height=0.6, color=BLUE, ec="black", lw=0.6)
        ax.text(1, 1.4, "forward", ha="center", va="center", fontsize=8)
        for i, name in enumerate(layers):
            ax.barh(1.4, 1, left=2 + i, height=0.6, color="#219ebc", ec="black", lw=0.6)
            ax.text(2.5 + i, 1.4, f"bwd {name}", ha="center", va="center", fontsize=8, color="white")
        if mode == "after":
            ax.barh(0.5, 3.2, left=6, height=0.6, color=RED, ec="black", lw=0.6)
            ax.text(7.6, 0.5, "all-reduce all gradients", ha="center", va="center", fontsize=8)
            end = 9.2
            ax.set_title("naive / fused: communicate after backward, nothing overlaps", fontsize=9, loc="left")
        else:
            # buckets: b0 = {L4, L3} ready at t=4, b1 = {L2, L1} ready at t=6
            ax.barh(0.5, 1.6, left=4, height=0.6, color=RED, ec="black", lw=0.6)
            ax.text(4.8, 0.5, "bucket 0 (L4, L3)", ha="center", va="center", fontsize=7)
            ax.barh(0.5, 1.6, left=6, height=0.6, color=RED, ec="black", lw=0.6)
            ax.text(6.8, 0.5, "bucket 1 (L2, L1)", ha="center", va="center", fontsize=7)
            for t in (4, 6):
                ax.axvline(t, color="black", lw=0.6, ls=":")
            end = 7.6
            ax.set_title("bucketed: a bucket's all-reduce starts as soon as its last gradient is ready; "
                         "only the tail is exposed", fontsize=9, loc="left")
        ax.barh(1.4, 0.8, left=end, height=0.6, color=GREEN, ec="black", lw=0.6)
        ax.text(end + 0.4, 1.4, "opt", ha="center", va="center", fontsize=8)
        ax.axvline(end + 0.8, color="black", lw=1.2)
        ax.text(end + 0.85, 1.85, "step ends", fontsize=7, va="top")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel("time (schematic units)")
    axes[-1].set_xlim(0, 10.8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    """Write both PNGs next to this script."""
    overview(HERE / "04_ddp_overview.png")
    overlap(HERE / "04_overlap.png")


if __name__ == "__main__":
    main()
