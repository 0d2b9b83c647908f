"""Draw notebook 03's diagrams (run `python images/make_dp_images.py`; PNGs are committed).

* ``03_dp_algorithm.png``: one DataParallel step on three devices, forward
  (scatter, replicate, parallel_apply, gather) and backward (scatter of the output
  gradient, backward per replica, reduce-add onto device 0).
* ``03_dp_vs_allreduce.png``: parameter/gradient traffic per step - a star around
  device 0 for DataParallel, a ring for all-reduce.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from diagram import arrow, box  # noqa: E402  (images/diagram.py)

HERE = Path(__file__).resolve().parent
DEVICE_COLORS = ["#8ecae6", "#ffb703", "#90be6d"]
N = 3


def _box(ax, x, y, w, h, text, color, fontsize=8):
    box(ax, x, y, w, h, text, color, fontsize)


def _arrow(ax, x0, y0, x1, y1, color="black"):
    arrow(ax, (x1, y1), (x0, y0), color=color)


def _panel(ax, title, columns, cells, links):
    """``cells[(col, dev)] = text``; ``links``: (col, dev) -> (col, dev) arrows (copies between devices)."""
    w, h, dx, dy = 1.7, 0.62, 2.25, 0.95
    ax.set_xlim(-1.0, dx * len(columns) - 0.3)
    ax.set_ylim(-0.35, dy * N + 0.55)
    ax.axis("off")
    ax.set_title(title, fontsize=11, loc="left")
    for c, name in enumerate(columns):
        ax.text(c * dx + w / 2, dy * N + 0.2, name, ha="center", fontsize=8.5, weight="bold")
    for d in range(N):
        y = dy * (N - 1 - d)
        ax.text(-0.15, y + h / 2, f"device {d}", ha="right", va="center", fontsize=8.5)
    for (c, d), text in cells.items():
        _box(ax, c * dx, dy * (N - 1 - d), w, h, text, DEVICE_COLORS[d])
    for (c0, d0), (c1, d1) in links:
        _arrow(ax, c0 * dx + w, dy * (N - 1 - d0) + h / 2, c1 * dx, dy * (N - 1 - d1) + h / 2,
               "black" if d0 == d1 else "#c1121f")


def dp_algorithm(path: Path) -> None:
    """Forward and backward of one DataParallel step, three devices, output device 0."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.4), dpi=100)
    fwd_cells = {(0, 0): "batch x (B rows)\nmodule W"}
    fwd_cells.update({(1, d): f"x_{d}: rows of x" + ("\n(a view)" if d == 0 else "\n(copied)") for d in range(N)})
    fwd_cells.update({(2, d): "W itself" if d == 0 else f"W_{d}: W copied\nfrom device 0" for d in range(N)})
    fwd_cells.update({(3, d): f"thread {d}:\ny_{d} = f(x_{d}; W_{d})" for d in range(N)})
    fwd_cells[(4, 0)] = "y: all B rows\n(B x T x V logits!)"
    fwd_links = [((0, 0), (1, d)) for d in range(N)] + [((1, d), (2, d)) for d in range(N)]
    fwd_links += [((2, d), (3, d)) for d in range(N)] + [((3, d), (4, 0)) for d in range(N)]
    _panel(top, "Forward  (every step: nothing persists on devices 1..n-1)",
           ["input", "1. scatter", "2. replicate", "3. parallel_apply", "4. gather"], fwd_cells, fwd_links)
    bwd_cells = {(0, 0): "loss, dL/dy\n(B rows)"}
    bwd_cells.update({(1, d): f"dL/dy_{d}" for d in range(N)})
    bwd_cells.update({(2, d): f"thread {d} (autograd):\ndL/dW_{d}" for d in range(N)})
    bwd_cells[(3, 0)] = "W.grad = sum over d\nof dL/dW_d"
    bwd_cells[(4, 0)] = "optimizer step\non device 0 only"
    bwd_links = [((0, 0), (1, d)) for d in range(N)] + [((1, d), (2, d)) for d in range(N)]
    bwd_links += [((2, d), (3, 0)) for d in range(N)] + [((3, 0), (4, 0))]
    _panel(bottom, "Backward  (autograd runs the copies in reverse)",
           ["output gradient", "5. scatter grads", "6. backward", "7. reduce-add", "8. update"], bwd_cells,
           bwd_links)
    fig.text(0.5, 0.01, "red arrows: copies between devices (counted by the ledger); black: stays on the device",
             ha="center", fontsize=8.5)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def dp_vs_allreduce(path: Path, n: int = 4) -> None:
    """Star (DataParallel: broadcast W, reduce grads at device 0) versus ring all-reduce."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), dpi=100)
    angles = [math.pi / 2 - 2 * math.pi * i / n for i in range(n)]
    pos = [(math.cos(a), math.sin(a)) for a in angles]
    colors = DEVICE_COLORS + ["#f28482"]
    for ax in axes:
        ax.set_xlim(-1.6, 1.6)
        ax.set_ylim(-1.6, 1.6)
        ax.set_aspect("equal")
        ax.axis("off")
    star, ring = axes
    star_pos = [(0.0, 0.0)] + [(1.15 * math.cos(a), 1.15 * math.sin(a))
                               for a in (math.pi / 2 + 2 * math.pi * k / (n - 1) for k in range(n - 1))]
    for i in range(1, n):
        (x0, y0), (x1, y1) = star_pos[0], star_pos[i]
        star.annotate("", xy=(x1 * 0.78, y1 * 0.78), xytext=(x0 + 0.25 * x1, y0 + 0.25 * y1),
                      arrowprops={"arrowstyle": "<->", "lw": 1.4, "color": "#c1121f"})
        norm = math.hypot(x1, y1)
        star.text(x1 * 0.55 - 0.3 * y1 / norm, y1 * 0.55 + 0.3 * x1 / norm, "W: P\ngrad: P", fontsize=7.5,
                  ha="center", va="center")
    for i, (x, y) in enumerate(star_pos):
        _box(star, x - 0.28, y - 0.18, 0.56, 0.36, f"dev {i}", colors[i], 9)
    star.set_title(f"DataParallel, n={n}: device 0 sends W and\nreceives grads: 2(n-1)P = {2 * (n - 1)}P per step",
                   fontsize=9.5)
    for i in range(n):
        (x0, y0), (x1, y1) = pos[i], pos[(i + 1) % n]
        ring.annotate("", xy=(x0 + 0.8 * (x1 - x0), y0 + 0.8 * (y1 - y0)),
                      xytext=(x0 + 0.2 * (x1 - x0), y0 + 0.2 * (y1 - y0)),
                      arrowprops={"arrowstyle": "->", "lw": 1.4, "color": "#c1121f"})
    for i, (x, y) in enumerate(pos):
        _box(ring, x - 0.28, y - 0.18, 0.56, 0.36, f"dev {i}", colors[i], 9)
    ring.text(0, 0, "every device sends\n2(n-1)/n P and\nreceives as much", ha="center", va="center", fontsize=8)
    ring.set_title(f"Ring all-reduce (DDP), n={n}: 4(n-1)/n P = {4 * (n - 1) / n:.0f}P\nper device, "
                   "weights never move", fontsize=9.5)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    """Write both PNGs next to this script."""
    dp_algorithm(HERE / "03_dp_algorithm.png")
    dp_vs_allreduce(HERE / "03_dp_vs_allreduce.png")


if __name__ == "__main__":
    main()
