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
p2p, so the gradients are exact, not those of a graph that forgot a message.

**Precision.** The inputs keep their dtype on the wire (bf16 K/V blocks: half the bytes), but the scores, the
running log-sum-exp, the output being merged, ``dQ`` and the travelling dK/dV accumulators are fp32 (fp64 for
fp64 inputs), as in FlashAttention's kernels, torch's context parallelism and ring-flash-attention. In bf16 a
log-sum-exp near 50 moves in steps of 0.25, so a bf16 running merge leaves softmax rows that do not sum to one
(measured at cp = 3, logits up to 50: output 4-22 % off full attention, dQ up to 77 %). Under ``torch.autocast``
:func:`ring_attention` first casts the inputs to autocast's dtype (what autocast does to
``F.scaled_dot_product_attention``'s), then runs the core with autocast off: its matmuls run on upcast copies,
and an fp32 score matmul under autocast would come back rounded to bf16. The backward re-enters the forward's
autocast state (:mod:`lslm.runtime.replay`, as ``torch.amp.custom_bwd`` does), off, so a backward called inside
an autocast still recomputes exactly the probabilities the forward computed, in fp32.

**Grouped-query attention.** ``k`` and ``v`` may have fewer heads than ``q`` (``H_kv`` dividing ``H``; query
head ``h`` reads key/value head ``h // (H / H_kv)``, the ``repeat_interleave`` convention of Llama and of
``F.scaled_dot_product_attention(enable_gqa=True)``). Only ``H_kv`` heads travel, ``H / H_kv`` times fewer bytes
than repeating them first; the scores broadcast each key/value head over its group of queries, and dK/dV sum
over the group.

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

__all__ = ["KV_LABEL", "DKV_LABEL", "accumulation_dtype", "block_pairs", "merge_partials", "ring_attention"]

KV_LABEL = "cp-ring-kv"
DKV_LABEL = "cp-ring-dkv"


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ring attention accumulates in for inputs of ``dtype``: fp32 for fp16/bf16/fp32, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # A row that has seen no key has lse = -inf; subtracting it from -inf scores gives NaN. Shifting such rows by
    # 0 instead makes every exp() of theirs exp(-inf) = 0: no weight, no NaN.
    return lse.masked_fill(lse == float("-inf"), 0.0)


