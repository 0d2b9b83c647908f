"""Draw notebook 04b's picture of the step-time model (run `python images/make_step_time_images.py`; PNG committed).

* ``04b_buckets_channel.png``: buckets become ready while backward runs (bucket k at T_b C_k / G) and
  one communication channel all-reduces them in order, each from max(ready, previous end); whatever
  is still on the channel when backward ends is exposed. Two backward lengths for the same buckets:
  long enough that only the last bucket shows, and shorter than the all-reduces together
  (communication-bound). The times are the model's (lslm.metrics.step_time) for illustrative
  constants, not a measurement; notebook 04b measures the real ones.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lslm.metrics.step_time import LinkCost, exposed_comm_s, ring_all_reduce_s  # noqa: E402

HERE = Path(__file__).resolve().parent
BUCKETS = [4e6, 4e6, 4e6, 4e6]  # bytes, in the order backward fills them
N = 2
LINK = LinkCost(alpha_s=100e-6, beta_s_per_byte=1e-9)  # illustrative: 100 us per message, 1 GB/s
COLOURS = ["#8ecae6", "#ffb703", "#90be6d", "#f28482"]
EXPOSED = "#c1121f"


def schedule(backward_s: float) -> list[tuple[float, float, float]]:
    """``(ready, start, end)`` of every bucket's all-reduce under the model (seconds)."""
    total, done, end, out = sum(BUCKETS), 0.0, 0.0, []
    for size in BUCKETS:
        done += size
        ready = backward_s * done / total
        start = max(ready, end)
        end = start + ring_all_reduce_s(size, N, LINK)
        out.append((ready, start, end))
    return out


def panel(ax: plt.Axes, backward_s: float, title: str) -> None:
    ms = 1e3
    rows = schedule(backward_s)
    exposed = exposed_comm_s(BUCKETS, N, LINK, backward_s)
    prev = 0.0
    for k, ((ready, start, end), colour) in enumerate(zip(rows, COLOURS)):
        ax.barh(1, (ready - prev) * ms, left=prev * ms, height=0.5, color=colour, edgecolor="black", lw=0.6)
        ax.text((prev + ready) / 2 * ms, 1, f"grads of\nbucket {k}", ha="center", va="center", fontsize=7)
        ax.barh(0, (end - start) * ms, left=start * ms, height=0.5, color=colour, edgecolor="black", lw=0.6)
        ax.text((start + end) / 2 * ms, 0, f"all-reduce {k}", ha="center", va="center", fontsize=7)
        ax.plot([ready * ms], [0.32], marker="v", color="black", ms=5)  # the bucket is ready here
        prev = ready
    ax.axvline(backward_s * ms, color="black", ls="--", lw=1)
    ax.axvspan(backward_s * ms, rows[-1][2] * ms, ymin=0.08, ymax=0.42, color=EXPOSED, alpha=0.15, lw=0, zorder=0)
    ax.annotate("", xy=(rows[-1][2] * ms, -0.42), xytext=(backward_s * ms, -0.42),
                arrowprops={"arrowstyle": "<->", "color": EXPOSED})
    ax.text((backward_s + rows[-1][2]) / 2 * ms, -0.62, f"exposed E = {exposed * ms:.1f} ms",
            ha="center", va="top", color=EXPOSED, fontsize=8)
    ax.text(backward_s * ms, 1.42, " backward ends ($T_b$)", fontsize=8, va="center")
    comm = sum(end - start for _, start, end in rows)
    ax.set(yticks=[0, 1], yticklabels=["communication\nchannel (one)", "backward\n(compute)"],
           ylim=(-1.0, 1.65), xlim=(0, max(rows[-1][2], backward_s) * ms * 1.04),
           xlabel="time since backward started (ms)",
           title=f"{title}: $T_b$ = {backward_s * ms:g} ms, all-reduces together W = {comm * ms:.1f} ms")
    ax.title.set_fontsize(10)


def buckets_channel(path: Path) -> None:
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 5.6), dpi=100)
    panel(a, 0.030, "backward longer than the communication: only the last bucket is exposed")
    panel(b, 0.008, "communication-bound (W > $T_b$): the channel falls behind")
    fig.suptitle(f"Bucketed DDP in the step-time model: {len(BUCKETS)} buckets of {BUCKETS[0] / 1e6:g} MB, "
                 f"n = {N}, $\\alpha$ = {LINK.alpha_s * 1e6:g} µs, 1/$\\beta$ = {1 / LINK.beta_s_per_byte / 1e9:g} "
                 "GB/s (illustrative); ▼ = bucket ready", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    buckets_channel(HERE / "04b_buckets_channel.png")
