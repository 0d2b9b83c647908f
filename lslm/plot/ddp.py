"""Figures of notebook 04 and ``lslm bench ddp``: step-time breakdown, bucket sweep, overlap timeline, losses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt

__all__ = ["plot_step_breakdown", "plot_bucket_sweep", "plot_timeline", "plot_loss_curves"]

_PHASES = (("forward", "#8ecae6"), ("backward", "#219ebc"), ("wait for all-reduce", "#f28482"),
           ("optimizer", "#90be6d"))


def _ax(ax: Any, figsize: tuple[float, float]) -> Any:
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, dpi=80)
    return ax


def plot_step_breakdown(result: dict[str, Any], ax: Any = None) -> Any:
    """Stacked bars per variant at the common bucket size: compute, exposed comm, optimizer (ms).

    ``result`` is one world size of :func:`lslm.bench.ddp.run`. The ``local`` bar
    (no communication at all) is the floor; torch's communication runs inside
    backward, so it shows up in its compute bar.
    """
    ax = _ax(ax, (6, 4))
    mb = result["bucket_cap_mb"]
    rows = [r for r in result["rows"] if r["bucket_mb"] == mb]
    names = [r["variant"] for r in rows]
    bottom = [0.0] * len(rows)
    for key, label, color in (("compute_ms", "forward + backward", "#219ebc"),
                              ("exposed_ms", "exposed comm (finish_grad_sync)", "#f28482"),
                              ("optimizer_ms", "clip + AdamW", "#90be6d")):
        vals = [max(0.0, r[key]) for r in rows]
        ax.bar(names, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{r['step_ms']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{result['world_size']} processes, {mb:g} MiB buckets: where a step's time goes", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, max(bottom) * 1.25)
    return ax


def plot_bucket_sweep(result: dict[str, Any], ax: Any = None) -> Any:
    """Median step time (ms) against bucket size (MiB) for bucketed (and torch), with naive/local as lines."""
    ax = _ax(ax, (6, 4))
    for variant, marker in (("bucketed", "o"), ("torch", "s")):
        pts = sorted((r["bucket_mb"], r["step_ms"]) for r in result["rows"] if r["variant"] == variant)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"{variant} DDP")
    mb = result["bucket_cap_mb"]
    for variant, style, color in (("naive", ":", "tab:red"), ("local", "--", "tab:green")):
        row = next((r for r in result["rows"] if r["variant"] == variant and r["bucket_mb"] == mb), None)
        if row:
            label = "local (no communication)" if variant == "local" else "naive (one all-reduce per tensor)"
            ax.axhline(row["step_ms"], ls=style, color=color, label=label)
    ax.axvline(result["grad_bytes"] / 2**20, color="black", lw=0.8, alpha=0.5,
               label=f"all gradients ({result['grad_bytes'] / 2**20:.1f} MiB): one bucket")
    ax.set_xscale("log")
    ax.set_xlabel("bucket size cap (MiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"bucket-size sweep, {result['world_size']} processes", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def plot_timeline(per_rank: Sequence[dict[str, Any]], ax: Any = None, title: str | None = None) -> Any:
    """One training step per rank: forward, backward, wait, optimizer; each bucket's all-reduce below.

    ``per_rank[r]`` holds ``perf_counter`` times ``t0``, ``forward_end``,
    ``backward_end``, ``sync_end``, ``step_end`` and the DDP ``events``
    (``bucket_ready`` / ``allreduce_done`` per bucket). Times are in ms from the
    earliest ``t0`` (``perf_counter`` reads the system's monotonic clock, shared by
    the processes of one machine). A bucket's bar runs from its launch (``t_start``,
    else its ``bucket_ready`` time) to ``allreduce_done``; the tick marks
    ``bucket_ready`` (its last gradient arrived).
    """
    nb = max(len({e["bucket"] for e in tl["events"]}) for tl in per_rank) or 1
    band = 1.0 + 0.28 * nb + 0.5  # compute bar, one thin row per bucket, a gap
    ax = _ax(ax, (9, 0.9 + 0.55 * band * len(per_rank)))
    origin = min(tl["t0"] for tl in per_rank)
    ms = lambda t: (t - origin) * 1e3  # noqa: E731
    ticks = []
    for r, tl in enumerate(per_rank):
        top = band * (len(per_rank) - r)
        y = top - 0.5
        bounds = [tl["t0"], tl.get("forward_end", tl["t0"]), tl["backward_end"], tl["sync_end"], tl["step_end"]]
        for (name, color), a, b in zip(_PHASES, bounds, bounds[1:]):
            ax.barh(y, ms(b) - ms(a), left=ms(a), height=0.8, color=color, edgecolor="black", lw=0.4,
                    label=name if r == 0 else None)
        ready = {e["bucket"]: e for e in tl["events"] if e["event"] == "bucket_ready"}
        done = {e["bucket"]: e for e in tl["events"] if e["event"] == "allreduce_done"}
        for b in sorted(ready):
            yy = y - 0.7 - 0.28 * b
            t_ready = ms(ready[b]["t"])
            start = ms(done[b].get("t_start", ready[b]["t"])) if b in done else t_ready
            end = ms(done[b]["t"]) if b in done else start
            ax.barh(yy, end - start, left=start, height=0.2, color="#d62828",
                    label="bucket all-reduce (launch → done)" if r == 0 and b == 0 else None)
            ax.plot([t_ready], [yy], marker="|", color="black", ms=6,
                    label="bucket ready" if r == 0 and b == 0 else None)
            ax.text(end, yy, f" b{b}: {ready[b]['bytes'] / 2**20:.2g} MiB", fontsize=8, va="center")
        ticks.append((y, f"rank {r}"))
    ax.set_yticks([p for p, _ in ticks], [t for _, t in ticks])
    ax.set_ylim(0, band * len(per_rank) + 0.2)
    ax.set_xlabel("time since the first rank started the step (ms)")
    ax.set_title(title or "one bucketed DDP step per rank: bucket all-reduces overlap backward", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)
    return ax


def plot_loss_curves(curves: dict[str, Sequence[float]], reference: str | None = None, ax: Any = None,
                     title: str = "training loss") -> Any:
    """Loss per step for each named run; with ``reference``, a second panel of ``loss - reference loss``.

    ``ax``: one axis, or two when ``reference`` is given. Returns the first.
    """
    if ax is None:
        ncols = 2 if reference else 1
        _, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 3.8), dpi=80, squeeze=False)
        axes = list(axes[0])
    else:
        axes = list(ax) if hasattr(ax, "__iter__") else [ax]
    styles = ["-", "--", ":", "-."]
    for i, (name, losses) in enumerate(curves.items()):
        axes[0].plot(range(len(losses)), losses, label=name, lw=2.5 if i == 0 else 1.2, ls=styles[i % len(styles)])
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("cross-entropy loss (nats/token)")
    axes[0].set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    if reference and len(axes) > 1:
        ref = curves[reference]
        markers = ["o", "s", "^", "v", "x"]
        for i, (name, losses) in enumerate((k, v) for k, v in curves.items() if k != reference):
            diff = [a - b for a, b in zip(losses, ref)]
            axes[1].plot(range(len(diff)), diff, marker=markers[i % len(markers)], ms=7 - 1.5 * i, ls="none",
                         label=name, alpha=0.8)
        axes[1].axhline(0, color="black", lw=0.6)
        axes[1].ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        axes[1].set_xlabel("step")
        axes[1].set_ylabel(f"loss - loss of {reference.split(' (')[0]}")
        axes[1].set_title("difference from the reference run (fp32 rounding)", fontsize=10)
        axes[1].legend(fontsize=8)
    return axes[0]
