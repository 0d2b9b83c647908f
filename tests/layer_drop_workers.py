"""Workers for tests/test_layer_drop.py: progressive layer dropping under data parallelism (2 gloo ranks).

Every rank trains the same PLD GPT with lslm's naive and bucketed DDP and torch's DDP (all with
``find_unused_parameters=True``: skipped blocks have no gradient), the PLD generator seeded alike on every
rank, and also computes the serial reference itself (the whole global batch, the same seed): cheaper than
shipping tensors around. It returns the largest differences and the masks it drew.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lslm.data_parallel.ddp import make_ddp
from lslm.layer_drop import PLDSchedule, apply_progressive_layer_drop
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed

CONFIG = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
ROWS = 2  # rows per rank
STEPS = 5
SCHEDULE = PLDSchedule(theta_bar=0.5, gamma=0.5)  # decays within the few steps: blocks do get skipped
PLD_SEED = 7


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (rows, CONFIG["block_size"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: nn.Module, step_fn: Any, rows: slice, world: int) -> tuple[list[float], list[list[bool]], nn.Module]:
    pld = apply_progressive_layer_drop(model, SCHEDULE, generator=torch.Generator().manual_seed(PLD_SEED))
    # SGD with momentum: the update is linear in the gradient, so rounding differences stay rounding-sized
    # (Adam divides by sqrt(v) and magnifies them where gradients are near zero).
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, masks = [], []
    for step in range(STEPS):
        x, y = _batch(step, ROWS * world)
        opt.zero_grad()
        losses.append(step_fn(x[rows], y[rows]))
        masks.append(list(pld.mask))
        opt.step()
        pld.step()
    return losses, masks, model


def dp_vs_serial() -> dict[str, Any]:
    """Serial PLD run vs lslm naive / bucketed DDP and torch DDP at this world size, same seeds."""
    with init_distributed() as ctx:
        world, rank = ctx.dp_size, ctx.dp_rank
        torch.manual_seed(0)
        start = GPT(GPTConfig(**CONFIG))
        serial = copy.deepcopy(start)

        def serial_step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = serial(x, y)[1]
            loss.backward()
            return loss.item()

        ref_losses, ref_masks, _ = _train(serial, serial_step, slice(None), world)
        out: dict[str, Any] = {"masks": ref_masks, "ref_losses": ref_losses, "skipped_none": True}
        for variant in ("naive", "bucketed", "torch"):
            model = copy.deepcopy(start)
            ddp = make_ddp(model, ctx, variant=variant, find_unused_parameters=True)

            def dp_step(x: torch.Tensor, y: torch.Tensor, ddp: Any = ddp) -> float:
                loss = ddp(x, y)[1]
                loss.backward()
                ddp.finish_grad_sync()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                return mean.item() / world

            losses, masks, model = _train(model, dp_step, slice(rank * ROWS, (rank + 1) * ROWS), world)
            # After the last step's sync: a block skipped in that step has no gradient on any rank.
            last = masks[-1]
            none = [all(p.grad is None for p in model.blocks[i].parameters()) for i in range(len(last))]
            out["skipped_none"] &= none == [not k for k in last]
            out[variant] = {
                "masks_equal": masks == ref_masks,
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "param_diff": max((a - b).abs().max().item()
                                  for a, b in zip(model.parameters(), serial.parameters())),
            }
        return out
