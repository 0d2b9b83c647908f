"""Workers for tests/test_expert_parallel.py: every multi-process check of one world size in one launch.

The reference is the serial :class:`MoE` (every expert on one rank) applied to each ep rank's
batch shard, the shards' losses averaged: the routing, the capacity cut and the auxiliary losses
are per shard in both. Each check returns plain numbers (max |Δ| against that reference, built on
the same rank from the same seed; drop counts; bytes from this rank's ledger); the test asserts.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from lslm.expert_parallel import (
    EPGroup,
    ExpertParallelMoE,
    MoE,
    ep_traffic,
    reduce_expert_parallel_grads,
    rows_per_rank,
)
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext

C, HIDDEN, E, B, T = 16, 32, 8, 2, 8  # 16 tokens per rank, 8 experts
# (top_k, capacity_factor, renormalize): Switch top-1 with drops, Mixtral-style top-2 with drops, dropless, scarce
CASES = [(1, 1.0, False), (2, 1.25, True), (2, None, True), (2, 0.5, True)]
AUX = (0.1, 0.01)  # large enough that the router's gradient through both auxiliary losses is checked


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _loss(layer: torch.nn.Module, y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return (y * dy).sum() + AUX[0] * layer.aux["load_balancing"] + AUX[1] * layer.aux["z"]


def moe_case(ctx: ParallelContext, top_k: int, capacity_factor: float | None, renormalize: bool) -> dict[str, Any]:
    """One MoE layer, expert-parallel vs serial on every shard: output, gradients, drops and ledger bytes."""
    g, dev, ep = EPGroup.of(ctx), ctx.device, ctx.dp_size
    torch.manual_seed(0)
    serial = MoE(C, HIDDEN, E, top_k, capacity_factor, renormalize).to(dev)
    layer = ExpertParallelMoE(copy.deepcopy(serial), g)
    gen = torch.Generator().manual_seed(1)  # drawn on the CPU (same numbers everywhere), then moved
    x, dy = (torch.randn(ep * B, T, C, generator=gen).to(dev) for _ in range(2))
    shards = [slice(s * B, (s + 1) * B) for s in range(ep)]
    # serial reference, shard by shard; the shards' losses averaged (each ep rank's loss is its shard's)
    xs = x.clone().requires_grad_()
    total, outs, per_expert, dropped = 0.0, [], [], []
    for sl in shards:
        y = serial(xs[sl])
        total = total + _loss(serial, y, dy[sl]) / ep
        outs.append(y.detach())
        per_expert.append(serial.stats["per_expert"])
        dropped.append(serial.stats["dropped"])
    total.backward()
    mine = shards[g.index]
    xl = x[mine].clone().requires_grad_()
    records = ctx.comm.ledger.records
    start = len(records)
    y = layer(xl)
    loss = _loss(layer, y, dy[mine])
    mid = len(records)
    loss.backward()
    end = len(records)
    first = g.index * (E // ep)
    want_experts = [p.grad for e in serial.experts[first:first + E // ep] for p in e.parameters()]
    # before the gradient rule: the experts hold the sum over every rank's tokens, ep times the mean's gradient
    unreduced = max(_maxdiff(p.grad, w) for p, w in zip(layer.experts.parameters(), want_experts))
    reduce_expert_parallel_grads(layer, g)
    got_experts = [p.grad for p in layer.experts.parameters()]
    sent, received = rows_per_rank(torch.tensor(per_expert))
    a2a = [r for r in records[start:end] if r.op == "all_to_all"]
    return {
        "ep": ep, "top_k": top_k, "capacity_factor": capacity_factor,
        "out": _maxdiff(y, outs[g.index]),
        "grad_x": _maxdiff(xl.grad / ep, xs.grad[mine]),  # d(mean of shard losses)/dx = d(own loss)/dx / ep
        "grad_router": _maxdiff(layer.router.gate.weight.grad, serial.router.gate.weight.grad),
        "grad_experts": max(_maxdiff(a, b) for a, b in zip(got_experts, want_experts)),
        "grad_experts_unreduced": unreduced,
        "dropped": layer.stats["dropped"], "dropped_serial": dropped[g.index], "dropped_all": dropped,
        "per_expert_serial": per_expert,
        "forward_bytes": sum(r.nbytes for r in records[start:mid] if r.op == "all_to_all"),
        "backward_bytes": sum(r.nbytes for r in records[mid:end] if r.op == "all_to_all"),
        "labels": sorted({r.label for r in a2a}),
        "other_ops": sorted({r.op for r in records[start:end]} - {"all_to_all"}),
        "formula": ep_traffic(sent[g.index], received[g.index], C, E, ep),
        "sent": sent[g.index], "received": received[g.index],
    }


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by the launcher before init_distributed reads it


def suite() -> dict[str, Any]:
    """Every case at ep = dp = world size."""
    with init_distributed(dp=_world()) as ctx:
        return {"rank": ctx.rank, "cases": [moe_case(ctx, *case) for case in CASES]}
