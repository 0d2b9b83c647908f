"""A short 1-bit Adam run on the course's GPT and corpus: loss curves and bytes per step (for notebook 10)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from lslm.data.dataset import batches, token_blocks
from lslm.data_parallel.onebit_adam import WARMUP_LABEL, OneBitAdam
from lslm.data_parallel.onebit_compress import ALL_GATHER_LABEL, ALL_TO_ALL_LABEL
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.context import ParallelContext

__all__ = ["LOSS_LABEL", "RUN_CONFIG", "onebit_loss_curves"]

LOSS_LABEL = "1-bit run loss"
#: A small GPT on the course corpus: 2 layers of width 64, a 512-token vocabulary, 32-token blocks.
RUN_CONFIG = dict(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)


def onebit_loss_curves(ctx: ParallelContext, *, steps: int = 40, warmup_steps: int = 10, batch_size: int = 8,
                       lr: float = 3e-3, seed: int = 0) -> dict[str, Any]:
    """Run on every rank: Adam, 1-bit Adam and 1-bit Adam without error feedback, from the same start and data.

    Adam is :class:`OneBitAdam` that never leaves its warm-up (torch's Adam on averaged
    gradients). Returns, identically on every rank: ``losses`` (per run, the mean over ranks
    of each step's loss), ``bus_bytes`` (per run, what this rank sent per step, from the
    ledger, the loss's own all-reduce excluded), ``numel`` and ``world``.
    """
    world, rank = ctx.world_size, ctx.rank
    torch.manual_seed(seed)
    start = GPT(GPTConfig(**RUN_CONFIG)).to(ctx.device)
    data = token_blocks(RUN_CONFIG["block_size"], RUN_CONFIG["vocab_size"], rank=rank, world_size=world)
    labels = (WARMUP_LABEL, ALL_TO_ALL_LABEL, ALL_GATHER_LABEL)
    runs = {"adam": (steps + 1, True), "1-bit adam": (warmup_steps, True), "1-bit adam, no error feedback":
            (warmup_steps, False)}
    out: dict[str, Any] = {"losses": {}, "bus_bytes": {}, "world": world,
                           "numel": sum(p.numel() for p in start.parameters())}
    ledger = ctx.comm.ledger
    for name, (warmup, feedback) in runs.items():
        model = copy.deepcopy(start)
        opt = OneBitAdam(model.parameters(), ctx, lr=lr, warmup_steps=warmup, error_feedback=feedback)
        losses, sent = [], []
        stream = batches(data, batch_size, seed=seed)
        for _ in range(steps):
            x, y = next(stream)
            since = len(ledger.records)
            opt.zero_grad()
            _, loss = model(x.to(ctx.device), y.to(ctx.device))
            loss.backward()
            opt.step()
            sent.append(sum(ledger.total_bus_bytes(label=lab, since=since) for lab in labels))
            mean = loss.detach().clone().reshape(1)
            ctx.comm.all_reduce(mean, label=LOSS_LABEL)
            losses.append(mean.item() / world)
        out["losses"][name], out["bus_bytes"][name] = losses, sent
    return out
