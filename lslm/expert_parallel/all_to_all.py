"""Uneven all-to-all through the ledger: the split sizes first, then the rows, and its autograd reverse.

Each rank sends a different number of token rows to each other rank (as many as its tokens
chose that rank's experts), so the receivers must learn how many rows arrive before the
rows do: :func:`exchange_counts` all-to-alls the per-expert counts (one integer per expert,
on the data's device), then :func:`all_to_all_rows` moves the rows with
``all_to_all_single(input_split_sizes=..., output_split_sizes=...)``. Its backward is the same
all-to-all with the two split lists swapped: each gradient row goes back where its row came from.
"""

from __future__ import annotations

from typing import Any

import torch

from lslm.expert_parallel.group import EPGroup

__all__ = ["COUNTS_LABEL", "all_to_all_rows", "exchange_counts"]

COUNTS_LABEL = "ep-counts"


def exchange_counts(per_expert: torch.Tensor, g: EPGroup) -> torch.Tensor:
    """``(E,)`` kept assignments per expert from this rank -> ``(ep, E / ep)``: row s = what rank s sends my experts."""
    send = per_expert.contiguous()
    if g.size == 1:
        return send.view(1, -1)
    recv = torch.empty_like(send)
    g.comm.all_to_all_single(recv, send, group=g.group, label=COUNTS_LABEL)
    return recv.view(g.size, -1)


def _rows(x: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], g: EPGroup,
          label: str) -> torch.Tensor:
    if g.size == 1:  # nothing leaves the rank: no record of a message that never left
        return x
    out = x.new_empty((out_rows, *x.shape[1:]))
    g.comm.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                             group=g.group, label=label)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], g: EPGroup,
                label: str) -> torch.Tensor:
        fctx.args = (x.shape[0], in_splits, out_splits, g, label)
        return _rows(x, sum(out_splits), out_splits, in_splits, g, label)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, out_splits, in_splits, g, label = fctx.args  # swapped: the gradients go back
        return _rows(grad, rows, out_splits, in_splits, g, label), None, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], g: EPGroup,
                    label: str) -> torch.Tensor:
    """Send ``in_splits[j]`` rows of ``x`` (in order) to ep rank j, get ``out_splits[s]`` from rank s (autograd)."""
    if len(out_splits) != g.size or len(in_splits) != g.size or sum(in_splits) != x.shape[0]:
        raise ValueError(f"split sizes {in_splits} -> {out_splits} do not fit {x.shape[0]} rows over ep = {g.size}")
    return _AllToAllRows.apply(x, out_splits, in_splits, g, label)
