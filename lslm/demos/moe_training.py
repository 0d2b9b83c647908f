"""Launch target of notebook 10: a small MoE GPT trained expert-parallel, its load balance recorded per step.

``lslm.launch("lslm.demos.moe_training:balance_worker", nproc=2, steps=20)`` trains lslm's tiny GPT
with every MLP replaced by a :class:`~lslm.expert_parallel.MoE` whose experts are sharded over the
ranks (ep = dp = world size), each rank on its own batch shard, and returns per step this rank's
loss and auxiliary loss and :func:`~lslm.expert_parallel.moe_balance` of every layer (tokens per expert, routed
and kept, dropped, busiest over mean), summed over the ranks: the series to plot.

The data is synthetic (a few repeated random "phrases", so the loss can fall in a few steps on a
CPU); what the series shows is the router's balance under the auxiliary loss, not a language model.
"""

from __future__ import annotations

from typing import Any

import torch

from lslm.expert_parallel import EPGroup, apply_expert_parallel, apply_moe, moe_aux_loss, moe_balance
from lslm.expert_parallel import reduce_expert_parallel_grads as reduce_grads
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.context import ParallelContext
from lslm.runtime.startup import init_distributed

__all__ = ["balance_worker", "phrase_batch", "train_moe"]


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
