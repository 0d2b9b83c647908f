"""A data-parallel training script written the way you would write it at work: plain ``torch.distributed``.

Everything lslm's harness does for you is spelled out here, once, with nothing
but PyTorch (only the GPT and the shipped corpus come from lslm). Run it with
torchrun from the file::

    torchrun --nproc-per-node=2 lslm/recipes/ddp_script.py --steps 20 --out runs/ddp_script

torchrun starts one process per device and gives each ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT``; the script reads them, joins the
group, wraps the model in ``DistributedDataParallel``, shards the data with a
``DistributedSampler``, and lets rank 0 alone print and write the checkpoint. From a
notebook, ``lslm.launch("lslm.recipes.ddp_script:train", nproc=2, steps=20)`` runs
:func:`train` on every rank and returns what each rank returned.

The optimiser, clipping and data order are those of ``lslm.recipes.ddp`` with
``variant="torch", sampler="torch"``, so the two give the same losses up to fp32
rounding (notebook 04b checks it).
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from lslm.data.dataset import token_blocks
from lslm.models.gpt import GPT, GPTConfig


def setup() -> tuple[int, int, int, torch.device]:
    """Join the process group torchrun describes; return ``(rank, world_size, local_rank, device)``.

    With GPUs: one per process, chosen by ``LOCAL_RANK`` (the rank *on this node*), and NCCL.
    Without: CPU and gloo. ``torch.cuda.set_device`` comes first, so that NCCL and every
    ``.cuda()`` land on this process's GPU rather than all on GPU 0.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # env:// reads MASTER_ADDR/PORT, RANK and WORLD_SIZE; a finite timeout turns a hang into an error.
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    return rank, world_size, local_rank, device


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (biases and LayerNorm gains are not shrunk)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def train(steps: int = 20, batch_size: int = 8, block_size: int = 64, vocab_size: int = 1024, n_layer: int = 2,
          n_head: int = 4, n_embd: int = 64, lr: float = 3e-3, weight_decay: float = 0.1, grad_clip: float = 1.0,
          seed: int = 0, log_every: int = 5, out: str | None = None) -> dict[str, Any]:
    """Train the GPT data-parallel on every rank of the job; return this rank's losses.

    ``batch_size`` is the global batch (every rank takes ``batch_size / world_size``
    sequences per step). ``out``: folder where rank 0 writes ``checkpoint.pt`` and
    ``losses.json``.
    """
    rank, world_size, local_rank, device = setup()
    try:
        if batch_size % world_size:
            raise ValueError(f"batch_size={batch_size} must be a multiple of the {world_size} processes")
        torch.manual_seed(seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                              n_embd=n_embd)).to(device)
        # device_ids: the one GPU this process drives; None on CPU.
        ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
        optimizer = make_optimizer(ddp.module, lr, weight_decay)

        data = token_blocks(block_size, vocab_size)  # every rank builds the same blocks...
        # ...and the sampler deals them out: rank r gets positions r, r + n, r + 2n, ... of one shuffled order.
        sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        loader = DataLoader(data, batch_size=batch_size // world_size, sampler=sampler, drop_last=True)

        losses: list[float] = []
        epoch = 0
        while len(losses) < steps:
            sampler.set_epoch(epoch)  # without it, every epoch repeats epoch 0's order
            for batch in loader:
                block = batch["input_ids"].to(device)
                x, y = block[:, :-1], block[:, 1:]
                _, loss = ddp(x, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP all-reduces (averages) the gradients, bucket by bucket, during backward
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), grad_clip)
                optimizer.step()

                # Each rank's loss is of its own shard: average it over ranks before reporting.
                metric = loss.detach().clone()
                dist.all_reduce(metric, op=dist.ReduceOp.SUM)  # SUM then divide: AVG is NCCL-only on some versions
                losses.append((metric / world_size).item())
                if rank == 0 and (len(losses) % log_every == 0 or len(losses) == 1):
                    print(f"step {len(losses):4d}  loss {losses[-1]:.4f}", flush=True)
                if len(losses) == steps:
                    break
            epoch += 1

        checkpoint = None
        if out is not None:
            checkpoint = str(Path(out) / "checkpoint.pt")
            if rank == 0:  # one writer: every rank holds the same weights
                Path(out).mkdir(parents=True, exist_ok=True)
                torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": len(losses)}, checkpoint)
                Path(out, "losses.json").write_text(json.dumps(losses))
                print(f"saved {checkpoint}", flush=True)
            dist.barrier()  # nobody reads (or exits) before the checkpoint exists
        return {"rank": rank, "world_size": world_size, "losses": losses, "checkpoint": checkpoint}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line: every option of :func:`train` as ``--name value``."""
    parser = argparse.ArgumentParser(description="Data-parallel GPT training with plain torch.distributed.")
    for name, default in [("steps", 20), ("batch-size", 8), ("block-size", 64), ("vocab-size", 1024),
                          ("n-layer", 2), ("n-head", 4), ("n-embd", 64), ("seed", 0), ("log-every", 5)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    for name, default in [("lr", 3e-3), ("weight-decay", 0.1), ("grad-clip", 1.0)]:
        parser.add_argument(f"--{name}", type=float, default=default)
    parser.add_argument("--out", default=None, help="folder for rank 0's checkpoint.pt and losses.json")
    return train(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
