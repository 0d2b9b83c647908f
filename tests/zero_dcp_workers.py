"""Workers for tests/test_zero_dcp.py: lslm's ZeRO saves at one world size, torch's FSDP2 loads the DCP export at
another with ``torch.distributed.checkpoint`` (resharding is DCP's), and compares with the consolidated files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.zero import ZeroOptimizer
from lslm.zero.checkpoint import consolidate, save_zero
from tests.zero_workers import CONFIG, _adamw, _batches, _train

__all__ = ["fsdp2_load", "zero_save"]


def zero_save(folder: str) -> dict[str, Any]:
    """ZeRO stage 3 for two steps, then a sharded checkpoint in ``folder/zero``."""
    ctx = init_distributed()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    zero = ZeroOptimizer(model, _adamw(model), ctx, stage=3)
    _train(zero, model, _batches(ctx.world_size)[:2], ctx.world_size, ctx.rank)
    save_zero(zero, Path(folder) / "zero", step=2)
    return {"world": ctx.world_size}


def fsdp2_load(folder: str) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` per block and the root) over a model of *other* initial weights, then ``dcp.load`` of
    ``folder/dcp``: parameters and Adam's moments as DTensors, compared whole with :func:`consolidate`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    ctx = init_distributed()
    torch.manual_seed(1)  # not the saved weights: the load must replace every value
    model = GPT(GPTConfig(**CONFIG))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    params = dict(model.named_parameters())
    state = {"model": dict(params),
             "optim": {n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                           "step": torch.zeros(())} for n, p in params.items()}}
    dcp.load(state, checkpoint_id=str(Path(folder) / "dcp"))
    saved, saved_state = consolidate(Path(folder) / "zero", with_state=True)
    out = {"world": ctx.world_size,
           "sharded": all(p.to_local().numel() < p.numel() for p in params.values() if p.shape[0] >= ctx.world_size),
           "names_equal": sorted(params) == sorted(saved),
           "params_equal": all(torch.equal(p.full_tensor(), saved[n]) for n, p in params.items()),
           "moved_from_init": all(not torch.equal(before[n], saved[n]) for n in params),
           "moments_equal": all(torch.equal(state["optim"][n][k].full_tensor(), saved_state[n][k])
                                for n in params for k in ("exp_avg", "exp_avg_sq")),
           "steps": sorted({float(state["optim"][n]["step"]) for n in params})}
    torch.distributed.barrier()  # DTensor users may abort at exit without one
    return out
