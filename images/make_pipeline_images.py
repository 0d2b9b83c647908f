"""Draw notebook 06's diagrams (run `PYTHONPATH=. python images/make_pipeline_images.py`; PNGs are committed).

* ``06_schedule_legend.png``: how every pipeline timeline in the course is drawn: compute bars F, B, I, W in
  the colours of :data:`lslm.plot.pipeline.KIND_COLORS`, and the thin send / receive bars under a rank's row,
  on a two-rank example of one micro-batch.
* ``06_dualpipev_v.png``: where the virtual stages live: interleaved 1F1B's loop (rank r holds stages r and
  r + p) next to DualPipeV's V (rank r holds stages r and 2p - 1 - r), p = 4.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from lslm.plot.pipeline import KIND_COLORS  # noqa: E402  (one palette for diagrams and measured timelines)

HERE = Path(__file__).resolve().parent


def _bar(ax, rank: int, start: float, length: float, kind: str, text: str) -> None:
    ax.barh(rank, length, left=start, height=0.7, color=KIND_COLORS[kind], edgecolor="black", linewidth=0.6)
    ax.text(start + length / 2, rank, text, ha="center", va="center", fontsize=9)


def _comm(ax, rank: int, start: float, length: float, kind: str, text: str) -> None:
    ax.barh(rank + 0.42, length, left=start, height=0.12, color=KIND_COLORS[kind])
    ax.text(start + length / 2, rank + 0.62, text, ha="center", va="top", fontsize=7)


def schedule_legend(path: Path) -> None:
    """One micro-batch through two stages, backward split into I and W on stage 0."""
    fig, ax = plt.subplots(figsize=(9, 2.9), dpi=100)
    _bar(ax, 0, 0.0, 1.0, "F", "F0\n(stage 0)")
    _comm(ax, 0, 1.0, 0.35, "SEND_F", "send")
    _comm(ax, 1, 1.0, 0.35, "RECV_F", "receive")
    _bar(ax, 1, 1.35, 1.0, "F", "F0 + loss")
    _bar(ax, 1, 2.35, 2.0, "B", "B0 = I0 + W0")
    _comm(ax, 1, 4.35, 0.35, "SEND_B", "send grad")
    _comm(ax, 0, 4.35, 0.35, "RECV_B", "receive")
    _bar(ax, 0, 4.7, 1.0, "I", "I0\ninput grad")
    _bar(ax, 0, 5.7, 1.0, "W", "W0\nweight grad")
    ax.annotate("", xy=(1.35, 0.75), xytext=(1.0, 0.3), arrowprops={"arrowstyle": "->", "lw": 1})
    ax.annotate("", xy=(4.7, 0.3), xytext=(4.35, 0.75), arrowprops={"arrowstyle": "->", "lw": 1})
    ax.set_yticks([0, 1], ["rank 0", "rank 1"])
    ax.set_ylim(1.8, -0.6)
    ax.set_xlim(-0.1, 7.0)
    ax.set_xlabel("time (cost units: F = 1, B = 2 = I + W; a message 0.35 here)")
    ax.set_ylabel("pipeline rank")
    ax.set_title("How lslm draws a pipeline timeline: compute bars, and thin message bars under the row")
    labels = {"F": "F forward", "B": "B full backward", "I": "I input gradient", "W": "W weight gradient",
              "SEND_F": "send (activation or gradient)", "RECV_F": "receive"}
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=v) for k, v in labels.items()], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _placement(ax, p: int, rank_of, title: str, note: str) -> None:
    stages = 2 * p
    xs = list(range(stages))
    ys = [rank_of(s) for s in xs]
    ax.plot(xs, ys, "-", color="#888888", lw=1.2, zorder=1)
    for s, r in zip(xs, ys):
        color = KIND_COLORS["F"] if s < p else KIND_COLORS["B"]
        ax.scatter([s], [r], s=520, color=color, edgecolor="black", zorder=2)
        ax.text(s, r, f"s{s}", ha="center", va="center", fontsize=8, zorder=3)
    ax.text(0, rank_of(0) - 0.45, "embedding", ha="center", fontsize=8)
    ax.text(stages - 1, rank_of(stages - 1) - 0.45, "head + loss", ha="center", fontsize=8)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.4, -0.9)
    ax.set_xticks(xs)
    ax.set_xlabel("virtual stage (model order: layers 0 .. L-1 left to right)")
    ax.set_ylabel("pipeline rank holding it")
    ax.set_title(title, fontsize=10)
    ax.text(0.5, -0.32, note, transform=ax.transAxes, ha="center", va="top", fontsize=8)


def dualpipev_v(path: Path, p: int = 4) -> None:
    """Interleaved's loop and DualPipeV's V: which rank holds each of the 2p virtual stages."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    _placement(left, p, lambda s: s % p, f"interleaved 1F1B, p={p}, v=2: rank r holds s_r and s_(r+p)",
               "a micro-batch loops through the ranks twice;\nembedding and head on different ranks")
    _placement(right, p, lambda s: s if s < p else 2 * p - 1 - s,
               f"DualPipeV, p={p}: rank r holds s_r and s_(2p-1-r)",
               f"down the ranks and back up: a V; s{p - 1} to s{p} stays on rank {p - 1} (no message);\n"
               "embedding and head both on rank 0")
    fig.suptitle("Two virtual stages per rank, placed two ways (first chunk light, second dark)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    """Write both PNGs next to this script."""
    schedule_legend(HERE / "06_schedule_legend.png")
    dualpipev_v(HERE / "06_dualpipev_v.png")


if __name__ == "__main__":
    main()
