"""Notebook 08's figures: model-state bytes per rank by owner next to ZeRO's formulas, stage 3's measured timeline,
the whole picture of a step (states and transient buffers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt

__all__ = ["OWNERS", "plot_state_bytes", "plot_timeline", "plot_whole_picture"]

OWNERS = (("parameters", "parameters", "#8ecae6"), ("gradients", "gradients", "#ffb703"),
          ("master_weights", "fp32 masters", "#cdb4db"), ("optimizer_states", "optimizer states", "#90be6d"))


def plot_state_bytes(bars: Sequence[tuple[str, Mapping[str, int]]], *, theory: Mapping[str, float] | None = None,
                     psi: int, title: str) -> plt.Figure:
    """Stacked bars of bytes by owner, one per ``(label, bytes by owner)``, in bytes per parameter (``/ psi``);
    ``theory[label]`` (bytes per parameter) is drawn as a black tick on its bar."""
    fig, ax = plt.subplots(figsize=(11, 4.2), dpi=80)
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for key, name, color in OWNERS:
        vals = [b.get(key, 0) / psi for _, b in bars]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=color, edgecolor="black", lw=0.5, label=name)
            bottom = [a + v for a, v in zip(bottom, vals)]
    for x, (label, _) in zip(xs, bars):
        if theory and label in theory:
            ax.hlines(theory[label], x - 0.42, x + 0.42, color="black", lw=2,
                      label="formula" if x == next(i for i, (lb, _) in enumerate(bars) if lb in theory) else None)
        ax.text(x, bottom[x] + 0.15, f"{bottom[x]:.2f}", ha="center", fontsize=7)
    ax.set_xticks(list(xs), [label for label, _ in bars], fontsize=7.5, rotation=30, ha="right")
    ax.set_ylabel("bytes per parameter, per rank")
    ax.set_ylim(0, 1.15 * max(bottom))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=5, loc="upper right")
    fig.tight_layout()
    return fig


def plot_timeline(records: Sequence[Mapping[str, Any]], *, title: str,
                  compute: Sequence[Mapping[str, Any]] | None = None) -> plt.Figure:
    """One row per collective kind, a bar from issue to completion per call (ms), its size written on it (KiB).

    ``compute``: spans ``{"block", "phase" ("forward" or "backward"), "start_s", "end_s"}`` on the same clock
    (:class:`lslm.demos.zero_demo.BlockSpans`), drawn in a row of their own above the collectives, each labelled
    with its block (F0 is block 0's forward, B0 its backward): what overlaps what is read down a column."""
    lanes = {"all_gather": 1, "reduce_scatter": 0}
    names = {"all_gather": "all-gather (parameters)", "reduce_scatter": "reduce-scatter (gradients)"}
    colors = {"all_gather": "#8ecae6", "reduce_scatter": "#ffb703"}
    top = 2 if compute else 1
    fig, ax = plt.subplots(figsize=(11, 2.8 + 0.8 * (top - 1)), dpi=80)
    for r in records:
        lane = lanes[r["op"]]
        start, end = r["issue_s"] * 1e3, r["done_s"] * 1e3
        ax.broken_barh([(start, max(end - start, 0.02))], (lane + 0.15, 0.7), facecolors=colors[r["op"]],
                       edgecolors="black", lw=0.5)
        ax.text(start, lane + 0.9, f"{r['nbytes'] / 1024:.0f}", fontsize=6.5, va="bottom")
    ticks, labels = [v + 0.5 for v in lanes.values()], [names[k] for k in lanes]
    if compute:
        shades = {"forward": "#adb5bd", "backward": "#6c757d"}
        for s in compute:
            if s["end_s"] is None:
                continue
            start, end = s["start_s"] * 1e3, s["end_s"] * 1e3
            ax.broken_barh([(start, max(end - start, 0.02))], (top + 0.15, 0.7), facecolors=shades[s["phase"]],
                           edgecolors="black", lw=0.5)
            ax.text((start + end) / 2, top + 0.5, f"{s['phase'][0].upper()}{s['block']}", fontsize=7, ha="center",
                    va="center", color="white" if s["phase"] == "backward" else "black")
        ticks.append(top + 0.5)
        labels.append("compute: block forward (F) / backward (B)")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(0, top + 1.3)
    ax.set_xlabel("time since the step began (ms); numbers: KiB per call (the full unit)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_whole_picture(pictures: Sequence[Mapping[str, Any]], *, title: str) -> plt.Figure:
    """Stacked bars, one per (world size, entry) of :func:`lslm.demos.zero_demo.whole_picture` results (rank 0's):
    the model states held after a step by owner, then the step's transient peak on top, in MB per rank."""
    bars: list[tuple[str, list[float]]] = []
    for pic in pictures:
        for entry, e in pic["entries"].items():
            bars.append((f"{entry}\nN = {pic['world']}", [e["held"].get(k, 0) / 1e6 for k, _, _ in OWNERS]
                         + [e["step_peak"] / 1e6]))
    names = [name for _, name, _ in OWNERS] + ["step's transient peak (gathers, staging, activations, grads)"]
    colors = [color for _, _, color in OWNERS] + ["#e5e5e5"]
    fig, ax = plt.subplots(figsize=(11, 4.2), dpi=80)
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for j, (name, color) in enumerate(zip(names, colors)):
        vals = [v[j] for _, v in bars]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=color, edgecolor="black", lw=0.5, label=name,
                   hatch="//" if j == len(names) - 1 else None)
            bottom = [a + v for a, v in zip(bottom, vals)]
    for x in xs:
        ax.text(x, bottom[x] + 0.1, f"{bottom[x]:.2f}", ha="center", fontsize=8)
    ax.set_xticks(list(xs), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("MB per rank (10^6 bytes)")
    ax.set_ylim(0, 1.25 * max(bottom))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    fig.tight_layout()
    return fig
