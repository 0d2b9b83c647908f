"""Draw notebook 07's diagrams (run `python images/make_precision_images.py`; PNGs are committed).

* ``07_bit_layouts.png``: the bits of fp32, fp16, bf16, fp8 e4m3 and e5m2 (sign, exponent,
  mantissa), drawn to scale, with each format's range and precision read from torch.finfo.
* ``07_master_weights.png``: one mixed-precision step: half-precision weights, half
  gradients folded into fp32 main grads, the fp32 master step, the cast back.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from diagram import arrow as _arrow  # noqa: E402  (images/diagram.py)
from diagram import box as _box  # noqa: E402

HERE = Path(__file__).resolve().parent
SIGN, EXP, MAN = "#f28482", "#8ecae6", "#90be6d"
BLUE, ORANGE, GREEN, RED, GREY = "#8ecae6", "#ffb703", "#90be6d", "#f28482", "#e9ecef"
FORMATS = (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16),
           ("fp8 e4m3", torch.float8_e4m3fn), ("fp8 e5m2", torch.float8_e5m2))


def bit_layouts(path: Path) -> None:
    """One row of bit cells per format, coloured by field, with range and precision from torch.finfo."""
    fig, ax = plt.subplots(figsize=(11, 3.6), dpi=100)
    cell = 0.25
    for row, (name, dtype) in enumerate(FORMATS):
        fi = torch.finfo(dtype)
        man = round(-math.log2(fi.eps))
        exp = fi.bits - 1 - man
        y = -row * 0.7
        fields = [(SIGN, 1, "s")] + [(EXP, exp, "e")] + [(MAN, man, "m")]
        x = 0.0
        for color, n, _ in fields:
            for _ in range(n):
                ax.add_patch(plt.Rectangle((x, y), cell, 0.45, fc=color, ec="black", lw=0.6))
                x += cell
        ax.text(-0.15, y + 0.22, name, ha="right", va="center", fontsize=10, fontweight="bold")
        ax.text(32 * cell + 0.3, y + 0.22,
                f"{exp} exponent + {man} mantissa bits:  max {float(fi.max):.4g},  smallest normal "
                f"{float(fi.smallest_normal):.3g},  u = 2^-{man + 1}", va="center", fontsize=8.5)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=c, ec="black", lw=0.6) for c in (SIGN, EXP, MAN)]
    ax.legend(handles, ["sign", "exponent (range)", "mantissa (precision)"], loc="lower center", ncol=3,
              fontsize=8, bbox_to_anchor=(0.5, -0.2), frameon=False)
    ax.set_xlim(-1.6, 32 * cell + 6.6)
    ax.set_ylim(-4 * 0.7 - 0.35, 0.65)
    ax.axis("off")
    ax.set_title("Bit layouts, one cell per bit (values read from torch.finfo; u: unit roundoff)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def master_weights(path: Path) -> None:
    """The mixed-precision step: 16-bit forward/backward, fp32 main_grad, fp32 master step, cast back."""
    fig, ax = plt.subplots(figsize=(11, 3.9), dpi=100)
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 4.75)
    ax.axis("off")
    ax.axhline(2.2, color="grey", lw=0.8, ls="--")
    ax.text(0.1, 2.35, "16 bits (fp16 / bf16): 2 B per parameter", fontsize=8, color="dimgrey")
    ax.text(0.1, 1.95, "32 bits (fp32): 4 B per parameter each", fontsize=8, color="dimgrey")
    _box(ax, 0.3, 2.8, 2.1, 1.0, "half weights $w_{16}$\nforward + backward\n(matmuls in 16 bits)", BLUE, 8)
    _box(ax, 3.2, 2.8, 2.0, 1.0, "half gradients\n$g_{16}$ (one layer\nat a time)", ORANGE, 8)
    _box(ax, 3.2, 0.5, 2.0, 1.1, "fp32 main_grad\n$G$ += $g_{16}$\n(accumulate, all-reduce)", ORANGE, 8)
    _box(ax, 6.0, 0.5, 2.2, 1.1, "unscale, overflow vote,\nclip: fp32", RED, 8)
    _box(ax, 8.7, 0.5, 2.1, 1.1, "optimizer step on\nfp32 masters $W$\n(+ fp32 Adam $m, v$)", GREEN, 8)
    _box(ax, 8.7, 2.8, 2.1, 1.0, "cast back\n$w_{16}$ = round($W$)", BLUE, 8)
    _arrow(ax, (3.2, 3.3), (2.4, 3.3))
    _arrow(ax, (4.2, 1.6), (4.2, 2.8))
    ax.text(4.3, 2.2, " hook: fold in, free $g_{16}$", fontsize=7.5, va="bottom")
    _arrow(ax, (6.0, 1.05), (5.2, 1.05))
    _arrow(ax, (8.7, 1.05), (8.2, 1.05))
    _arrow(ax, (9.75, 2.8), (9.75, 1.6))
    ax.annotate("", xy=(1.35, 3.8), xytext=(9.75, 3.8),
                arrowprops={"arrowstyle": "->", "lw": 1, "connectionstyle": "arc3,rad=0.15"})
    ax.text(5.5, 4.5, "next step's weights", ha="center", fontsize=8)
    ax.set_title("Mixed precision with fp32 master weights: compute in 16 bits, accumulate and update in 32",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    bit_layouts(HERE / "07_bit_layouts.png")
    master_weights(HERE / "07_master_weights.png")
