"""Expert parallelism: the experts of each MoE layer sharded over the ep ranks, tokens moved by all-to-all.

Rank r of ``ep`` owns experts ``r·E/ep … (r+1)·E/ep − 1``; the router is replicated. One layer's
forward on each rank (GShard, Lepikhin et al. 2020, Section 2.2 and Fig. 3; DeepSpeed-MoE):

1. route its own tokens and apply the capacity locally (:func:`~lslm.expert_parallel.dispatch.assign`),
   the kept assignments grouped by expert, hence by owning rank;
2. exchange the per-expert counts (one all-to-all of ``E`` integers: the uneven split sizes);
3. **dispatch**: all-to-all of the assigned token rows with those split sizes;
4. run each local expert on the rows it received (from every rank), in place;
5. **combine**: the reverse all-to-all sends each output row back to the rank its token lives on,
   which sums them, gated, per token.

The backward is the same two all-to-alls reversed (:mod:`~lslm.expert_parallel.all_to_all`), no new
count exchange. Gradients: each rank's loss is the mean over its own shard, so the replicated
(non-expert) parameters' gradients are averaged over ep (= dp) as in data parallelism, and each
expert's gradient, which already arrived as the *sum* over every rank's tokens, is divided by ep
on its single owner (:func:`reduce_expert_parallel_grads`). Exactly the serial MoE applied to each
shard with the shards' losses averaged: tests/test_expert_parallel.py checks it.

With gradient buffers (:func:`~lslm.data_parallel.grad_sync.attach_grad_buffers` after
:func:`apply_expert_parallel`), the experts' parameters are marked ``expert_parallel`` and get a
buffer of their own (kind ``"ep"``): the dense buffers are averaged over ep (one all-reduce per
bucket, in place), the experts' buffer is only divided (tests/test_cp_compose.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed import ReduceOp

from lslm.data_parallel.grad_sync import split_by_holder
from lslm.expert_parallel.all_to_all import all_to_all_rows, exchange_counts
from lslm.expert_parallel.group import EPGroup
from lslm.expert_parallel.moe import MoE, check_moe, route_tokens
from lslm.runtime.context import ParallelContext

__all__ = ["COMBINE_LABEL", "DISPATCH_LABEL", "GRAD_LABEL", "ExpertParallelMoE", "apply_expert_parallel",
           "expert_parameters", "reduce_expert_parallel_grads"]

DISPATCH_LABEL, COMBINE_LABEL, GRAD_LABEL = "ep-dispatch", "ep-combine", "ep-grad-avg"


class ExpertParallelMoE(nn.Module):
    """A :class:`MoE` whose experts live on their owners (this rank keeps ``E / ep`` of them): see the module doc."""

    def __init__(self, moe: MoE, g: EPGroup) -> None:
        super().__init__()
        check_moe(moe.num_experts, moe.top_k, moe.capacity_factor, g.size)
        self.g = g
        self.num_experts, self.top_k, self.capacity_factor = moe.num_experts, moe.top_k, moe.capacity_factor
        self.local = moe.num_experts // g.size
        self.first = g.index * self.local
        self.router = moe.router
        self.experts = nn.ModuleList(moe.experts[self.first:self.first + self.local])  # the others are let go
        for p in self.experts.parameters():
            p.expert_parallel = True  # its gradient is divided by ep, never averaged over dp (grad_sync's "ep")
        self.dropout = moe.dropout
        self.aux: dict[str, torch.Tensor] = {}  # auxiliary losses of the last forward, on this rank's tokens
        self.stats: dict[str, Any] = {}  # assignments per expert (routed, kept), dropped: this rank's tokens
        self.last_traffic: dict[str, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., C)``: this rank's tokens -> the gated sum of their experts' outputs, same shape."""
        flat = x.reshape(-1, x.shape[-1])
        a, self.aux, self.stats = route_tokens(self.router, flat, self.capacity_factor)
        ep, n_loc = self.g.size, self.local
        recv_counts = exchange_counts(a.per_expert, self.g)  # (ep, E/ep)
        # Split sizes are host integers: the sent ones from the counts route_tokens already brought to the host,
        # the received ones in one transfer (one device sync here, not one per list).
        per_expert = self.stats["per_expert"]
        send_splits = [sum(per_expert[r * n_loc:(r + 1) * n_loc]) for r in range(ep)]
        recv_host = recv_counts.tolist()
        recv_splits = [sum(row) for row in recv_host]
        rows = all_to_all_rows(flat.index_select(0, a.tokens), recv_splits, send_splits, self.g, DISPATCH_LABEL)
        # received: by source rank, then by expert inside it; regroup by local expert (stable: source order kept)
        owner = torch.repeat_interleave(torch.arange(n_loc, device=x.device).repeat(ep), recv_counts.flatten())
        order = torch.sort(owner, stable=True).indices
        grouped = rows.index_select(0, order)
        outs, start = [], 0
        for j, n in enumerate(sum(col) for col in zip(*recv_host)):  # rows per local expert
            outs.append(self.experts[j](grouped[start:start + n]))
            start += n
        y = torch.cat(outs).index_select(0, torch.argsort(order))  # back to the order the rows arrived in
        back = all_to_all_rows(y, send_splits, recv_splits, self.g, COMBINE_LABEL)
        out = torch.zeros_like(flat).index_add(0, a.tokens, back * a.gates[:, None])
        self.last_traffic = {"sent_rows": sum(send_splits), "received_rows": sum(recv_splits)}
        return self.dropout(out.view_as(x))


