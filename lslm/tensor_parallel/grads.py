"""Gradients that tensor parallelism leaves partial, and the all-reduces that complete them.

Without sequence parallelism every replicated parameter (LayerNorm weights, row-parallel
biases, position embeddings) sees the whole activation on every TP rank, so its gradient
is already identical on every rank. With sequence parallelism it sees only this rank's
slice of the sequence: its gradient is a *partial sum* over that slice, and each rank's
copy would drift away from the others after the first optimizer step unless the partial
gradients are summed over the TP group (Korthikanti et al. 2022, Section 4.2.2; Megatron's
``_allreduce_layernorm_grads`` / ``sequence_parallel`` attribute). This is the bug
learners most often write: the loss still goes down, the replicas silently diverge.

Grouped-query attention with fewer key/value heads than TP ranks replicates each KV head
on ``t / n_kv`` ranks, each of which computes its gradient from its own query heads only:
the full gradient is the sum over the ranks sharing the head.

All of it goes in one flat all-reduce per kind (coalesced, as Megatron does). When the
gradients live in buffers (``main_grad``, :func:`lslm.data_parallel.grad_sync.attach_grad_buffers`
called after :func:`~lslm.tensor_parallel.apply.apply_tensor_parallel`), each kind has its own
buffer and the all-reduce runs on it, bucket by bucket, in place: no concatenation, no copy
back. The replicated heads' buffer has a slot per head already, so it needs no zero-padded
staging buffer either.
"""

from __future__ import annotations

import torch
from torch import nn

from lslm.data_parallel.grad_buffer import buffers_of, has_main_grad
from lslm.data_parallel.grad_sync import reduce_buffers, split_by_holder
from lslm.runtime.context import ParallelContext

__all__ = ["SP_GRAD_LABEL", "KV_GRAD_LABEL", "sequence_parallel_params", "sum_over_tp", "sync_replicated_head_grads",
           "sync_sequence_parallel_grads", "sync_tensor_parallel_grads"]

SP_GRAD_LABEL = "sp-grad-sync"
KV_GRAD_LABEL = "kv-head-grad-sync"


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters marked ``sequence_parallel`` (replicated, with partial gradients), in model order."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def sync_sequence_parallel_grads(model: nn.Module, ctx: ParallelContext) -> int:
    """Sum the gradients of ``sequence_parallel`` parameters over the TP group (one flat all-reduce).

    Returns the number of elements reduced (0 when there is nothing to do). With gradient
    buffers, the ``"sp"`` buffer is reduced in place (``ValueError`` if it also holds other
    parameters: attach the buffers after ``apply_tensor_parallel`` marked the model); in a
    buffer shared with other parameters (ZeRO's one layout) their views are summed, through
    one flat copy.
    """
    params = sequence_parallel_params(model)
    if ctx.tp_size == 1 or not params:
        return 0
    shared = [b for b in buffers_of(params) if b.kind != "sp"]
    if shared:  # ZeRO's one buffer (attach_grad_buffers(one_kind=...)): sum just these parameters' views
        if not all(has_main_grad(p) for p in params):
            raise ValueError("some sequence-parallel parameters hold .grad while the others live in a shared "
                             "gradient buffer: attach buffers to the whole model")
        return sum_over_tp([p.main_grad for p in params], ctx)
    buffers, plain = split_by_holder(params)
    if buffers:
        if plain:
            raise ValueError(f"{len(plain)} sequence-parallel parameters hold .grad while the others have a "
                             "gradient buffer: attach buffers to the whole model")
        reduce_buffers(buffers, ctx, ctx.tp_group, label=SP_GRAD_LABEL)
        return sum(b.numel for b in buffers)
    grads = [p.grad for p in plain if p.grad is not None]
    if not grads:
        return 0
    return sum_over_tp(grads, ctx)


def sync_replicated_head_grads(model: nn.Module, ctx: ParallelContext) -> int:
    """Sum the gradients of key/value heads replicated over several TP ranks among the ranks that share each head.

    Each rank writes its head's gradient into its head's slot of a zero buffer with
    room for all ``n_kv`` heads; one all-reduce over the TP group then sums, slot by slot,
    exactly the ranks that share the head. Returns the buffer's element count.
    """
    marked = list({id(p): p for p in model.parameters() if getattr(p, "replicated_heads", None)}.values())
    if ctx.tp_size == 1 or not marked:
        return 0
    buffers, plain = split_by_holder(marked)
    if buffers:  # each parameter already owns one slot per head there (lslm.data_parallel.grad_sync)
        if plain:
            raise ValueError(f"{len(plain)} replicated key/value parameters hold .grad while the others have a "
                             "gradient buffer: attach buffers to the whole model")
        reduce_buffers(buffers, ctx, ctx.tp_group, label=KV_GRAD_LABEL)
        return sum(b.numel for b in buffers)
    params = [p for p in plain if p.grad is not None]
    if not params:
        return 0
    total = 0
    slots = []
    for p in params:
        heads, t = p.replicated_heads
        slot = ctx.tp_rank * heads // t  # the head this rank holds
        slots.append((p, heads, slot))
        total += heads * p.grad.numel()
    flat = torch.zeros(total, dtype=params[0].grad.dtype, device=params[0].grad.device)
    offset = 0
    for p, heads, slot in slots:
        n = p.grad.numel()
        flat[offset + slot * n: offset + (slot + 1) * n] = p.grad.reshape(-1)
        offset += heads * n
    ctx.comm.all_reduce(flat, group=ctx.tp_group, label=KV_GRAD_LABEL)
    offset = 0
    for p, heads, slot in slots:
        n = p.grad.numel()
        p.grad.copy_(flat[offset + slot * n: offset + (slot + 1) * n].view_as(p.grad))
        offset += heads * n
    return total


def sync_tensor_parallel_grads(model: nn.Module, ctx: ParallelContext) -> None:
    """Every gradient fix-up tensor parallelism needs after backward: sequence-parallel and replicated heads."""
    sync_sequence_parallel_grads(model, ctx)
    sync_replicated_head_grads(model, ctx)


def sum_over_tp(tensors: list[torch.Tensor], ctx: ParallelContext) -> int:
    """Sum ``tensors`` over the TP group in one all-reduce of their concatenation, written back; elements reduced."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    ctx.comm.all_reduce(flat, group=ctx.tp_group, label=SP_GRAD_LABEL)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return flat.numel()
