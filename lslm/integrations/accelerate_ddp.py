"""The lslm GPT trained with Hugging Face Accelerate, on the data and optimiser of ``lslm.recipes.ddp``.

Accelerate keeps your loop and changes a few lines: ``Accelerator()`` joins the process
group and picks the device, ``prepare(model, optimizer, loader)`` wraps the model in
torch's ``DistributedDataParallel`` and shards the loader, ``accelerator.backward(loss)``
replaces ``loss.backward()``. Its sharding differs from ``DistributedSampler``'s: the loader
is built for the *whole* data (batches of the per-process size) and process ``r`` takes
batches ``r, r + n, r + 2n, ...``. Given lslm's epoch order, global batch ``i`` holds the
same sequences as lslm's (split between the ranks differently), so the averaged gradient is
the same up to fp32 rounding.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from lslm.data.dataset import token_blocks
from lslm.recipes.ddp import DDPConfig, check_config
from lslm.recipes.train import build_model, make_optimizer

__all__ = ["EpochOrder", "train_accelerate", "worker"]


class EpochOrder(Sampler[int]):
    """The whole data set in lslm's epoch order (``numpy.random.default_rng([seed, epoch]).permutation``)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on (Accelerate's loader forwards it)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


def train_accelerate(cfg: DDPConfig) -> list[float]:
    """Train ``cfg`` with an ``accelerate.Accelerator`` loop on this torchrun job; return the global loss per step."""
    from accelerate import Accelerator

    per_rank = check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    accelerator = Accelerator(cpu=True)  # joins the group torchrun describes (gloo on CPU), if not joined yet
    model = build_model(cfg)
    optimizer = make_optimizer(model, cfg)
    blocks = token_blocks(cfg.block_size, cfg.vocab_size)
    loader = DataLoader(blocks, batch_size=per_rank, sampler=EpochOrder(len(blocks), cfg.seed), drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    epoch = 0
    while len(losses) < cfg.steps:
        loader.set_epoch(epoch)
        for batch in loader:
            block = batch["input_ids"]
            optimizer.zero_grad(set_to_none=True)
            _, loss = model(block[:, :-1], block[:, 1:])
            accelerator.backward(loss)  # DDP's all-reduce runs here, as in loss.backward()
            if cfg.grad_clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
            if len(losses) == cfg.steps:
                break
        epoch += 1
    return losses


def worker(**kwargs: Any) -> dict[str, Any]:
    """One rank (``lslm.launch("lslm.integrations.accelerate_ddp:worker", nproc=2, steps=10)``); kwargs: DDPConfig."""
    losses = train_accelerate(DDPConfig(**{"device": "cpu", **kwargs}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {"framework": "accelerate", "losses": losses}