def apply_expert_parallel(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Shard every :class:`MoE` of ``model`` (from :func:`~lslm.expert_parallel.moe.apply_moe`) over ``ctx``'s ep group.

    Every rank must build the same serial model first (same seed): each keeps its own slice of
    the experts. In place; returns the model. ValueError if the experts do not divide over ep.
    """
    g = EPGroup.of(ctx)
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, MoE)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layer: call apply_moe first")
    for _, _, moe in layers:
        check_moe(moe.num_experts, moe.top_k, moe.capacity_factor, g.size)
    for parent, name, moe in layers:
        setattr(parent, name, ExpertParallelMoE(moe, g))
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters only this rank holds (its experts), in module order."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()]


def reduce_expert_parallel_grads(model: nn.Module, g: EPGroup) -> int:
    """Average the replicated parameters' gradients over ep, divide the experts' by ep; returns elements all-reduced.

    Each rank's loss is the mean over its shard (see the module doc). Gradients in buffers
    (``main_grad``): every buffer but the experts' (kind ``"ep"``) is all-reduced over ep bucket by
    bucket, in place, and divided; the experts' buffer is divided with no collective. Otherwise
    the ``.grad`` tensors of the replicated parameters go in one flat all-reduce.
    """
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    experts = {id(p) for p in expert_parameters(model)}
    buffers, plain = split_by_holder(params)
    if buffers:
        if plain:
            raise ValueError(f"{len(plain)} parameters hold .grad while the others have gradient buffers: attach "
                             "buffers to the whole model")
        mixed = [b for b in buffers if b.kind != "ep" and any(id(p) in experts for p in b.params)]
        if mixed:
            raise ValueError(f"a {mixed[0].kind!r} gradient buffer holds expert parameters, which must not be "
                             "averaged over dp: attach_grad_buffers after apply_expert_parallel, without one_kind")
        dense = [b for b in buffers if b.kind != "ep"]
        for buf in buffers:
            if buf.kind == "ep":
                buf.data.div_(g.size)  # already the sum over every rank's tokens
        if g.size == 1:
            return 0
        for buf in dense:  # one SUM all-reduce per bucket, in place (ReduceOp.AVG is not on every backend)
            for b in range(len(buf.buckets)):
                view = buf.bucket_view(b)
                g.comm.all_reduce(view, ReduceOp.SUM, group=g.group, label=GRAD_LABEL)
                view.div_(g.size)
        return sum(b.numel for b in dense)
    shared = [p for p in params if id(p) not in experts]
    for p in params:
        if id(p) in experts and p.grad is not None:
            p.grad.div_(g.size)  # already the sum over every rank's tokens (the reverse all-to-all brought it)
    if g.size == 1:
        return 0
    # every rank reduces the same list: a parameter no token reached this step contributes zeros
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in shared])
    g.comm.all_reduce(flat, group=g.group, label=GRAD_LABEL)
    flat.div_(g.size)
    offset = 0
    for p in shared:
        chunk = flat[offset:offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += p.numel()
    return flat.numel()
