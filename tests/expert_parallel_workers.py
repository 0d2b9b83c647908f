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

from lslm.demos.moe_training import LAYER_CASES, layer_case, phrase_batch, train_moe
from lslm.expert_parallel import EPGroup, apply_expert_parallel, apply_moe, moe_aux_loss, reduce_expert_parallel_grads
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext

CASES = LAYER_CASES  # the layer cases: lslm.demos.moe_training.layer_case runs them (notebook 10 does too)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


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
        return {"rank": ctx.rank, "cases": [layer_case(ctx, *case) for case in CASES], "training": training(ctx),
                "balance": train_moe(ctx, steps=3, batch=2, seq=16)}
