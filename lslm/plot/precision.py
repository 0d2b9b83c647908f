"""Figures of notebook 07: float formats' ranges, the loss-scale window, loss curves and scale trajectories.

Every function draws on ``ax`` (or a new figure) and returns the Figure; nothing is shown.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from lslm.precision.formats import FORMATS, FloatFormat, format_of

__all__ = ["plot_formats", "plot_loss_curves", "plot_scale_trajectory", "plot_underflow_window"]

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def _ax(ax: Any, figsize: tuple[float, float]) -> Any:
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, dpi=80)
    return ax


def plot_formats(formats: Sequence[str | FloatFormat] | None = None, histogram: dict[str, Any] | None = None,
                 ax: Any = None, xlim: tuple[float, float] | None = None,
                 title: str = "representable magnitudes of each format") -> Figure:
    """One bar per format on a log2 axis: subnormals (light) from the smallest subnormal, normals (dark) to max.

    Each label also gives the format's precision, its unit roundoff ``u``.

    ``formats``: names of :data:`~lslm.precision.formats.FORMATS` (default: all).
    ``histogram``: :func:`~lslm.precision.formats.grad_exponent_histogram` output, drawn on
    a twin axis (log count) so the gradients can be read against each range. ``xlim``:
    the exponent window shown (default: everything drawn).
    """
    fmts = [f if isinstance(f, FloatFormat) else format_of(f) for f in (formats or list(FORMATS))]
    if not fmts:
        raise ValueError("no formats to draw: pass names such as ['fp16', 'bf16'] or leave formats=None")
    ax = _ax(ax, (9, 2.2 + 0.6 * len(fmts)))
    for i, f in enumerate(fmts):
        lo, mid, _ = f.log2_range
        ax.barh(i, mid - lo, left=lo, height=0.6, color="#a6cee3", edgecolor="black", lw=0.4,
                label="subnormal range (fewer significant bits)" if i == 0 else None)
        ax.barh(i, math.log2(f.max) - mid, left=mid, height=0.6, color="#1f78b4", edgecolor="black", lw=0.4,
                label="normal range" if i == 0 else None)
    # Range is the bar; precision (the unit roundoff u: one rounding's largest relative error) goes in the label.
    ax.set_yticks(range(len(fmts)), [f"{f.name}, u = 2^{round(math.log2(f.unit_roundoff))}\n"
                                     f"2^{f.log2_range[0]} .. {f.max:.6g}" for f in fmts], fontsize=8)
    ax.set_ylim(len(fmts) - 0.4, -0.6)
    ax.set_xlabel("binary exponent, log2 |value|")
    ax.set_ylabel("format, precision u\n(smallest subnormal .. max)")
    ax.set_title(title, fontsize=10)
    left, right = min(f.log2_range[0] for f in fmts) - 2, max(math.log2(f.max) for f in fmts) + 2
    handles, labels = ax.get_legend_handles_labels()
    if histogram is not None and histogram["exponents"]:
        twin = ax.twinx()
        exps, counts = histogram["exponents"], histogram["counts"]
        # An outline, not filled bars: the format bars stay readable underneath.
        twin.stairs([max(c, 0.5) for c in counts], [*exps, exps[-1] + 1], color="#ff7f0e", lw=1.8, baseline=0.5,
                    label=f"gradient entries per exponent ({histogram['nonzero']:,} nonzero, "
                          f"{histogram['zeros']:,} zero, not shown)")
        twin.set_yscale("log")
        twin.set_ylim(0.5, None)
        twin.set_ylabel("gradient entries (count, log scale)")
        extra = twin.get_legend_handles_labels()
        handles, labels = handles + extra[0], labels + extra[1]
        left, right = min(left, exps[0] - 2), max(right, exps[-1] + 3)
    ax.set_xlim(*(xlim or (left, right)))
    ax.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    ax.figure.tight_layout()
    return ax.figure


def plot_underflow_window(rows: Sequence[dict[str, Any]], ax: Any = None, mark: float | None = None,
                          title: str | None = None) -> Figure:
    """Fractions of nonzero gradients that underflow, go subnormal or overflow, against log2 of the loss scale.

    ``rows``: :func:`~lslm.precision.formats.underflow_window` output. The y axis is
    symmetric-log in percent, so exact zeros sit on the axis. ``mark``: a log2 scale to
    mark (e.g. the scaler's 16).
    """
    if not rows:
        raise ValueError("no rows: pass lslm.precision.formats.underflow_window(grads, ...)")
    ax = _ax(ax, (7, 4))
    xs = [r["log2_scale"] for r in rows]
    for key, color, style in (("underflow", "#d62728", "-o"), ("subnormal", "#ff7f0e", "--s"),
                              ("overflow", "#1f77b4", "-^")):
        ax.plot(xs, [100 * r[key] for r in rows], style, color=color, ms=4, label=f"{key} (cast of g · scale)")
    if mark is not None:
        ax.axvline(mark, color="black", lw=0.8, ls=":", label=f"scale 2^{mark:g}")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_ylim(0, 100)
    ax.set_xlabel("log2 of the loss scale")
    ax.set_ylabel("share of nonzero gradient entries (%)")
    ax.set_title(title or f"the loss-scale window in {rows[0]['format']}", fontsize=10)
    ax.legend(fontsize=8)
    return ax.figure


def plot_loss_curves(curves: dict[str, Sequence[float]], ax: Any = None, title: str = "training loss") -> Figure:
    """Loss per step of each named run, one colour and line style each."""
    if not curves:
        raise ValueError("no curves: pass {'run name': [loss per step, ...]}")
    ax = _ax(ax, (7, 4))
    styles = ["-", "--", ":", "-."]
    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(range(len(losses)), list(losses), styles[i % len(styles)], color=_COLORS[i % len(_COLORS)],
                lw=2.2 if i == 0 else 1.4, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return ax.figure


def plot_scale_trajectory(scales: dict[str, Sequence[float]], stepped: dict[str, Sequence[bool]] | None = None,
                          ax: Any = None, ceiling_log2: float | None = None,
                          title: str = "dynamic loss scale per step") -> Figure:
    """log2 of the loss scale used at each step, per run; skipped (overflow) steps marked with an x.

    ``stepped[name][k]`` False marks step ``k`` of that run as skipped. ``ceiling_log2``:
    a dashed line at the largest scale that fits (e.g. ``scaler_first_steps``'s ``headroom_log2``).
    """
    if not scales:
        raise ValueError("no scale trajectories: pass {'run name': [scale per step, ...]}")
    ax = _ax(ax, (7, 4))
    for i, (name, values) in enumerate(scales.items()):
        ys = [math.log2(s) for s in values]
        color = _COLORS[i % len(_COLORS)]
        ax.step(range(len(ys)), ys, where="post", color=color, lw=2.2 - 0.8 * (i > 0), ls="-" if i == 0 else "--",
                label=name)
        skipped = [k for k, ok in enumerate((stepped or {}).get(name, [])) if not ok]
        if skipped:
            # The first run's skips as crosses, later runs' as rings around them: both visible when they coincide.
            ax.plot(skipped, [ys[k] for k in skipped], "x" if i == 0 else "o", color=color, ms=7 + 4 * i, mew=2,
                    mfc="none", label=f"{name}: skipped step (overflow)")
    if ceiling_log2 is not None:
        ax.axhline(ceiling_log2, color="black", lw=0.8, ls=":", label=f"largest scale that fits: 2^{ceiling_log2:g}")
    ax.set_xlabel("step")
    ax.set_ylabel("log2 of the loss scale")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return ax.figure
