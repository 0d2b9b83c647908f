"""Workers for tests/test_zero_deepspeed.py: lslm's ZeRO stages 1-3 against DeepSpeed's on the same GPT, data and
client AdamW, fp32, in one launch (one DeepSpeed import and op load per rank)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lslm.integrations.deepspeed_zero import build_engine
from lslm.metrics.held import held_by_owner
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.zero import ZeroOptimizer
from tests.zero_workers import CONFIG, _adamw, _batches, _max_diff


def _full_deepspeed(engine: Any, config: GPTConfig) -> GPT:
    """DeepSpeed's parameters as a plain model; stage 3 gathers its partitions (every rank takes part)."""
    import deepspeed

    plain = GPT(config)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        with torch.no_grad():
            for dst, src in zip(plain.parameters(), params):
                dst.copy_(src)
    return plain


def _run_deepspeed(serial: GPT, batches: list, world: int, rank: int, stage: int,
                   offload: str | None) -> tuple[GPT, list[float], dict[str, int], Any]:
    model = copy.deepcopy(serial)
    rows = batches[0][0].shape[0] // world
    engine = build_engine(model, _adamw(model), stage, rows, offload=offload)
    losses = []
    for x, y in batches:
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    held = held_by_owner(engine.module, engine.optimizer)
    return _full_deepspeed(engine, serial.config), losses, held, engine


def _run_lslm(ctx: Any, serial: GPT, batches: list, stage: int) -> tuple[nn.Module, list[float], dict[str, int]]:
    model = copy.deepcopy(serial)
    zero = ZeroOptimizer(model, _adamw(model), ctx, stage=stage, bucket_cap_mb=0.02)
    losses = []
    for x, y in batches:
        zero.zero_grad()
        loss = model(x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank])[1]
        zero.backward(loss)
        zero.step()
        losses.append(loss.item())
    held = held_by_owner(model, zero)
    if stage == 3:
        plain = GPT(model.config)
        plain.load_state_dict(zero.full_state_dict())
        model = plain
    return model, losses, held


def suite() -> dict[str, Any]:
    """Stages 1, 2, 3 (and 2, 3 with the optimizer on the host): lslm and DeepSpeed from the same weights; the
    largest parameter and loss differences, and each one's bytes by owner after the last step."""
    out: dict[str, Any] = {}
    with init_distributed(device="cpu", seed=0) as ctx:
        world, rank = ctx.world_size, ctx.rank
        torch.manual_seed(0)
        serial = GPT(GPTConfig(**CONFIG))
        batches = _batches(world)
        out["numel"] = sum(p.numel() for p in serial.parameters())
        engines = []
        for stage in (1, 2, 3):
            ours, our_losses, our_held = _run_lslm(ctx, serial, batches, stage)
            theirs, ds_losses, ds_held, engine = _run_deepspeed(serial, batches, world, rank, stage, None)
            engines.append(engine)
            out[f"stage{stage}_param_diff"] = _max_diff(ours, theirs)
            out[f"stage{stage}_loss_diff"] = max(abs(a - b) for a, b in zip(our_losses, ds_losses))
            out[f"stage{stage}_moved"] = _max_diff(theirs, serial)
            out[f"lslm{stage}_held"], out[f"deepspeed{stage}_held"] = our_held, ds_held
            if stage > 1:
                offloaded, _, off_held, engine = _run_deepspeed(serial, batches, world, rank, stage, "cpu")
                engines.append(engine)
                out[f"stage{stage}_offload_param_diff"] = _max_diff(ours, offloaded)
                out[f"deepspeed{stage}_offload_held"] = off_held
        for engine in engines:
            engine.destroy()  # before the process group ends (a rare abort at exit otherwise)
    return out
