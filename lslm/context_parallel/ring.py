"""Ring attention over the ``cp`` group (Liu et al. 2023, "Ring Attention with Blockwise Transformers"), exact.

Each rank keeps its query block and passes its key/value block around the ring: at step
``s`` it holds the block of cp rank ``index − s`` and, while that block's attention is
computed, the next block is already travelling (one ``batch_isend_irecv`` through the
ledger, every Work waited on before the buffer is read or reused). Partial results are merged
with a numerically stable log-sum-exp (:func:`merge_partials`, the online softmax of
Milakov and Gimelshein 2018 that FlashAttention uses), so the result equals softmax attention
over the whole sequence.

Causal masking works on equal chunks (:mod:`lslm.context_parallel.layout`): a (query chunk,
key chunk) pair whose keys all come after its queries is skipped, a pair on the diagonal is
masked to its lower triangle, every other pair is computed whole. With the zig-zag layout
this spreads the work evenly.

The backward pass is written out (FlashAttention-2's, Dao 2023, Algorithm 2, blockwise): from
the saved output and log-sum-exp it recomputes each block's probabilities, accumulates ``dQ``
locally, and accumulates ``dK``/``dV`` into a buffer that travels around the ring with the
key/value block and arrives back at its owner after the last step. Autograd never sees the
p2p, so the gradients are exact, not those of a graph that forgot a message. The backward runs under the
forward's autocast (:mod:`lslm.runtime.replay`, as ``torch.amp.custom_bwd`` does): the probabilities it
recomputes are then those the forward computed, in the same precision.

Checked against full single-process attention (``F.scaled_dot_product_attention``), output and
gradients, in tests/test_context_parallel.py. torch's own ``context_parallel``
(``torch.distributed.tensor.experimental``) does not run on CPU in torch 2.13, so it is not the
reference here: it swaps only the CUDA attention kernels (flash, memory-efficient and cuDNN
``aten._scaled_dot_product_*``, forward and backward) for ring versions and raises
``NotImplementedError`` for any other (``_context_parallel/_attention.py``), and the CPU path
dispatches to none of them.
"""

from __future__ import annotations

from typing import Any

import torch

from lslm.context_parallel.group import CPGroup
from lslm.context_parallel.layout import chunk_ids
from lslm.runtime.replay import capture_forward_state

__all__ = ["KV_LABEL", "DKV_LABEL", "block_pairs", "merge_partials", "ring_attention"]

KV_LABEL = "cp-ring-kv"
DKV_LABEL = "cp-ring-dkv"


