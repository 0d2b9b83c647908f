"""The lslm GPT trained with PyTorch Lightning's DDP strategy, on the data and optimiser of ``lslm.recipes.ddp``.

In Lightning the training step lives in a ``LightningModule``; the ``Trainer`` owns the
loop: it joins the process group, wraps the model in torch's ``DistributedDataParallel``
(``strategy="ddp"``), calls ``backward``, clips, steps and zeroes. Under torchrun it
starts no processes of its own (it recognises the torchelastic environment), so
``devices`` must equal the processes per node torchrun started.

By default the Trainer also swaps in a ``DistributedSampler`` (``use_distributed_sampler=True``);
here it is given lslm's :class:`~lslm.data.sampler.BaselineOrderSampler` instead, so that its
global batches are exactly those of the lslm run it is compared with.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lslm.data.dataset import token_blocks
from lslm.data.sampler import BaselineOrderSampler
from lslm.recipes.ddp import DDPConfig, check_config
from lslm.recipes.train import build_model, make_optimizer

__all__ = ["train_lightning", "worker"]


def train_lightning(cfg: DDPConfig) -> list[float]:
    """Train ``cfg`` with ``lightning.Trainer(strategy="ddp")`` on this torchrun job; return the global loss per step.

    Joins the process group itself when none exists (as in a script), else uses the one there.
    """
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # lightning 2.6 vs torch 2.13, harmless
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    import lightning as L

    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    per_rank = check_config(cfg, world_size)
    for name in ("lightning.pytorch", "lightning.fabric"):  # "GPU available: False", "Initializing distributed"
        logging.getLogger(name).setLevel(logging.ERROR)

    class GPTModule(L.LightningModule):
        """The lslm GPT as a LightningModule: the step returns the loss, Lightning does the rest."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(cfg)  # seeded: the same weights on every rank
            self.local_losses: list[torch.Tensor] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            block = batch["input_ids"]
            _, loss = self.model(block[:, :-1], block[:, 1:])
            self.local_losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.model, cfg)

    blocks = token_blocks(cfg.block_size, cfg.vocab_size)
    sampler = BaselineOrderSampler(blocks, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed,
                                   drop_last=True)
    loader = DataLoader(blocks, batch_size=per_rank, sampler=sampler, drop_last=True)
    module = GPTModule()
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=local_world, num_nodes=world_size // local_world,
                        max_steps=cfg.steps, max_epochs=-1, gradient_clip_val=cfg.grad_clip or None,
                        gradient_clip_algorithm="norm", use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, loader)
    local = torch.stack(module.local_losses)
    dist.all_reduce(local)  # SUM, then divide: the mean of the ranks' losses, as lslm reports it
    return (local / world_size).tolist()


def worker(**kwargs: Any) -> dict[str, Any]:
    """One rank (``lslm.launch("lslm.integrations.lightning_ddp:worker", nproc=2, steps=10)``); kwargs: DDPConfig."""
    cfg = DDPConfig(**{"device": "cpu", **kwargs})
    losses = train_lightning(cfg)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {"framework": "lightning", "losses": losses}
