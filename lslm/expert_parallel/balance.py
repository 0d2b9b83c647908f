"""Load balance and dropped tokens of every MoE layer after a forward, for a plot over training.

Per layer, from the counts the last forward kept (:attr:`MoE.stats`): assignments the router made
per expert (``routed``), those the capacity kept (``kept``), ``dropped`` and ``tokens``, summed over
the ep ranks when an :class:`~lslm.expert_parallel.group.EPGroup` is given (one all-reduce of the
integer counts through the ledger), and ``max_over_mean``: the busiest expert's routed load over the
mean (1.0 is perfect balance; the load-balancing loss pushes towards it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from lslm.expert_parallel.group import EPGroup
from lslm.expert_parallel.moe import moe_layers

__all__ = ["BALANCE_LABEL", "moe_balance"]

BALANCE_LABEL = "ep-balance"


def moe_balance(model: nn.Module, g: EPGroup | None = None, device: torch.device | None = None) -> list[dict[str, Any]]:
    """One dict per MoE layer of ``model`` (see the module doc); over the whole ep group if ``g`` is given."""
    layers = moe_layers(model)
    if not layers or not layers[0].stats:
        raise ValueError("no MoE layer has run a forward yet: call the model first")
    rows = [[*m.stats["routed"], *m.stats["per_expert"], m.stats["tokens"]] for m in layers]
    counts = torch.tensor(rows, dtype=torch.long, device=device)
    if g is not None and g.size > 1:
        g.comm.all_reduce(counts, group=g.group, label=BALANCE_LABEL)
    out = []
    for m, row in zip(layers, counts.tolist()):
        n = m.num_experts
        routed, kept = row[:n], row[n:2 * n]
        out.append({"routed": routed, "kept": kept, "dropped": sum(routed) - sum(kept), "tokens": row[-1],
                    "max_over_mean": max(routed) * n / sum(routed)})
    return out