def merge_partials(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint keys: ``(out, lse)`` and ``(block_out, block_lse)``.

    Each ``out`` is softmax attention over its own keys (rows ``(..., T, D)``) and each ``lse``
    the log-sum-exp of its scores (``(..., T)``). The merged ``lse`` is ``log(e^lse + e^block_lse)``
    taken as ``logaddexp`` (never exponentiating a raw score sum), and each output is rescaled
    by its share ``e^(lse − merged)`` <= 1. ``lse = −inf`` (nothing seen yet) contributes zero.
    """
    merged = torch.logaddexp(lse, block_lse)
    new_out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
    return new_out, merged


def block_pairs(my_index: int, source: int, cp: int, layout: str, causal: bool) -> list[tuple[int, int, bool]]:
    """The (local query chunk, local key chunk, diagonal?) products this rank computes for ``source``'s block.

    Pairs whose keys all lie after their queries (causal) are left out: they are fully masked.
    """
    pairs = []
    for i, qc in enumerate(chunk_ids(my_index, cp, layout)):
        for j, kc in enumerate(chunk_ids(source, cp, layout)):
            if not causal or kc < qc:
                pairs.append((i, j, False))
            elif kc == qc:
                pairs.append((i, j, True))
    return pairs


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diagonal:  # equal chunks on the diagonal: key j is visible from query i when j <= i
        above = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _chunk(t: torch.Tensor, i: int, c: int) -> torch.Tensor:
    return t.narrow(2, i * c, c)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: CPGroup, causal: bool,
                layout: str) -> torch.Tensor:
        n, me = g.size, g.index
        c = q.shape[2] // len(chunk_ids(me, n, layout))
        scale = q.shape[-1] ** -0.5
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])  # one message per step, contiguous
        for step in range(n):
            source = (me - step) % n
            works, incoming = [], None
            if step < n - 1:  # the next block travels while this one is computed
                incoming = torch.empty_like(kv)
                works = g.shift(kv, incoming, KV_LABEL)
            for i, j, diagonal in block_pairs(me, source, n, layout, causal):
                s = _scores(_chunk(q, i, c), _chunk(kv[0], j, c), scale, diagonal)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = torch.matmul(torch.exp(s - block_lse.unsqueeze(-1)), _chunk(kv[1], j, c))
                rows = slice(i * c, (i + 1) * c)
                out[:, :, rows], lse[:, :, rows] = merge_partials(out[:, :, rows], lse[:, :, rows], block_out,
                                                                  block_lse)
            for w in works:
                w.wait()
            if incoming is not None:
                kv = incoming
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.g, fctx.causal, fctx.layout, fctx.c, fctx.scale = g, causal, layout, c, scale
        fctx.state = capture_forward_state(q.device, rng=False)  # its autocast, re-entered by the backward
        return out

    @staticmethod
    def backward(fctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        with fctx.state.autocast():
            return _RingAttention._backward(fctx, dout)

    @staticmethod
    def _backward(fctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = fctx.saved_tensors
        g, causal, layout, c, scale = fctx.g, fctx.causal, fctx.layout, fctx.c, fctx.scale
        n, me = g.size, g.index
        delta = (dout * out).sum(-1)  # rowsum(dO ∘ O): the softmax Jacobian's correction term
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        in_flight: tuple[list[Any], torch.Tensor, torch.Tensor] | None = None  # (works, sent, received) dK/dV
        dkv = torch.zeros_like(kv)
        for step in range(n):
            source = (me - step) % n
            works, incoming = [], None
            if step < n - 1:
                incoming = torch.empty_like(kv)
                works = g.shift(kv, incoming, KV_LABEL)
            dkv = torch.zeros_like(kv)  # this rank's share of dK/dV of ``source``'s block
            for i, j, diagonal in block_pairs(me, source, n, layout, causal):
                qi, doi, rows = _chunk(q, i, c), _chunk(dout, i, c), slice(i * c, (i + 1) * c)
                kj, vj = _chunk(kv[0], j, c), _chunk(kv[1], j, c)
                p = torch.exp(_scores(qi, kj, scale, diagonal) - lse[:, :, rows].unsqueeze(-1))
                _chunk(dkv[1], j, c).add_(torch.matmul(p.transpose(-2, -1), doi))
                ds = p * (torch.matmul(doi, vj.transpose(-2, -1)) - delta[:, :, rows].unsqueeze(-1))
                dq[:, :, rows] += torch.matmul(ds, kj) * scale
                _chunk(dkv[0], j, c).add_(torch.matmul(ds.transpose(-2, -1), qi) * scale)
            if n > 1:
                if in_flight is not None:  # the accumulator of this block, from the ranks it visited before
                    for w in in_flight[0]:
                        w.wait()
                    dkv += in_flight[2]
                received = torch.empty_like(kv)
                in_flight = (g.shift(dkv, received, DKV_LABEL), dkv, received)
            for w in works:
                w.wait()
            if incoming is not None:
                kv = incoming
        if in_flight is not None:  # after n steps every accumulator is back with its owner
            for w in in_flight[0]:
                w.wait()
            dkv = in_flight[2]
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: CPGroup, causal: bool = True,
                   layout: str = "contiguous") -> torch.Tensor:
    """Softmax attention of this rank's queries over the keys/values of the whole ``cp`` group.

    ``q, k, v``: ``(B, H, T_local, D)``, this rank's tokens in ``layout`` order (see
    :mod:`lslm.context_parallel.layout`); returns ``(B, H, T_local, D)``, equal to the matching
    rows of full attention (scale ``1/sqrt(D)``, causal mask over global positions when ``causal``).
    """
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k, v must share one (B, H, T_local, D) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    pieces = len(chunk_ids(g.index, g.size, layout))
    if q.shape[2] % pieces:
        raise ValueError(f"a zig-zag rank holds 2 equal chunks, but its local length is {q.shape[2]} (odd)")
    return _RingAttention.apply(q, k, v, g, causal, layout)
