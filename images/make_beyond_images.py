"""Draw notebook 10's diagrams (run `python images/make_beyond_images.py`; the PNGs are committed).

* ``10_ring_attention.png``: left, 4 ranks in a ring, each keeping its query block while the key/value blocks
  travel one hop per step; right, which (query chunk, key chunk) products each rank computes under a causal
  mask, contiguous against zig-zag, read from :func:`lslm.context_parallel.ring.block_pairs` and
  :func:`lslm.context_parallel.layout.chunk_ids` (not typed in), with the work per rank from
  :func:`lslm.context_parallel.layout.attention_work`.
* ``10_course_map.png``: which technique of the course divides which memory term of one device, or trades which
  communication, and the notebook that measured it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from diagram import arrow, box  # noqa: E402  (images/diagram.py)
from matplotlib.patches import Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from lslm.context_parallel.layout import attention_work, chunk_ids, num_chunks  # noqa: E402
from lslm.context_parallel.ring import block_pairs  # noqa: E402

COLORS = ("#8ecae6", "#ffb703", "#90be6d", "#f28482")
CP = 4


def _ring(ax: plt.Axes) -> None:
    """4 ranks on a circle; Q stays, KV moves to the next rank each step."""
    radius = 1.7
    centres = []
    for r in range(CP):
        angle = math.pi / 2 - 2 * math.pi * r / CP
        centres.append((radius * math.cos(angle), radius * math.sin(angle)))
    for r, (x, y) in enumerate(centres):
        box(ax, x - 0.6, y - 0.34, 1.2, 0.68, f"rank {r}: Q{r} stays\nat step s it holds\nKV of rank {r} - s",
            COLORS[r], fontsize=8)
    for r in range(CP):
        (x0, y0), (x1, y1) = centres[r], centres[(r + 1) % CP]
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2
        arrow(ax, (mx + (x1 - mx) * 0.35, my + (y1 - my) * 0.35), (mx - (x1 - mx) * 0.35, my - (y1 - my) * 0.35),
              lw=1.5, color="#444444")
        ax.text(mx * 1.3, my * 1.3, "KV block", ha="center", va="center", fontsize=7, color="#444444")
    ax.text(0, 0, "cp - 1 steps:\nsend KV to rank + 1,\nreceive from rank - 1,\nattend while it\ntravels, merge by\n"
                  "log-sum-exp", ha="center", va="center", fontsize=7.5)
    ax.set_xlim(-2.5, 2.5)
    ax.set_ylim(-2.2, 2.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("ring attention: queries stay, keys and values go round", fontsize=9)


def _grid(ax: plt.Axes, layout: str, seq_len: int = 64) -> None:
    """Rows: query chunks, columns: key chunks, coloured by the rank that computes the product."""
    n = num_chunks(CP, layout)
    owner = {c: r for r in range(CP) for c in chunk_ids(r, CP, layout)}
    for rank in range(CP):
        mine = chunk_ids(rank, CP, layout)
        for source in range(CP):
            theirs = chunk_ids(source, CP, layout)
            for i, j, diagonal in block_pairs(rank, source, CP, layout, causal=True):
                qc, kc = mine[i], theirs[j]
                y = n - 1 - qc
                ax.add_patch(Rectangle((kc, y), 1, 1, fc=COLORS[rank], ec="white", lw=1))
                if diagonal:  # the lower triangle of the block only
                    ax.add_patch(plt.Polygon([(kc + 1, y + 1), (kc + 1, y), (kc, y + 1)], fc="white", ec="none",
                                             alpha=0.75))
    for c in range(n):
        ax.text(-0.15, n - 1 - c + 0.5, f"q{c} (r{owner[c]})", ha="right", va="center", fontsize=7)
        ax.text(c + 0.5, n + 0.1, f"k{c}", ha="center", va="bottom", fontsize=7)
    work = attention_work(seq_len, CP, layout)["entries"]
    ax.set_xlim(-1.6, n + 0.1)
    ax.set_ylim(-0.2, n + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"{layout}, causal, cp = {CP}: {n} chunks\nscore entries per rank (T = {seq_len}): "
                 f"{', '.join(map(str, work))}", fontsize=9)


def ring_figure() -> None:
    """Draw images/10_ring_attention.png."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6), dpi=100, width_ratios=(1.1, 0.8, 1.2))
    _ring(axes[0])
    _grid(axes[1], "contiguous")
    _grid(axes[2], "zigzag")
    handles = [Rectangle((0, 0), 1, 1, fc=COLORS[r]) for r in range(CP)]
    fig.legend(handles, [f"computed by rank {r}" for r in range(CP)], loc="lower center", ncol=CP, fontsize=8,
               frameon=False)
    fig.suptitle("Ring attention over cp = 4 ranks; blank cells: key chunk after the query chunk, skipped; "
                 "half cells: the diagonal block, lower triangle only", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(HERE / "10_ring_attention.png")
    plt.close(fig)


#: (technique, notebook, {column: what it does to that term or cost}). Columns (keys of :data:`COLUMNS`): one
#: device's memory terms, then the communication and idle time of a step. "/N": divided by the data-parallel size,
#: "/t" tensor, "/p" pipeline, "/cp" context, "/ep" experts; an entry starting with "+" is what the technique adds.
COLUMNS = {"P": "parameters", "G": "gradients", "OS": "optimizer\nstates", "A": "activations",
           "C": "communication\nper step", "T": "idle time"}
MAP = (
    ("DDP (bucketed, overlapped)", "04", {"C": "2Ψ all-reduce,\nhidden by backward"}),
    ("ZeRO-1 / 2 / 3", "08", {"OS": "/N (1+)", "G": "/N (2+)", "P": "/N (3)", "C": "2Ψ (1, 2)\n+ 3Ψ (3)"}),
    ("ZeRO-Offload", "08", {"OS": "to the host", "C": "+ host <-> device"}),
    ("mixed precision", "07", {"P": "2 bytes", "A": "2 bytes", "OS": "+ fp32 masters"}),
    ("tensor parallel (+ SP)", "05", {"P": "/t", "G": "/t", "OS": "/t", "A": "/t with SP",
                                      "C": "+ per layer,\ncritical path"}),
    ("pipeline parallel", "06", {"P": "/p", "G": "/p", "OS": "/p", "A": "p in flight\n(1F1B)",
                                 "T": "+ bubble\n(p-1)/(v·m)"}),
    ("recomputation", "06, 09", {"A": "layer input\nonly", "T": "+ a forward"}),
    ("3D layout + calculator", "09", {"A": "sized per s", "C": "tp inside a node"}),
    ("context parallel (ring, Ulysses)", "10", {"A": "/cp", "C": "+ KV per layer\n(ring: hidden)"}),
    ("expert parallel (MoE)", "10", {"P": "experts /ep", "G": "experts /ep", "OS": "experts /ep",
                                     "C": "+ 2 all-to-all\nper layer"}),
    ("1-bit Adam", "10", {"C": "~1/32 after\nwarm-up"}),
    ("progressive layer dropping", "10", {"A": "skipped blocks\nkeep none"}),
)


def map_figure() -> None:
    """Draw images/10_course_map.png."""
    fig, ax = plt.subplots(figsize=(14, 6.6), dpi=100)
    rows, cols = len(MAP), len(COLUMNS)
    w0, w, h = 3.0, 1.9, 0.55
    for j, col in enumerate(COLUMNS.values()):
        ax.text(w0 + j * w + w / 2, rows * h + 0.15, col, ha="center", va="bottom", fontsize=8, weight="bold")
    ax.text(w0 / 2, rows * h + 0.15, "technique (notebook)", ha="center", va="bottom", fontsize=8, weight="bold")
    for i, (name, nb, cells) in enumerate(MAP):
        y = (rows - 1 - i) * h
        ax.add_patch(Rectangle((0, y), w0, h, fc="#eeeeee" if i % 2 else "white", ec="#cccccc", lw=0.5))
        ax.text(0.1, y + h / 2, f"{name}  ({nb})", ha="left", va="center", fontsize=8)
        for j, col in enumerate(COLUMNS):
            text = cells.get(col, "")
            cost = text.startswith("+")
            fc = ("#f6c1c1" if cost else "#c7e9c0") if text else ("#eeeeee" if i % 2 else "white")
            ax.add_patch(Rectangle((w0 + j * w, y), w, h, fc=fc, ec="#cccccc", lw=0.5))
            ax.text(w0 + j * w + w / 2, y + h / 2, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.1, w0 + cols * w + 0.1)
    ax.set_ylim(-0.1, rows * h + 0.7)
    ax.axis("off")
    ax.set_title("The course on one page: what each technique divides (green) and what it costs (red), for one "
                 "device of a training step", fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "10_course_map.png")
    plt.close(fig)


def main() -> None:
    """Draw both figures."""
    ring_figure()
    map_figure()


if __name__ == "__main__":
    main()