def merge_partials(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint keys: ``(out, lse)`` and ``(block_out, block_lse)``.

    Each ``out`` is softmax attention over its own keys (rows ``(..., T, D)``) and each ``lse``
    the log-sum-exp of its scores (``(..., T)``). The merged ``lse`` is ``log(e^lse + e^block_lse)``
    taken as ``logaddexp`` (never exponentiating a raw score sum), and each output is rescaled
    by its share ``e^(lse − merged)`` <= 1. ``lse = −inf`` (nothing seen yet) contributes zero; a row
    where both are ``−inf`` (no visible key in either, as a document mask can make) stays ``0`` with
    ``lse = −inf``, not ``NaN``. Call it with ``out`` and ``lse`` in fp32: in bf16 the merge itself rounds.
    """
    merged = torch.logaddexp(lse, block_lse)
    shift = _finite(merged)
    new_out = out * torch.exp(lse - shift).unsqueeze(-1) + block_out * torch.exp(block_lse - shift).unsqueeze(-1)
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
    # q: (B, H_kv, G, c, D) and k: (B, H_kv, 1, c, D), both in the accumulation dtype: each key/value head
    # broadcasts over its G query heads, so grouped-query attention never materialises repeated keys.
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diagonal:  # equal chunks on the diagonal: key j is visible from query i when j <= i
        above = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _chunk(t: torch.Tensor, i: int, c: int) -> torch.Tensor:
    return t.narrow(-2, i * c, c)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of the matmul inputs: autocast's for ``t``'s device when it is on (it would cast attention's
    inputs so), else ``t``'s own. fp64 is left alone, as autocast leaves it."""
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type) and t.dtype != torch.float64:
        return torch.get_autocast_dtype(device_type)
    return t.dtype


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, H, T, D)`` -> ``(B, H_kv, H / H_kv, T, D)``: query head ``h`` in group ``h // (H / H_kv)``."""
    B, H, T, D = x.shape
    return x.reshape(B, kv_heads, H // kv_heads, T, D)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: CPGroup, causal: bool,
                layout: str) -> torch.Tensor:
        n, me = g.size, g.index
        acc = accumulation_dtype(q.dtype)
        c = q.shape[2] // len(chunk_ids(me, n, layout))
        scale = q.shape[-1] ** -0.5
        qa = _grouped(q.to(acc), k.shape[1])  # (B, H_kv, G, T_local, D): each K/V head serves G query heads
        out = torch.zeros_like(qa)
        lse = torch.full(qa.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # one message per step, contiguous, in the inputs' dtype
        for step in range(n):
            source = (me - step) % n
            works, incoming = [], None
            if step < n - 1:  # the next block travels while this one is computed
                incoming = torch.empty_like(kv)
                works = g.shift(kv, incoming, KV_LABEL)
            kva = kv.to(acc).unsqueeze(3)  # (2, B, H_kv, 1, T_local, D): scores, log-sum-exp and output in fp32
            for i, j, diagonal in block_pairs(me, source, n, layout, causal):
                s = _scores(_chunk(qa, i, c), _chunk(kva[0], j, c), scale, diagonal)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = torch.matmul(torch.exp(s - _finite(block_lse).unsqueeze(-1)), _chunk(kva[1], j, c))
                rows = slice(i * c, (i + 1) * c)
                out[..., rows, :], lse[..., rows] = merge_partials(out[..., rows, :], lse[..., rows], block_out,
                                                                   block_lse)
            for w in works:
                w.wait()
            if incoming is not None:
                kv = incoming
        out = out.reshape(q.shape).to(q.dtype)  # one rounding, at the end
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.g, fctx.causal, fctx.layout, fctx.c, fctx.scale = g, causal, layout, c, scale
        fctx.state = capture_forward_state(q.device, rng=False)  # its autocast (off), re-entered by the backward
        return out

    @staticmethod
    def backward(fctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        with fctx.state.autocast():  # off, as in the forward, even if the backward runs inside an autocast
            return _RingAttention._backward(fctx, dout)

    @staticmethod
    def _backward(fctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = fctx.saved_tensors
        g, causal, layout, c, scale = fctx.g, fctx.causal, fctx.layout, fctx.c, fctx.scale
        n, me = g.size, g.index
        acc, kv_heads = lse.dtype, k.shape[1]
        qa, doa = _grouped(q.to(acc), kv_heads), _grouped(dout.to(acc), kv_heads)
        delta = (doa * _grouped(out.to(acc), kv_heads)).sum(-1)  # rowsum(dO ∘ O): the softmax Jacobian's term
        shift = _finite(lse)
        dq = torch.zeros_like(qa)
        kv = torch.stack([k, v])
        in_flight: tuple[list[Any], torch.Tensor, torch.Tensor] | None = None  # (works, sent, received) dK/dV
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for step in range(n):
            source = (me - step) % n
            works, incoming = [], None
            if step < n - 1:
                incoming = torch.empty_like(kv)
                works = g.shift(kv, incoming, KV_LABEL)
            kva = kv.to(acc).unsqueeze(3)
            # this rank's share of dK/dV of ``source``'s block, summed over each group's query heads; it travels
            # in fp32, since it collects every rank's share on its way home
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            for i, j, diagonal in block_pairs(me, source, n, layout, causal):
                qi, doi, rows = _chunk(qa, i, c), _chunk(doa, i, c), slice(i * c, (i + 1) * c)
                kj, vj = _chunk(kva[0], j, c), _chunk(kva[1], j, c)
                p = torch.exp(_scores(qi, kj, scale, diagonal) - shift[..., rows].unsqueeze(-1))
                _chunk(dkv[1], j, c).add_(torch.matmul(p.transpose(-2, -1), doi).sum(2))
                ds = p * (torch.matmul(doi, vj.transpose(-2, -1)) - delta[..., rows].unsqueeze(-1))
                dq[..., rows, :] += torch.matmul(ds, kj) * scale
                _chunk(dkv[0], j, c).add_(torch.matmul(ds.transpose(-2, -1), qi).sum(2) * scale)
            if n > 1:
                if in_flight is not None:  # the accumulator of this block, from the ranks it visited before
                    for w in in_flight[0]:
                        w.wait()
                    dkv += in_flight[2]
                received = torch.empty_like(dkv)
                in_flight = (g.shift(dkv, received, DKV_LABEL), dkv, received)
            for w in works:
                w.wait()
            if incoming is not None:
                kv = incoming
        if in_flight is not None:  # after n steps every accumulator is back with its owner
            for w in in_flight[0]:
                w.wait()
            dkv = in_flight[2]
        return dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: CPGroup, causal: bool = True,
                   layout: str = "contiguous") -> torch.Tensor:
    """Softmax attention of this rank's queries over the keys/values of the whole ``cp`` group.

    ``q``: ``(B, H, T_local, D)``; ``k, v``: ``(B, H_kv, T_local, D)`` with ``H_kv`` dividing ``H`` (grouped-query
    attention; ``H_kv = H`` is multi-head), this rank's tokens in ``layout`` order (see
    :mod:`lslm.context_parallel.layout`); returns ``(B, H, T_local, D)``, equal to the matching rows of full
    attention (scale ``1/sqrt(D)``, causal mask over global positions when ``causal``, key/value head
    ``h // (H / H_kv)`` for query head ``h``), in the inputs' dtype (autocast's under autocast), computed in fp32.
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[::2] != k.shape[::2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q must be (B, H, T_local, D) and k, v (B, H_kv, T_local, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"grouped-query attention needs the {k.shape[1]} key/value heads to divide the "
                         f"{q.shape[1]} query heads (each key/value head serves H / H_kv query heads)")
    pieces = len(chunk_ids(g.index, g.size, layout))
    if q.shape[2] % pieces:
        raise ValueError(f"a zig-zag rank holds 2 equal chunks, but its local length is {q.shape[2]} (odd)")
    dtype = _compute_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # what autocast does to attention's inputs; else a no-op
    with torch.autocast(q.device.type, enabled=False):  # the core casts explicitly: an fp32 score matmul under
        return _RingAttention.apply(q, k, v, g, causal, layout)  # autocast would come back rounded to bf16
