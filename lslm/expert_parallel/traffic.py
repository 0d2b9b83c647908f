"""Bytes per rank that one expert-parallel MoE layer moves, forward and backward, as the ledger records them.

Rank r dispatches ``sent_r`` token rows (its kept assignments, one row per (token, expert) pair,
the rows for its own experts included) and receives ``received_r`` (the assignments every rank
made to r's experts). A row is ``hidden · element_size`` bytes. The ledger records each
all-to-all's whole input on the rank that hands it over, so per layer:

* forward: the counts (``E`` int64), the dispatch (``sent_r`` rows) and the combine, which sends
  back the outputs of the rows it received (``received_r`` rows):
  ``8·E + (sent_r + received_r) · hidden · element_size``;
* backward: the combine's reverse (``sent_r`` gradient rows) and the dispatch's (``received_r``),
  no count exchange: ``(sent_r + received_r) · hidden · element_size``.

Summed over the ranks ``Σ sent = Σ received`` = the assignments dispatched, so the whole layer
moves ``dispatched × hidden × element_size × 2 directions`` each way (plus the counts).
With ep = 1 nothing is sent and the ledger records nothing.
"""

from __future__ import annotations

import torch

__all__ = ["ep_traffic", "rows_per_rank"]

COUNT_BYTES = 8  # the counts travel as int64


def rows_per_rank(per_expert: torch.Tensor) -> tuple[list[int], list[int]]:
    """``per_expert`` ``(ep, E)``: kept assignments of rank r's tokens per expert -> (sent, received) rows per rank."""
    ep, n_exp = per_expert.shape
    if n_exp % ep:
        raise ValueError(f"num_experts = {n_exp} is not divisible by ep = {ep}")
    sent = per_expert.sum(1).tolist()
    received = per_expert.view(ep, ep, n_exp // ep).sum((0, 2)).tolist()  # column block r: rank r's experts
    return sent, received


def ep_traffic(sent: int, received: int, hidden: int, num_experts: int, ep: int,
               element_size: int = 4) -> dict[str, int]:
    """Ledger bytes of one rank for one MoE layer: ``forward`` and ``backward`` (see the module doc)."""
    if ep == 1:
        return {"forward": 0, "backward": 0, "rows": 0}
    rows = (sent + received) * hidden * element_size
    return {"forward": COUNT_BYTES * num_experts + rows, "backward": rows, "rows": rows}
