"""Gradient clipping and data-parallel averaging when the model's parameters are split over ranks.

**The global norm.** ``torch.nn.utils.clip_grad_norm_`` computes ``||g||_2`` over the
parameters it is given. On a tensor-parallel rank those are a mix of

* *sharded* parameters (``tensor_model_parallel=True``: column/row-parallel weights, the
  vocabulary-parallel embedding and head): each rank holds a disjoint slice, so the
  squares of all slices together are the squares of the whole parameter;
* *replicated* parameters (LayerNorm gains and biases, row-parallel biases, position
  embeddings): every TP rank holds the same tensor with the same gradient (after
  :func:`lslm.tensor_parallel.grads.sync_tensor_parallel_grads` under sequence parallelism).

So the squared global norm is ``sum_r (sharded squares on r) + (replicated squares, once)``:
each rank sums its local squares, counting a replicated parameter only on TP rank 0,
and one all-reduce (SUM) over the model-parallel group ``ctx.group("tp", "pp")`` completes it
(pipeline stages hold disjoint layers, so they simply add). This is Megatron-LM's
``param_is_not_tensor_parallel_duplicate`` rule (``clip_grads.py``). We count on rank 0
rather than dividing every rank's replicated squares by ``t``: the sum is then exactly the
serial one's terms, with no extra rounding, and a replicated gradient that drifted between
ranks (a missing sync) is not averaged away. Summing every rank's local squares instead
counts each replicated parameter ``t`` times: the norm comes out too large and training
clips harder than the serial run (``tests/test_tp_clip_checkpoint.py`` shows the gap).

Grouped-query attention with fewer key/value heads than TP ranks keeps one head on
several ranks (``replicated_heads``); it is counted on the first rank that holds it.
A tied embedding split over pipeline stages has a copy on the last stage (marked
``shared``); it is counted on the first stage only.

**Data parallelism on top.** All TP ranks of one data-parallel replica compute the *same*
loss on the *same* rows (they split the model, not the batch), so gradients are averaged
over the ``dp`` group only: dividing by ``dp * tp`` would shrink them ``t``-fold.
Average first, then clip: the norm is of the averaged gradient, as in the serial run.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lslm.data_parallel.grad_buffer import main_grad_or_grad
from lslm.data_parallel.grad_sync import reduce_buffers, split_by_holder
from lslm.runtime.context import ParallelContext

__all__ = ["CLIP_LABEL", "DP_GRAD_LABEL", "average_data_parallel_grads", "clip_grad_norm_", "counts_in_norm",
           "grad_norm"]

#: Ledger label of the one all-reduce of the squared norm.
CLIP_LABEL = "grad-norm"
#: Ledger label of the one flat data-parallel gradient all-reduce.
DP_GRAD_LABEL = "dp-grad"


def _params(model_or_params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    seen: set[int] = set()
    out = []
    for p in params:  # a tied weight passed twice is still one parameter
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def counts_in_norm(param: torch.Tensor, ctx: ParallelContext) -> bool:
    """Whether this rank adds ``param``'s squares to the global norm (sharded: always; replicated: on tp rank 0).

    A parameter marked ``shared`` (the last pipeline stage's copy of a tied embedding,
    :func:`lslm.pipeline.apply.apply_pipeline`) never counts: the first stage's copy holds the
    same gradient and counts it (Megatron-LM's ``param_is_not_shared``).
    """
    if getattr(param, "shared", False):
        return False
    heads = getattr(param, "replicated_heads", None)
    if heads is not None:  # one key/value head on t // n_kv ranks: the first of them counts it
        n_kv, t = heads
        return ctx.tp_rank % (t // n_kv) == 0
    return bool(getattr(param, "tensor_model_parallel", False)) or ctx.tp_rank == 0


def grad_norm(model_or_params: nn.Module | Iterable[torch.Tensor], ctx: ParallelContext, *,
              label: str = CLIP_LABEL) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (every shard, replicated parameters once), on every rank.

    A 0-dim fp32 tensor on the gradients' device (``ctx.device`` if there are none).
    One all-reduce of one number over ``ctx.group("tp", "pp")``, skipped when that group is this rank alone.
    """
    held = [(p, main_grad_or_grad(p)) for p in _params(model_or_params)]
    grads = [g for p, g in held if g is not None and counts_in_norm(p, ctx)]
    device = grads[0].device if grads else ctx.device
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    for g in grads:
        sq += torch.linalg.vector_norm(g.float()) ** 2
    if ctx.tp_size * ctx.pp_size > 1:
        ctx.comm.all_reduce(sq, group=ctx.group("tp", "pp"), label=label)
    return sq.sqrt()[0]


@torch.no_grad()
def clip_grad_norm_(model_or_params: nn.Module | Iterable[torch.Tensor], max_norm: float, ctx: ParallelContext, *,
                    eps: float = 1e-6, label: str = CLIP_LABEL) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + eps))``, the norm taken over the whole model; return it.

    The same rule as ``torch.nn.utils.clip_grad_norm_`` (L2, ``eps=1e-6``), with the norm
    of :func:`grad_norm`: every rank of the model-parallel group gets the same norm and
    the same coefficient, so sharded and replicated parameters are scaled alike.
    """
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or max_norm <= 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    params = _params(model_or_params)
    total = grad_norm(params, ctx, label=label)
    coef = (max_norm / (total + eps)).clamp(max=1.0)
    for p in params:
        g = main_grad_or_grad(p)
        if g is not None:
            g.mul_(coef.to(g.device, g.dtype))
    return total


@torch.no_grad()
def average_data_parallel_grads(model_or_params: nn.Module | Iterable[torch.Tensor], ctx: ParallelContext, *,
                                label: str = DP_GRAD_LABEL) -> int:
    """Average gradients over the data-parallel group: one flat all-reduce (SUM, then divide by ``dp``).

    Only ``dp``: the TP ranks of a replica already agree on the loss (see the module doc).
    Returns the number of elements reduced (0 with ``dp == 1``: nothing to do). Gradients in
    buffers (``main_grad``) are reduced there, bucket by bucket, in place.
    Context parallelism, whose ranks see different tokens, is not handled here.
    """
    if ctx.cp_size > 1:
        raise ValueError(f"cp={ctx.cp_size}: context-parallel ranks must also average gradients; this function "
                         "only averages over dp")
    if ctx.dp_size == 1:
        return 0
    buffers, plain = split_by_holder(_params(model_or_params))
    # Buffers: one in-place all-reduce per bucket (the "sp" and "kv-heads" buffers too, after their TP sums).
    reduce_buffers(buffers, ctx, ctx.dp_group, label=label, divide_by=ctx.dp_size)
    reduced = sum(b.numel for b in buffers)
    grads = [p.grad for p in plain if p.grad is not None]
    if not grads:
        return reduced
    flat = torch.cat([g.reshape(-1) for g in grads])
    ctx.comm.all_reduce(flat, group=ctx.dp_group, label=label)
    flat /= ctx.dp_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return reduced + flat.numel()
