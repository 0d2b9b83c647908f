"""The fused ``[q | k | v]`` projection and tensor parallelism: which rows each rank must hold.

GPT-2's ``c_attn`` computes q, k and v with one matmul; its output columns are laid out
``[q heads 0..H-1 | k heads 0..H-1 | v heads 0..H-1]``. Sharding that weight by
contiguous output rows (what a plain column split does) gives rank 0 of two ranks all of
q and half of k: its local ``chunk(3)`` would then call q-rows "k". A rank that owns
heads ``[r*H/t, (r+1)*H/t)`` must instead hold the q, k and v rows of exactly those
heads, in the order ``[q_r | k_r | v_r]``, so the model's unchanged ``chunk(3)`` splits
its local output correctly. :func:`qkv_rows` names those rows; permuting the full
weight by :func:`qkv_permutation` makes every rank's share contiguous, so the same
permutation also prepares the weight for a contiguous split (DTensor's ``ColwiseParallel``).
"""

from __future__ import annotations

import torch

__all__ = ["qkv_permutation", "qkv_rows"]


def _check(n_embd: int, n_head: int, tp: int) -> None:
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
    if n_head % tp:
        raise ValueError(f"n_head={n_head} attention heads cannot be split over tp={tp} ranks "
                         f"(each rank needs whole heads); choose tp dividing {n_head}")


def qkv_rows(n_embd: int, n_head: int, tp: int, tp_rank: int) -> torch.Tensor:
    """Indices of the rows of a fused ``[q|k|v]`` weight (shape ``(3*n_embd, n_embd)``) that rank ``tp_rank`` holds.

    Order ``[q heads of this rank | k heads | v heads]``; each head is ``n_embd // n_head``
    consecutive rows. Raises ``ValueError`` if the heads do not divide over ``tp``.
    """
    _check(n_embd, n_head, tp)
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank={tp_rank} is outside [0, {tp})")
    width = n_embd // tp  # rows of one of q, k, v on one rank: its heads times head_dim
    start = tp_rank * width
    # lslm: cpu-ok (row indices; shard_rows moves them to the weight's device)
    return torch.cat([torch.arange(part * n_embd + start, part * n_embd + start + width)  # lslm: cpu-ok (indices)
                      for part in range(3)])


def qkv_permutation(n_embd: int, n_head: int, tp: int) -> torch.Tensor:
    """A permutation of the ``3*n_embd`` fused rows after which rank r's rows are block ``r`` of ``tp`` equal blocks.

    ``weight[qkv_permutation(...)]`` (and the bias the same way) can then be split
    contiguously over ``tp`` ranks, as ``torch.chunk`` / DTensor ``Shard(0)`` do.
    """
    return torch.cat([qkv_rows(n_embd, n_head, tp, r) for r in range(tp)])
