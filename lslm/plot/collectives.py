"""Figures of notebook 02 and ``lslm bench collectives``: bus bandwidth, and measured times against the fitted model.

One small panel per kind of collective, so that no panel holds more than four series
and no colour repeats within a panel: torch's call in black (measured only), each
lslm algorithm in its own colour, measured as dots and the fitted alpha-beta-gamma
model as a line of the same colour.
"""

from __future__ import annotations

import math
from statistics import median
from typing import Any

import matplotlib.pyplot as plt

from lslm.metrics.collective_costs import cost_coefficients, model_time

__all__ = ["fit_errors", "plot_collectives"]

_MIB = 1024 * 1024
_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
_FONT = 9


def fit_errors(result: dict[str, Any]) -> dict[str, float]:
    """Median relative error |model - measured| / measured of the fitted model, per kind of collective.

    ``result`` is one world size of :func:`lslm.bench.collectives.run` (``rows`` and ``fit``);
    only lslm's algorithms are fitted, so only they are scored. ``"all"`` is the median over every row.
    """
    errs: dict[str, list[float]] = {}
    for r in result["rows"]:
        if r["algorithm"].startswith("torch."):
            continue
        pred = model_time(result["fit"], r["algorithm"], r["world_size"], r["bytes"])
        errs.setdefault(r["kind"], []).append(abs(pred - r["time_s"]) / r["time_s"])
    out = {k: median(v) for k, v in errs.items()}
    out["all"] = median([e for v in errs.values() for e in v])
    return out


def _by_algorithm(rows: list[dict[str, Any]], kind: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: r["bytes"]):
        if r["kind"] == kind:
            out.setdefault(r["algorithm"], []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].startswith("torch."), kv[0])))  # torch first


_MARKERS = ("o", "^", "D", "v")


def _style(name: str, lslm_index: int) -> dict[str, Any]:
    if name.startswith("torch."):
        return {"color": "black", "marker": "s", "ms": 5}
    return {"color": _COLOURS[lslm_index % len(_COLOURS)], "marker": _MARKERS[lslm_index % len(_MARKERS)], "ms": 6}


def _busbw_panel(ax: Any, rows: list[dict[str, Any]], n: int, backend: str) -> None:
    i = 0
    for name, pts in _by_algorithm(rows, "all_reduce").items():
        style = _style(name, i)
        i += 0 if name.startswith("torch.") else 1
        ax.plot([p["bytes"] / _MIB for p in pts], [p["busbw_GBps"] for p in pts], label=name,
                lw=2.2 if name.startswith("torch.") else 1.4, **style)
    ax.set_xscale("log")
    ax.set_xlabel("message size (MiB)", fontsize=_FONT)
    ax.set_ylabel("bus bandwidth (GB/s)", fontsize=_FONT)
    ax.set_title(f"all-reduce bus bandwidth, {n} processes ({backend})", fontsize=_FONT + 1)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.6)  # head-room: the legend covers no data point
    ax.legend(fontsize=8, loc="upper left")


def _kind_panel(ax: Any, result: dict[str, Any], kind: str, n: int, err: float) -> None:
    from matplotlib.lines import Line2D

    fit, i, handles = result["fit"], 0, []
    seen: dict[tuple[float, float, float], str] = {}  # model coefficients already drawn -> by whom
    for name, pts in _by_algorithm(result["rows"], kind).items():
        xs = [p["bytes"] / _MIB for p in pts]
        style = _style(name, i)
        ax.plot(xs, [p["time_s"] * 1e3 for p in pts], ls="none", **style)
        if name.startswith("torch."):
            ax.plot(xs, [p["time_s"] * 1e3 for p in pts], ls="--", lw=1, color="black")
            handles.append(Line2D([], [], ls="--", lw=1, label=f"{name} (measured only)", **style))
            continue
        i += 1
        same = seen.setdefault(cost_coefficients(name, n), name)
        # An algorithm whose model equals one already drawn (tree = flat broadcast on 2 ranks) gets a dashed
        # line over the solid one, and says so, so that neither hides the other.
        ls = "-" if same == name else (0, (4, 3))
        ax.plot(xs, [model_time(fit, name, n, p["bytes"]) * 1e3 for p in pts], ls=ls, lw=1.4, color=style["color"])
        label = name if same == name else f"{name} (dashed: same model)"
        handles.append(Line2D([], [], ls=ls, lw=1.4, label=label, **style))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size (MiB)", fontsize=_FONT)
    ax.set_ylabel("time (ms)", fontsize=_FONT)
    ax.set_title(f"{kind}, {n} processes: model median |error| {100 * err:.0f}%", fontsize=_FONT + 1)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * (hi / lo) ** 0.7)  # head-room on the log axis: the legend covers no data point
    ax.legend(handles=handles, fontsize=8, loc="upper left")


def plot_collectives(results: dict[int, dict[str, Any]], ncols: int = 3) -> Any:
    """Per world size: all-reduce bus bandwidth, then one panel per collective (measured vs model).

    ``results`` maps world size to :func:`lslm.bench.collectives.run`'s record (``rows``,
    ``fit``, ``backend``). Each world size starts a new row of panels; its fitted constants
    and the model's median error head the first panel's row. Returns the figure.
    """
    layout: list[tuple[int, str]] = []  # (world size, "busbw" or a kind), one per panel
    rows_per_world: dict[int, int] = {}
    for n in sorted(results):
        kinds = list(dict.fromkeys(r["kind"] for r in results[n]["rows"]))
        panels = (["busbw"] if "all_reduce" in kinds else []) + kinds
        rows_per_world[n] = math.ceil(len(panels) / ncols)
        layout += [(n, p) for p in panels] + [(n, "")] * (rows_per_world[n] * ncols - len(panels))
    nrows = sum(rows_per_world.values())
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.7 * nrows), dpi=80, squeeze=False)
    for ax, (n, panel) in zip(axes.flat, layout):
        res = results[n]
        if not panel:
            ax.axis("off")
        elif panel == "busbw":
            _busbw_panel(ax, res["rows"], n, res.get("backend", "gloo"))
        else:
            _kind_panel(ax, res, panel, n, fit_errors(res)[panel])
    fits = [f"{n} processes: alpha = {r['fit']['alpha_s'] * 1e6:.0f} us, 1/beta = {r['fit']['bandwidth_GBps']:.2f} "
            f"GB/s, gamma = {r['fit']['gamma_s_per_byte'] * 1e9:.2f} ns/B, median |error| "
            f"{100 * fit_errors(r)['all']:.0f}%" for n, r in sorted(results.items())]
    lines = ["Markers: measured (torch: black squares). Lines: the fitted alpha-beta-gamma model.", *fits]
    fig.suptitle("\n".join(lines), fontsize=_FONT + 1)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.2 * len(lines) / (3.7 * nrows)))  # room for the title lines
    return fig
