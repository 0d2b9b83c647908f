"""Notebook 10's opening figure: activation memory per device against sequence length, TP+SP alone and with cp."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from lslm.plan.long_context import activation_vs_sequence

__all__ = ["plot_activation_vs_sequence"]


def plot_activation_vs_sequence(rows: Sequence[dict[str, Any]] | None = None, *, title: str | None = None) -> Figure:
    """Activations per device (GB, log scale) against tokens per sequence (log 2), one line per ``cp``, and the
    room the device leaves for them (usable memory minus the model states, which ``cp`` does not divide).

    ``rows``: :func:`lslm.plan.long_context.activation_vs_sequence`'s (default: Llama-3 8B, tp = 8 with SP, on
    H100 80 GB, cp = 1, 2, 4, 8). Returns the figure (not shown: the notebook displays it).
    """
    rows = list(rows) if rows is not None else activation_vs_sequence()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=80)
    for cp in sorted({r["cp"] for r in rows}):
        mine = sorted((r for r in rows if r["cp"] == cp), key=lambda r: r["seq_len"])
        label = "TP+SP alone (cp = 1)" if cp == 1 else f"TP+SP + cp = {cp} ({mine[0]['devices']} devices)"
        ax.plot([r["seq_len"] for r in mine], [r["activations_bytes"] / 1e9 for r in mine], "o-", label=label)
    room = (rows[0]["usable_bytes"] - rows[0]["states_bytes"]) / 1e9
    ax.axhline(room, color="k", ls="--", lw=1, label=f"room for activations: usable - model states = {room:.1f} GB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    seqs = sorted({r["seq_len"] for r in rows})
    ax.set_xticks(seqs, [f"{s // 1024}k" for s in seqs])
    ax.set_xlabel("sequence length (tokens, one sequence per step)")
    ax.set_ylabel("activations per device (GB, 1e9 B)")
    first = rows[0]
    ax.set_title(title or f"Why long sequences break TP+SP alone: {first['model']}, tp = {first['tp']} with SP, "
                          f"{first['hardware']}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig
