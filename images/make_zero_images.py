"""Draw notebook 08's diagram (run `python images/make_zero_images.py`; the PNG is committed).

``08_zero_stages.png``, two panels:

* top: what each of N = 4 data-parallel ranks keeps of the model states in DDP and ZeRO stages 1, 2 and 3
  (Rajbhandari et al. 2020, Figure 1): parameters (2 bytes per parameter), gradients (2) and optimizer states
  (K = 12: fp32 masters and Adam's two moments), drawn whole where replicated and as the rank's quarter where
  partitioned, with the bytes per rank of each row;
* bottom: one training step of stage 3 with four units (blocks): each unit's all-gather just before its forward
  (the next one's prefetched meanwhile), freed after it, gathered again for its backward, its gradients
  reduce-scattered and the unit freed. A schematic of the order, not a measurement (the notebook plots the
  measured one).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
BLUE, ORANGE, GREEN, GREY, RED = "#8ecae6", "#ffb703", "#90be6d", "#e9ecef", "#f28482"
N = 4
PARTS = (("parameters (2Ψ)", 2, BLUE), ("gradients (2Ψ)", 2, ORANGE), ("optimizer states (KΨ, K = 12)", 12, GREEN))
ROWS = (("DDP", (False, False, False), "(2 + 2 + K)Ψ = 16Ψ"),
        ("ZeRO-1: P_os", (False, False, True), "2Ψ + 2Ψ + KΨ/N = 7Ψ"),
        ("ZeRO-2: P_os+g", (False, True, True), "2Ψ + (2 + K)Ψ/N = 5.5Ψ"),
        ("ZeRO-3: P_os+g+p", (True, True, True), "(2 + 2 + K)Ψ/N = 4Ψ"))


def _stages(ax: plt.Axes) -> None:
    total = sum(w for _, w, _ in PARTS)
    y = 0.0
    ticks, labels = [], []
    for name, parted, formula in ROWS[::-1]:
        for r in range(N):
            x = 0.0
            for (_, w, color), split in zip(PARTS, parted):
                ax.add_patch(Rectangle((x, y), w, 0.8, fc="white", ec="#adb5bd", lw=0.5))
                if split:
                    ax.add_patch(Rectangle((x + r * w / N, y), w / N, 0.8, fc=color, ec="black", lw=0.6))
                else:
                    ax.add_patch(Rectangle((x, y), w, 0.8, fc=color, ec="black", lw=0.6))
                x += w
            ax.text(-0.2, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=7)
            y += 1
        ticks.append(y - N / 2 - 0.1)
        labels.append(name)
        ax.text(total + 0.3, y - N / 2 - 0.1, formula + " per rank", va="center", fontsize=8.5)
        y += 0.8
    ax.set_yticks(ticks, labels, fontsize=9)
    ax.tick_params(axis="y", pad=42, length=0)
    ax.set_xlim(-0.2, total + 6.5)
    ax.set_ylim(-0.3, y)
    ax.set_xticks(range(0, total + 1, 2), [f"{v}Ψ" for v in range(0, total + 1, 2)], fontsize=8)
    ax.set_xlabel("bytes of model states, fp16 mixed precision with Adam (Ψ parameters)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=[Patch(fc=c, ec="black", label=n) for n, _, c in PARTS] +
              [Patch(fc="white", ec="#adb5bd", label="held by the other ranks")], fontsize=8, loc="upper center",
              bbox_to_anchor=(0.45, -0.16), ncol=4, frameon=False)
    ax.set_title(f"What each of N = {N} data-parallel ranks keeps (ZeRO, Rajbhandari et al. 2020)", fontsize=10,
                 loc="left")


def _timeline(ax: plt.Axes) -> None:
    units = 4
    lanes = {"all-gather": 2, "compute": 1, "reduce-scatter": 0}
    colors = [BLUE, ORANGE, GREEN, RED]
    t = 0.0
    ag = 0.55  # an all-gather takes less than a unit's compute here; prefetch hides it behind the previous unit

    def bar(lane: str, start: float, width: float, text: str, color: str) -> None:
        ax.add_patch(Rectangle((start, lanes[lane] + 0.15), width, 0.7, fc=color, ec="black", lw=0.6))
        ax.text(start + width / 2, lanes[lane] + 0.5, text, ha="center", va="center", fontsize=7)

    # forward: unit 0 gathered, then each unit's forward while the next is gathered
    bar("all-gather", t, ag, "AG U0", colors[0])
    t += ag
    for u in range(units):
        if u + 1 < units:
            bar("all-gather", t, ag, f"AG U{u + 1}", colors[u + 1])
        bar("compute", t, 1.0, f"fwd U{u}", colors[u])
        ax.text(t + 1.0, lanes["compute"] + 0.95, "free", fontsize=6, ha="right", color="#6c757d")
        t += 1.0
    # backward: last unit gathered again (the gradient of its output triggers it), the previous one prefetched
    bar("all-gather", t, ag, f"AG U{units - 1}", colors[units - 1])
    t += ag
    for u in range(units - 1, -1, -1):
        if u > 0:
            bar("all-gather", t, ag, f"AG U{u - 1}", colors[u - 1])
        bar("compute", t, 2.0, f"bwd U{u}", colors[u])
        bar("reduce-scatter", t + 2.0, 0.6, f"RS U{u}", colors[u])
        ax.text(t + 2.0, lanes["compute"] + 0.95, "free", fontsize=6, ha="right", color="#6c757d")
        t += 2.0
    bar("compute", t + 0.6, 0.8, "step\n(slice)", GREY)
    ax.set_xlim(-0.1, t + 1.6)
    ax.set_ylim(-0.1, 3.1)
    ax.set_yticks([v + 0.5 for v in lanes.values()], list(lanes), fontsize=9)
    ax.set_xticks([])
    ax.set_xlabel("time in one step (schematic; the root, embeddings and head, stays gathered all step)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title("ZeRO-3, one step: each unit gathered before its forward and again before its backward (the next "
                 "one prefetched),\nfreed after use; its gradients reduce-scattered: 2Ψ gathered + Ψ reduce-scattered "
                 "= 3Ψ moved per step", fontsize=10, loc="left")


def main() -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 9.5), dpi=90, gridspec_kw={"height_ratios": [2.3, 1]})
    _stages(top)
    _timeline(bottom)
    fig.tight_layout()
    fig.savefig(HERE / "08_zero_stages.png")
    plt.close(fig)


if __name__ == "__main__":
    main()
