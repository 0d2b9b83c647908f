"""Notebook 10's progressive-layer-dropping figure: held-out loss against tokens and against training time,
baseline and PLD, and PLD's keep ratio and blocks run per step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import matplotlib.pyplot as plt

__all__ = ["plot_pld_curves"]

COLOURS = {"baseline": "#444444", "pld": "#d62828"}
LABELS = {"baseline": "baseline (every block)", "pld": "progressive layer dropping"}


def plot_pld_curves(data: Mapping[str, Any], *, title: str | None = None) -> plt.Figure:
    """Three panels from :func:`lslm.demos.pld.pld_run`'s records: held-out loss vs tokens, held-out loss vs
    training seconds (evaluation excluded), and PLD's ``theta(t)`` and blocks run per step."""
    runs = data["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=80)
    target = data.get("summary", {}).get("target_loss")
    for name, run in runs.items():
        ev = run["evals"]
        for ax, key in ((axes[0], "tokens"), (axes[1], "wall_s")):
            ax.plot([e[key] for e in ev], [e["loss"] for e in ev], "o-", ms=3, color=COLOURS.get(name),
                    label=LABELS.get(name, name))
    for ax in axes[:2]:
        if target is not None:
            ax.axhline(target, color="#888888", ls=":", lw=1, label=f"target {target:.3f}")
        ax.set_ylabel("held-out loss (nats/token, all blocks)")
        ax.legend(fontsize=8)
    axes[0].set_xlabel("training tokens")
    axes[1].set_xlabel("training time (s, evaluation excluded)")
    steps = runs["pld"]["steps"]
    n_layer = data["config"]["n_layer"]
    axes[2].plot([s["step"] for s in steps], [s["blocks"] for s in steps], ".", ms=3, color=COLOURS["pld"],
                 label="blocks run (PLD)")
    axes[2].plot([s["step"] for s in steps], [n_layer * s["theta"] for s in steps], "-", color="#1d3557",
                 label="L x theta(t)")
    # Expected blocks run: sum_l p_l = L - (L + 1) / 2 (1 - theta)
    axes[2].plot([s["step"] for s in steps], [n_layer - (n_layer + 1) / 2 * (1 - s["theta"]) for s in steps], "--",
                 color="#457b9d", label="expected blocks run")
    axes[2].set_xlabel("training step")
    axes[2].set_ylabel(f"blocks (of {n_layer})")
    axes[2].set_ylim(0, n_layer + 0.5)
    axes[2].legend(fontsize=8, loc="lower left")
    fig.suptitle(title or "Progressive layer dropping vs baseline: the same GPT, data and learning rate",
                 fontsize=10)
    fig.tight_layout()
    return fig
