"""Ulysses context parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses, Section 3): all-to-all around attention.

Outside attention every rank holds a slice of the sequence and all heads. One all-to-all
(q, k and v together) turns that into the whole sequence for ``H / cp`` heads; attention
runs locally, per head, exactly as in one process; a second all-to-all turns the output back
into a slice of the sequence for all heads. Each all-to-all is an autograd function whose
backward is the opposite all-to-all, so the gradients travel the same two ways.

The constraint: the heads are divided among the ranks, so ``H`` must be divisible by ``cp``
(:func:`ulysses_attention` raises ``ValueError`` otherwise). Traffic per rank does not grow
with ``cp`` at fixed sequence length (compare :func:`lslm.context_parallel.traffic.cp_traffic`).

**Grouped-query attention** (``H_kv < H`` key/value heads): rank ``j`` receives query heads
``j·H/cp ...`` and the key/value heads they read, ``j·H_kv/cp ...``, in the same all-to-all (each rank's
share of q, k and v packed together), so ``H_kv`` must be divisible by ``cp`` too. Below that
(``H_kv < cp``, e.g. Llama-3-8B's 8 key/value heads at cp = 16) lslm refuses, with a ``ValueError``,
rather than replicating key/value heads: replication would send ``cp / H_kv`` copies of each
through the all-to-all (and sum their gradients back), giving up exactly the bytes GQA saves, while
ring attention, with no head constraint, sends only the ``H_kv`` heads; lslm's calculator
(:func:`lslm.plan.check_layout`) draws the same line.

With the zig-zag layout the gathered sequence comes in rank order, not position order: it is
put back in position order before attention (one index_select) and returned after.

Checked against full single-process attention in tests/test_context_parallel.py (torch's own
``context_parallel`` does not run on CPU in torch 2.13).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lslm.context_parallel.group import CPGroup
from lslm.context_parallel.layout import local_positions

__all__ = ["A2A_LABEL", "check_heads", "head_to_seq", "seq_to_head", "ulysses_attention"]

A2A_LABEL = "cp-ulysses"


def check_heads(n_head: int, cp: int, kv_heads: int | None = None) -> None:
    """Refuse a head count Ulysses cannot split over ``cp`` ranks (``kv_heads``: key/value heads, GQA)."""
    if n_head % cp:
        raise ValueError(f"Ulysses splits the heads over the cp ranks: n_head = {n_head} is not divisible by "
                         f"cp = {cp}; use a cp that divides {n_head}, or ring attention (no such constraint)")
    if kv_heads is not None and (kv_heads < 1 or n_head % kv_heads):
        raise ValueError(f"grouped-query attention needs the kv_heads = {kv_heads} key/value heads to divide the "
                         f"n_head = {n_head} query heads")
    if kv_heads is not None and kv_heads % cp:
        raise ValueError(f"Ulysses splits the key/value heads over the cp ranks too: kv_heads = {kv_heads} is not "
                         f"divisible by cp = {cp}; lslm does not replicate key/value heads (it would send cp / "
                         f"kv_heads copies of each, the bytes GQA saves): use a cp that divides {kv_heads}, or ring "
                         "attention (no head constraint)")


def _all_to_all(send: torch.Tensor, g: CPGroup) -> torch.Tensor:
    if g.size == 1:  # nothing to exchange: the ledger records no message that never left
        return send
    recv = torch.empty_like(send)
    g.comm.all_to_all_single(recv, send, group=g.group, label=A2A_LABEL)
    return recv


def _seq_to_head(x: torch.Tensor, g: CPGroup) -> torch.Tensor:
    # (*lead, H, Tl, D) -> chunk j (heads j·H/n ...) to rank j -> (*lead, H/n, n·Tl, D), sequence in rank order
    n, lead = g.size, x.shape[:-3]
    H, Tl, D = x.shape[-3:]
    send = x.reshape(*lead, n, H // n, Tl, D).movedim(len(lead), 0).contiguous()
    return _all_to_all(send, g).movedim(0, -3).reshape(*lead, H // n, n * Tl, D)


def _head_to_seq(y: torch.Tensor, g: CPGroup) -> torch.Tensor:
    # (*lead, H/n, n·Tl, D) -> rank i's tokens to rank i -> (*lead, H, Tl, D)
    n, lead = g.size, y.shape[:-3]
    h, T, D = y.shape[-3:]
    send = y.reshape(*lead, h, n, T // n, D).movedim(-3, 0).contiguous()
    return _all_to_all(send, g).movedim(0, len(lead)).reshape(*lead, n * h, T // n, D)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, g: CPGroup) -> torch.Tensor:
        fctx.g = g
        return _seq_to_head(x, g)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _head_to_seq(grad, fctx.g), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, y: torch.Tensor, g: CPGroup) -> torch.Tensor:
        fctx.g = g
        return _head_to_seq(y, g)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _seq_to_head(grad, fctx.g), None


def seq_to_head(x: torch.Tensor, g: CPGroup) -> torch.Tensor:
    """``(*lead, H, T_local, D)`` sequence-sharded -> ``(*lead, H/cp, T, D)`` head-sharded (differentiable)."""
    return _SeqToHead.apply(x, g)


def head_to_seq(y: torch.Tensor, g: CPGroup) -> torch.Tensor:
    """``(*lead, H/cp, T, D)`` head-sharded -> ``(*lead, H, T_local, D)`` sequence-sharded (differentiable)."""
    return _HeadToSeq.apply(y, g)


def _pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    # (B, H, Tl, D), (B, H_kv, Tl, D) x 2 -> (B, H + 2 H_kv, Tl, D) whose j-th 1/n of the heads is rank j's share:
    # its H/n query heads, then its H_kv/n key heads, then its H_kv/n value heads (one all-to-all carries all three)
    B, _, Tl, D = q.shape
    parts = [t.reshape(B, n, t.shape[1] // n, Tl, D) for t in (q, k, v)]
    return torch.cat(parts, dim=2).reshape(B, -1, Tl, D)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: CPGroup, causal: bool = True,
                      layout: str = "contiguous") -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence by two all-to-alls (see the module doc).

    ``q``: ``(B, H, T_local, D)``; ``k, v``: ``(B, H_kv, T_local, D)`` with ``H_kv`` dividing ``H`` (query head
    ``h`` reads key/value head ``h // (H / H_kv)``); all in ``layout`` order; returns ``(B, H, T_local, D)``.
    ``H`` and ``H_kv`` must both be divisible by ``cp`` (:func:`check_heads`).
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[::2] != k.shape[::2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q must be (B, H, T_local, D) and k, v (B, H_kv, T_local, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    n, H, H_kv = g.size, q.shape[1], k.shape[1]
    check_heads(H, n, H_kv)
    qkv = seq_to_head(_pack(q, k, v, n), g)  # one all-to-all for the three: (B, (H + 2 H_kv) / n, T, D)
    order = None
    if layout != "contiguous" and n > 1:
        T = q.shape[2] * n
        gathered = torch.cat([local_positions(T, n, r, layout, device=q.device) for r in range(n)])
        order = gathered  # gathered index i holds position order[i]
        qkv = qkv.index_select(-2, torch.argsort(gathered))  # position order
    ql, kl, vl = qkv.split([H // n, H_kv // n, H_kv // n], dim=1)
    y = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal, enable_gqa=H_kv != H)
    if order is not None:
        y = y.index_select(-2, order)  # back to the order the all-to-all gathered
    return head_to_seq(y, g)
