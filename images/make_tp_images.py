"""Draw notebook 05's diagram (run `python images/make_tp_images.py`; the PNG is committed).

``05_tp_layout.png``, two panels, t = 2:

* top: Megatron's MLP (Shoeybi et al. 2019, Figure 3a): ``f`` before the column-parallel ``A``, GeLU on each
  rank's columns, the row-parallel ``B``, ``g`` summing the partial outputs; what ``f`` and ``g`` do forward and
  backward.
* bottom: a transformer layer with sequence parallelism (Korthikanti et al. 2022, Figure 5): LayerNorm, dropout
  and the residual on ``s/t`` of the sequence, an all-gather along the sequence before each column-parallel layer,
  a reduce-scatter after each row-parallel one, and the shapes each rank holds (sequence-first, as lslm's GPT).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from diagram import arrow as _arrow  # noqa: E402  (images/diagram.py)
from diagram import box as _box

HERE = Path(__file__).resolve().parent
BLUE, ORANGE, GREEN, RED, GREY, PURPLE = "#8ecae6", "#ffb703", "#90be6d", "#f28482", "#e9ecef", "#cdb4db"
RANK = (BLUE, ORANGE)


def _mlp(ax: plt.Axes) -> None:
    """Megatron's column-then-row MLP on 2 ranks, f and g placed."""
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 4.6)
    ax.axis("off")
    _box(ax, 0.1, 1.75, 1.1, 1.0, "X\n(b, s, h)\nwhole", GREY, 8)
    _box(ax, 1.55, 1.55, 0.7, 1.4, "f", GREEN, 12)
    _arrow(ax, (1.55, 2.25), (1.2, 2.25))
    for r, y in enumerate((3.0, 0.5)):
        col = RANK[r]
        _box(ax, 2.8, y, 1.6, 0.9, f"X $A_{r + 1}$\n$A_{r + 1}$: columns\n(h, 4h/t)", col, 8)
        _box(ax, 4.8, y, 1.3, 0.9, f"GeLU\n$Y_{r + 1}$ (b, s, 4h/t)", col, 8)
        _box(ax, 6.5, y, 1.6, 0.9, f"$Y_{r + 1} B_{r + 1}$\n$B_{r + 1}$: rows\n(4h/t, h)", col, 8)
        ax.text(7.3, y - 0.22 if r else y + 1.02, f"partial $Z_{r + 1}$ (b, s, h)", ha="center", fontsize=7,
                va="top" if r else "bottom")
        _arrow(ax, (2.8, y + 0.45), (2.25, 2.25))
        _arrow(ax, (4.8, y + 0.45), (4.4, y + 0.45))
        _arrow(ax, (6.5, y + 0.45), (6.1, y + 0.45))
        _arrow(ax, (8.6, 2.25), (8.1, y + 0.45))
        ax.text(0.1, y + 0.45, f"rank {r}", fontsize=8, color="black", va="center", fontweight="bold")
    _box(ax, 8.6, 1.55, 0.7, 1.4, "g", RED, 12)
    _box(ax, 9.7, 1.75, 1.4, 1.0, "Z = $Z_1 + Z_2$\ndropout\n(b, s, h) whole", GREY, 8)
    _arrow(ax, (9.7, 2.25), (9.3, 2.25))
    ax.text(1.9, 1.35, "f: forward identity\nbackward all-reduce", ha="center", va="top", fontsize=7.5)
    ax.text(8.95, 1.35, "g: forward all-reduce\nbackward identity", ha="center", va="top", fontsize=7.5)
    ax.text(5.45, 2.25, "no communication\nbetween A and B:\nGeLU acts element-wise", ha="center", va="center",
            fontsize=7.5, style="italic")
    ax.set_title("Tensor parallelism (Megatron): the MLP split column then row, one all-reduce each way "
                 "(attention the same, by heads)", fontsize=10, loc="left")


def _sequence_parallel(ax: plt.Axes) -> None:
    """One transformer layer with sequence parallelism: where the sequence is split, gathered and scattered."""
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 3.2)
    ax.axis("off")
    # regions: (x, width, label, fill, shape per rank, split along the sequence?)
    regions = [
        (0.1, 1.7, "LayerNorm\n(+ dropout, residual\nof the layer before)", PURPLE, "(s/t, b, h)", True),
        (2.3, 0.9, "all-\ngather\nalong s", GREEN, "", False),
        (3.7, 2.3, "attention or MLP:\ncolumn-parallel, then\nrow-parallel layer", GREY, "input (s, b, h):\n"
         "the whole sequence", False),
        (6.5, 0.9, "reduce-\nscatter\nalong s", RED, "", False),
        (7.9, 1.9, "dropout + residual,\nnext LayerNorm", PURPLE, "(s/t, b, h)", True),
    ]
    for x, w, label, fill, shape, split in regions:
        _box(ax, x, 1.3, w, 1.2, label, fill, 8)
        if shape:
            ax.text(x + w / 2, 1.15, shape, ha="center", va="top", fontsize=7.5)
        if split:  # the sequence cut in t pieces: each rank one (rank 0 top)
            for r in range(2):
                ax.add_patch(plt.Rectangle((x + 0.1 + 0.2 * r, 2.6), 0.18, 0.35, fc=RANK[r], ec="black", lw=0.5))
            ax.text(x + 0.55, 2.78, "rank 0 | rank 1: s/t rows each", fontsize=7, va="center")
    for x0, x1 in ((1.8, 2.3), (3.2, 3.7), (6.0, 6.5), (7.4, 7.9)):
        _arrow(ax, (x1, 1.9), (x0, 1.9))
    ax.text(2.75, 0.55, "forward all-gather,\nbackward reduce-scatter\n(replaces f)", ha="center", fontsize=7.5)
    ax.text(6.95, 0.55, "forward reduce-scatter,\nbackward all-gather\n(replaces g)", ha="center", fontsize=7.5)
    ax.text(10.0, 2.3, "an all-gather + a reduce-scatter\nsend what one all-reduce sends:\n"
            "2 (t-1)/t of (s, b, h) per rank.\n\nAttention still sees the whole\n"
            "sequence: this is not context\nparallelism (which splits attention\nitself, e.g. ring attention).",
            fontsize=7.5, va="top")
    ax.set_title("Sequence parallelism (Korthikanti et al. 2022): LayerNorm and dropout on s/t of the sequence",
                 fontsize=10, loc="left")


def layout(path: Path) -> None:
    """Both panels in one figure."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.6), dpi=90, gridspec_kw={"height_ratios": [4.6, 3.2]})
    _mlp(top)
    _sequence_parallel(bottom)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    """Write the PNG next to this script."""
    layout(HERE / "05_tp_layout.png")


if __name__ == "__main__":
    main()
