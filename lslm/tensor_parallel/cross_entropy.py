"""Cross-entropy over a vocabulary split across ranks, without ever building the full logits on one rank.

A column-parallel output head leaves rank r the logits of its vocabulary slice
``[start, end)``: shape ``(N, V/t)``. The loss of token n with target y is
``log sum_v exp(z_v) - z_y``; both terms are sums over the whole vocabulary, and each
decomposes into per-rank pieces (Megatron-LM's ``_VocabParallelCrossEntropy``;
Shoeybi et al. 2019, Section 3, last paragraph):

1. ``m = max_v z_v``: local max, all-reduce MAX (for a stable exponent);
2. ``z_y - m``: the one rank that owns y contributes it, the others 0; all-reduce SUM;
3. ``sum_v exp(z_v - m)``: local sums, all-reduce SUM.

Three all-reduces of ``N`` numbers each, instead of an all-gather of ``N x V``. The
backward needs no communication: ``dL/dz_v = softmax(z)_v - [v = y]``, and each rank has
its own slice of the softmax from step 3. Logit columns at or past ``vocab_size`` (the
padding of :mod:`lslm.tensor_parallel.vocab`) are set to ``-inf`` so they take no
probability and get zero gradient. Targets equal to ``ignore_index`` give loss 0 and no
gradient, and the mean is over the other tokens, as in ``F.cross_entropy``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.mappings import gather_from_tensor_parallel_region

__all__ = ["CE_LABEL", "gather_logits", "vocab_parallel_cross_entropy", "vocab_parallel_token_losses"]

#: Ledger label prefix of the loss's three all-reduces.
CE_LABEL = "vocab-parallel-ce"


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(fn: Any, logits: torch.Tensor, targets: torch.Tensor, pctx: ParallelContext, vocab_size: int,
                ignore_index: int) -> torch.Tensor:
        n_local = logits.shape[-1]
        start = pctx.tp_rank * n_local
        z = logits.float()  # the softmax in fp32 whatever the logits' dtype
        if start + n_local > vocab_size:  # this rank holds padding columns: they take no probability
            z = z.clone()
            z[..., max(vocab_size - start, 0):] = float("-inf")
        group, comm = pctx.tp_group, pctx.comm
        zmax = z.max(dim=-1).values
        if pctx.tp_size > 1:
            comm.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group, label=f"{CE_LABEL} max")
        z = z - zmax.unsqueeze(-1)
        ignored = targets == ignore_index
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < n_local) & ~ignored
        idx = local_t.clamp(0, n_local - 1).unsqueeze(-1)
        target_logit = z.gather(-1, idx).squeeze(-1).masked_fill(~mine, 0.0)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        if pctx.tp_size > 1:
            # Both sums travel in one all-reduce: the same volume as two, one latency.
            both = torch.stack([target_logit, sum_exp])
            comm.all_reduce(both, group=group, label=f"{CE_LABEL} target+sumexp")
            target_logit, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        fn.save_for_backward(softmax, idx, mine, ignored)
        fn.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(fn: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        softmax, idx, mine, ignored = fn.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * ~ignored).unsqueeze(-1))
        return grad.to(fn.in_dtype), None, None, None, None


def vocab_parallel_token_losses(logits: torch.Tensor, targets: torch.Tensor, pctx: ParallelContext, *,
                                vocab_size: int | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``targets``) from this rank's vocabulary slice ``logits`` ``(..., V/t)``.

    ``vocab_size`` is the true vocabulary (columns at or beyond it are padding); default:
    no padding. Every rank of the tensor-parallel group returns the same losses.
    """
    padded = logits.shape[-1] * pctx.tp_size
    vocab = padded if vocab_size is None else vocab_size
    if not 0 < vocab <= padded:
        raise ValueError(f"vocab_size={vocab} must be in (0, {padded}] (= {logits.shape[-1]} local columns x "
                         f"tp={pctx.tp_size})")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: logits must be "
                         f"targets' shape plus the local vocabulary")
    return _VocabParallelCrossEntropy.apply(logits, targets, pctx, vocab, ignore_index)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, pctx: ParallelContext, *,
                                 vocab_size: int | None = None, ignore_index: int = -100) -> torch.Tensor:
    """The mean cross-entropy over non-ignored tokens (``F.cross_entropy``'s ``mean``), vocabulary-parallel."""
    losses = vocab_parallel_token_losses(logits, targets, pctx, vocab_size=vocab_size, ignore_index=ignore_index)
    count = (targets != ignore_index).sum()
    return losses.sum() / count.clamp(min=1)


def gather_logits(logits: torch.Tensor, pctx: ParallelContext, vocab_size: int | None = None) -> torch.Tensor:
    """The full logits ``(..., vocab_size)`` from every rank's slice (an all-gather; padding columns dropped).

    For inspection and tests: training never needs it (that is the point of the loss above).
    """
    full = gather_from_tensor_parallel_region(logits, pctx, "gather-logits")
    return full if vocab_size is None else full[..., :vocab_size]
