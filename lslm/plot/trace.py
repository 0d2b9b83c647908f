"""A timeline of profiler traces: compute and each communication group on one time axis, per rank.

Reads what :func:`lslm.metrics.overlap.load_trace` makes of the Chrome traces that
``--trace DIR`` writes (:mod:`lslm.metrics.trace`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from lslm.metrics.overlap import Timeline, load_trace

__all__ = ["plot_trace"]

_COMPUTE = "#219ebc"
_KINDS = {"all_reduce": "#f28482", "all_gather": "#f6bd60", "reduce_scatter": "#84a59d", "broadcast": "#b5838d",
          "send": "#9d4edd", "recv": "#c77dff", "all_to_all": "#e76f51", "barrier": "#8d99ae"}


def plot_trace(traces: Sequence[Timeline | str | Path], ax: Any = None, title: str | None = None,
               step: str | None = None) -> Any:
    """Rows per rank: ``compute`` (operators of the main thread), one row per communication group (axis),
    and ``transport``: torch's own communication events on other threads (gloo's, where the bytes move on CPU).

    A collective is drawn from its issue to the end of its wait, light; the part the main thread
    spent blocked in it (exposed) on top, dark; colours by kind. Each traced step is shaded and
    labelled. Times in milliseconds from the earliest trace's start: ranks are aligned on the
    profiler's clock, which the processes of one host share (across hosts it is only as good as
    the hosts' clock synchronisation).
    ``step`` (a step id, e.g. ``"2"``) zooms on that step of every rank.
    """
    timelines = [t if isinstance(t, Timeline) else load_trace(t) for t in traces]
    if not timelines:
        raise ValueError("no trace to plot: pass paths of *-rank<r>.json files or load_trace() results")
    zero = min(t.origin_us for t in timelines)
    timelines = [t.shifted((t.origin_us - zero) / 1e6) for t in timelines]
    rows: list[tuple[str, Timeline, str | None]] = []
    for tl in sorted(timelines, key=lambda t: t.rank):
        rows.append((f"rank {tl.rank} compute", tl, None))
        for axis in sorted({c.info.axis or "-" for c in tl.collectives}):
            rows.append((f"rank {tl.rank} comm [{axis}]", tl, axis))
        if tl.other_threads:
            rows.append((f"rank {tl.rank} transport", tl, ""))
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(rows)), dpi=80)
    shaded: set[tuple[int, str]] = set()
    seen: set[str] = set()
    for y, (_, tl, axis) in enumerate(rows):
        for name, lo, hi in tl.steps:
            if (tl.rank, name) not in shaded:
                shaded.add((tl.rank, name))
                ys = [y2 for y2, r in enumerate(rows) if r[1] is tl]
                ax.fill_between([1e3 * lo, 1e3 * hi], min(ys) - 0.45, max(ys) + 0.45, color="#adb5bd", alpha=0.18,
                                lw=0)
                ax.text(1e3 * lo, min(ys) - 0.3, f" step {name}", fontsize=7, va="center", color="#495057",
                        clip_on=True)
        if axis is None:
            ax.broken_barh([(1e3 * a, 1e3 * (b - a)) for a, b in tl.compute], (y - 0.35, 0.7), color=_COMPUTE,
                           label=None if "compute" in seen else "compute")
            seen.add("compute")
            continue
        if axis == "":
            for events in tl.other_threads.values():
                ax.broken_barh([(1e3 * a, 1e3 * (b - a)) for _, a, b in events], (y - 0.2, 0.4), color="#6c757d",
                               label=None if "transport" in seen else "transport (torch's own events)")
                seen.add("transport")
            continue
        blocked = {iv for iv, _ in tl.blocking()}
        for c in tl.collectives:
            if (c.info.axis or "-") != axis:
                continue
            color = _KINDS.get(c.info.op, "#6c757d")
            a, b = c.span
            label = None if c.info.op in seen else c.info.op
            seen.add(c.info.op)
            ax.broken_barh([(1e3 * a, 1e3 * (b - a))], (y - 0.25, 0.5), color=color, alpha=0.35, label=label)
            for iv in (c.call, c.wait):
                if iv is not None and iv in blocked:
                    ax.broken_barh([(1e3 * iv[0], 1e3 * (iv[1] - iv[0]))], (y - 0.35, 0.7), color=color)
    if step is not None:
        spans = [(lo, hi) for tl in timelines for name, lo, hi in tl.steps if name == str(step)]
        if not spans:
            held = sorted({n for t in timelines for n, *_ in t.steps})
            raise ValueError(f"no step {step!r} in the traces; they hold {held}")
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        pad = 0.02 * (hi - lo)
        ax.set_xlim(1e3 * (lo - pad), 1e3 * (hi + pad))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time since the trace began (ms)")
    ax.set_title(title or "Profiler trace: compute and communication per rank (dark = main thread blocked)",
                 loc="left", fontsize=10, pad=22)
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=min(5, max(1, len(seen))),
              frameon=False)
    ax.figure.tight_layout()
    return ax
