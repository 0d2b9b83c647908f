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

from lslm.demos.moe_training import phrase_batch, train_moe
from lslm.expert_parallel import (
    EPGroup,
    ExpertParallelMoE,
    MoE,
    apply_expert_parallel,
    apply_moe,
    ep_traffic,
    moe_aux_loss,
    reduce_expert_parallel_grads,
    rows_per_rank,
)
from lslm.models.gpt import GPT, GPTConfig
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


def training(ctx: ParallelContext, steps: int = 3) -> dict[str, Any]:
    """The MoE GPT trained expert-parallel vs serially on every shard (losses averaged): losses and parameters."""
    g, dev, ep = EPGroup.of(ctx), ctx.device, ctx.dp_size
    cfg = GPTConfig.tiny(n_layer=2, block_size=16)
    torch.manual_seed(0)
    serial = apply_moe(GPT(cfg).to(dev), num_experts=4, top_k=2, capacity_factor=1.0)
    model = apply_expert_parallel(copy.deepcopy(serial), ctx)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_diff, aux_diff = 0.0, 0.0
    for step in range(steps):
        shards = [phrase_batch(cfg.vocab_size, 2, 17, step, s, dev) for s in range(ep)]
        opt_s.zero_grad()
        total, per_shard = 0.0, []
        for idx in shards:
            _, loss = serial(idx[:, :-1], idx[:, 1:])
            aux = moe_aux_loss(serial, 0.1, 0.01)  # read per shard: the routing groups are the shards
            total = total + (loss + aux) / ep
            per_shard.append((loss.item(), aux.item()))
        total.backward()
        opt_s.step()
        opt.zero_grad()
        idx = shards[g.index]
        _, loss = model(idx[:, :-1], idx[:, 1:])
        aux = moe_aux_loss(model, 0.1, 0.01)
        (loss + aux).backward()
        reduce_expert_parallel_grads(model, g)
        opt.step()
        loss_diff = max(loss_diff, abs(loss.item() - per_shard[g.index][0]))
        aux_diff = max(aux_diff, abs(aux.item() - per_shard[g.index][1]))
    n_loc = 4 // ep
    param_diff = 0.0
    for b_s, b in zip(serial.blocks, model.blocks):
        pairs = list(zip(b.mlp.experts, b_s.mlp.experts[g.index * n_loc:(g.index + 1) * n_loc]))
        for mine, ref in pairs:
            param_diff = max(param_diff, *(_maxdiff(p, q) for p, q in zip(mine.parameters(), ref.parameters())))
    ref_shared = {n: p for n, p in serial.named_parameters() if ".experts." not in n}
    shared = {n: p for n, p in model.named_parameters() if ".experts." not in n}
    param_diff = max(param_diff, *(_maxdiff(shared[n], ref_shared[n]) for n in ref_shared))
    return {"ep": ep, "steps": steps, "loss_diff": loss_diff, "aux_diff": aux_diff, "param_diff": param_diff,
            "same_shared_names": sorted(shared) == sorted(ref_shared)}


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by the launcher before init_distributed reads it


def suite() -> dict[str, Any]:
    """Every case at ep = dp = world size."""
    with init_distributed(dp=_world()) as ctx:
        return {"rank": ctx.rank, "cases": [moe_case(ctx, *case) for case in CASES], "training": training(ctx),
                "balance": train_moe(ctx, steps=3, batch=2, seq=16)}
