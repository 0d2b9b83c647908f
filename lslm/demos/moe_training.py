"""Launch targets of notebook 10: one MoE layer expert-parallel against serial, and a small MoE GPT trained.

``lslm.launch("lslm.demos.moe_training:balance_worker", nproc=2, steps=20)`` trains lslm's tiny GPT
with every MLP replaced by a :class:`~lslm.expert_parallel.MoE` whose experts are sharded over the
ranks (ep = dp = world size), each rank on its own batch shard, and returns per step this rank's
loss and auxiliary loss and :func:`~lslm.expert_parallel.moe_balance` of every layer (tokens per expert, routed
and kept, dropped, busiest over mean), summed over the ranks: the series to plot.

:func:`layer_case` checks one expert-parallel layer against the serial :class:`~lslm.expert_parallel.MoE`
applied to every rank's shard (outputs, gradients, drops, ledger bytes against
:func:`~lslm.expert_parallel.ep_traffic`); tests/expert_parallel_workers.py runs it too.
``lslm.launch("lslm.demos.moe_training:notebook_suite", nproc=2)`` runs :data:`LAYER_CASES` and two short
trainings (with and without the load-balancing loss) in one job.

The data is synthetic (a few repeated random "phrases", so the loss can fall in a few steps on a
CPU); what the series shows is the router's balance under the auxiliary loss, not a language model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from lslm.expert_parallel import (
    EPGroup,
    ExpertParallelMoE,
    MoE,
    apply_expert_parallel,
    apply_moe,
    ep_traffic,
    moe_aux_loss,
    moe_balance,
    rows_per_rank,
)
from lslm.expert_parallel import reduce_expert_parallel_grads as reduce_grads
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.context import ParallelContext
from lslm.runtime.startup import init_distributed

__all__ = ["LAYER_CASES", "LAYER_SHAPE", "balance_worker", "layer_case", "notebook_suite", "phrase_batch",
           "train_moe"]


def phrase_batch(vocab: int, batch: int, seq: int, step: int, rank: int, device: torch.device) -> torch.Tensor:
    """``(batch, seq)`` token ids: one of 8 fixed random phrases per row, chosen per (step, rank)."""
    # Drawn on the host from seeded CPU generators (the same ids on any device), then moved.
    phrases = torch.randint(0, vocab, (8, seq),  # lslm: cpu-ok (seeded host draw, moved below)
                            generator=torch.Generator().manual_seed(1234))
    pick = torch.randint(0, 8, (batch,),  # lslm: cpu-ok (seeded host draw)
                         generator=torch.Generator().manual_seed(1000 * step + rank))
    return phrases[pick].to(device)


def train_moe(ctx: ParallelContext, steps: int = 20, num_experts: int = 4, top_k: int = 2,
              capacity_factor: float | None = 1.0, balance_coef: float = 1e-2, z_coef: float = 1e-3,
              lr: float = 3e-3, batch: int = 4, seq: int = 32, seed: int = 0) -> list[dict[str, Any]]:
    """Train the tiny MoE GPT expert-parallel over ``ctx``'s dp ranks; one record per step (see module doc)."""
    cfg = GPTConfig.tiny(block_size=seq)
    torch.manual_seed(seed)  # every rank builds the same model, then keeps its own experts
    model = apply_expert_parallel(apply_moe(GPT(cfg).to(ctx.device), num_experts, top_k, capacity_factor), ctx)
    g = EPGroup.of(ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    records = []
    for step in range(steps):
        idx = phrase_batch(cfg.vocab_size, batch, seq, step, g.index, ctx.device)
        opt.zero_grad()
        _, loss = model(idx[:, :-1], idx[:, 1:])
        aux = moe_aux_loss(model, balance_coef, z_coef)
        (loss + aux).backward()
        reduce_grads(model, g)
        opt.step()
        records.append({"step": step, "loss": loss.item(), "aux": aux.item(),
                        "layers": moe_balance(model, g, ctx.device)})
    return records


def balance_worker(**kwargs: Any) -> list[dict[str, Any]]:
    """One rank of a launched job: join the group (ep = dp = world size), train, return the per-step records."""
    with init_distributed() as ctx:
        return train_moe(ctx, **kwargs)


#: (top_k, capacity_factor, renormalize): Switch top-1 with drops, Mixtral-style top-2 with drops, dropless, scarce.
LAYER_CASES = ((1, 1.0, False), (2, 1.25, True), (2, None, True), (2, 0.5, True))
#: The layer of :func:`layer_case`: width, expert hidden width, experts, sequences and tokens per rank.
LAYER_SHAPE = {"width": 16, "hidden": 32, "num_experts": 8, "batch": 2, "seq": 8}
LAYER_AUX = (0.1, 0.01)  # large enough that the router's gradient through both auxiliary losses is checked


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _layer_loss(layer: torch.nn.Module, y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return (y * dy).sum() + LAYER_AUX[0] * layer.aux["load_balancing"] + LAYER_AUX[1] * layer.aux["z"]


def layer_case(ctx: ParallelContext, top_k: int, capacity_factor: float | None,
               renormalize: bool) -> dict[str, Any]:
    """One MoE layer (:data:`LAYER_SHAPE`), expert-parallel over ``ctx``'s dp ranks vs the serial layer on every
    shard (the shards' losses averaged): max |Δ| of output and gradients, drops, and this rank's ledger bytes."""
    C, hidden, E, B, T = (LAYER_SHAPE[k] for k in ("width", "hidden", "num_experts", "batch", "seq"))
    g, dev, ep = EPGroup.of(ctx), ctx.device, ctx.dp_size
    torch.manual_seed(0)
    serial = MoE(C, hidden, E, top_k, capacity_factor, renormalize).to(dev)
    layer = ExpertParallelMoE(copy.deepcopy(serial), g)
    gen = torch.Generator().manual_seed(1)  # drawn on the host (the same numbers everywhere), then moved
    x, dy = (torch.randn(ep * B, T, C, generator=gen).to(dev)  # lslm: cpu-ok (seeded host draw, moved)
             for _ in range(2))
    shards = [slice(s * B, (s + 1) * B) for s in range(ep)]
    xs = x.clone().requires_grad_()
    total, outs, per_expert, dropped = 0.0, [], [], []
    for sl in shards:  # the serial reference, shard by shard: the routing groups are the shards
        y = serial(xs[sl])
        total = total + _layer_loss(serial, y, dy[sl]) / ep
        outs.append(y.detach())
        per_expert.append(serial.stats["per_expert"])
        dropped.append(serial.stats["dropped"])
    total.backward()
    mine = shards[g.index]
    xl = x[mine].clone().requires_grad_()
    records = ctx.comm.ledger.records
    start = len(records)
    y = layer(xl)
    loss = _layer_loss(layer, y, dy[mine])
    mid = len(records)
    loss.backward()
    end = len(records)
    first = g.index * (E // ep)
    want_experts = [p.grad for e in serial.experts[first:first + E // ep] for p in e.parameters()]
    # before the gradient rule: the experts hold the sum over every rank's tokens, ep times the mean's gradient
    unreduced = max(_maxdiff(p.grad, w) for p, w in zip(layer.experts.parameters(), want_experts))
    reduce_grads(layer, g)
    got_experts = [p.grad for p in layer.experts.parameters()]
    sent, received = rows_per_rank(torch.tensor(per_expert))  # lslm: cpu-ok (host integers)
    a2a = [r for r in records[start:end] if r.op == "all_to_all"]
    return {
        "ep": ep, "top_k": top_k, "capacity_factor": capacity_factor, "tokens": B * T,
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


def notebook_suite(steps: int = 30, **train_kwargs: Any) -> dict[str, Any]:
    """One rank of notebook 10's job: every :data:`LAYER_CASES` case, then ``steps`` training steps with the
    load-balancing loss (``balanced``) and without it (``unbalanced``: both auxiliary coefficients 0)."""
    with init_distributed() as ctx:
        out: dict[str, Any] = {"rank": ctx.rank, "cases": [layer_case(ctx, *c) for c in LAYER_CASES]}
        out["balanced"] = train_moe(ctx, steps=steps, **train_kwargs)
        out["unbalanced"] = train_moe(ctx, steps=steps, **{**train_kwargs, "balance_coef": 0.0, "z_coef": 0.0})
        return out
