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

__all__ = ["LOSS_LABEL", "RUN_CONFIG", "SEEN_LABEL", "onebit_loss_curves"]

LOSS_LABEL = "1-bit run loss"
SEEN_LABEL = "1-bit run tokens seen in the warm-up"
#: A small GPT on the course corpus: 2 layers of width 64, a 512-token vocabulary, 32-token blocks.
RUN_CONFIG = dict(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)


def onebit_loss_curves(ctx: ParallelContext, *, steps: int = 40, warmup_steps: int = 10, batch_size: int = 8,
                       lr: float = 3e-3, seed: int = 0) -> dict[str, Any]:
    """Run on every rank: Adam, 1-bit Adam and 1-bit Adam without error feedback, from the same start and data.

    Adam is :class:`OneBitAdam` that never leaves its warm-up (torch's Adam on averaged
    gradients). Returns, identically on every rank: ``losses`` (per run, the mean over ranks
    of each step's loss), ``bus_bytes`` (per run, what this rank sent per step, from the
    ledger, the loss's own all-reduce excluded), ``numel`` and ``world``; ``compressed_numel``
    and ``frozen_numel`` (per run: elements each compressed all-reduce carries, and those the
    compression phase leaves alone because their frozen ``sqrt(v_hat)`` is at most eps: the embedding rows
    of the tokens unseen in the warm-up and the attention's key biases; None for Adam);
    ``unseen_rows`` (token ids that no rank fed during the first ``warmup_steps`` steps) and
    ``unseen_rows_moved`` (per run, the largest change of one of their input-embedding weights).
    """
    world, rank = ctx.world_size, ctx.rank
    torch.manual_seed(seed)
    start = GPT(GPTConfig(**RUN_CONFIG)).to(ctx.device)
    data = token_blocks(RUN_CONFIG["block_size"], RUN_CONFIG["vocab_size"], rank=rank, world_size=world)
    labels = (WARMUP_LABEL, ALL_TO_ALL_LABEL, ALL_GATHER_LABEL)
    runs = {"adam": (steps + 1, True), "1-bit adam": (warmup_steps, True), "1-bit adam, no error feedback":
            (warmup_steps, False)}
    out: dict[str, Any] = {"losses": {}, "bus_bytes": {}, "compressed_numel": {}, "frozen_numel": {},
                           "unseen_rows_moved": {}, "world": world,
                           "numel": sum(p.numel() for p in start.parameters())}
    ledger = ctx.comm.ledger
    seen = torch.zeros(RUN_CONFIG["vocab_size"], dtype=torch.float32, device=ctx.device)
    for name, (warmup, feedback) in runs.items():
        model = copy.deepcopy(start)
        opt = OneBitAdam(model.parameters(), ctx, lr=lr, warmup_steps=warmup, error_feedback=feedback)
        losses, sent = [], []
        stream = batches(data, batch_size, seed=seed)
        for step in range(steps):
            x, y = next(stream)
            if name == "adam" and step < warmup_steps:  # every run reads the same batches: count them once
                seen += torch.bincount(x.flatten(), minlength=seen.numel()).to(seen)
            since = len(ledger.records)
            opt.zero_grad()
            _, loss = model(x.to(ctx.device), y.to(ctx.device))
            loss.backward()
            opt.step()
            sent.append(sum(ledger.total_bus_bytes(label=lab, since=since) for lab in labels))
            mean = loss.detach().clone().reshape(1)
            ctx.comm.all_reduce(mean, label=LOSS_LABEL)
            losses.append(mean.item() / world)
        if name == "adam":
            ctx.comm.all_reduce(seen, label=SEEN_LABEL)  # a token any rank fed in the warm-up counts as seen
            unseen = (seen == 0).nonzero().flatten()
            out["unseen_rows"] = len(unseen)
        moved = (model.wte.weight - start.wte.weight).detach()[unseen]
        out["unseen_rows_moved"][name] = moved.abs().max().item() if moved.numel() else 0.0
        out["losses"][name], out["bus_bytes"][name] = losses, sent
        out["compressed_numel"][name], out["frozen_numel"][name] = opt.compressed_numel, opt.frozen_numel
    return out
