"""Workers for tests/test_hsdp.py: lslm's ZeRO in HSDP mode (dp = dp_replicate x dp_shard = 2 x 2 on 4 gloo ranks)
against one process, DDP on the same ranks, and torch's own HSDP (FSDP2 ``fully_shard`` on a 2-D mesh)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from lslm.metrics.held import held_by_owner
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.zero import ZeroOptimizer
from tests.zero_workers import CONFIG, _adamw, _batches, _ddp, _full, _max_diff

BUCKET_MB = 0.02


def _serial(serial: GPT, batches: list, world: int) -> tuple[GPT, list[float]]:
    """One process: each step's loss the mean of the ranks' mean losses, one AdamW over everything."""
    model = copy.deepcopy(serial)
    opt = _adamw(model)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = sum(model(xs, ys)[1] for xs, ys in zip(x.chunk(world), y.chunk(world))) / world
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _hsdp_run(ctx: ParallelContext, serial: GPT, batches: list, stage: int, *, clip: float | None = None,
              accum: int = 1) -> dict[str, Any]:
    """lslm's ZeRO at ``stage`` over ``ctx`` (an HSDP grid): the model, its losses, the last step's ledger."""
    world, rank = ctx.world_size, ctx.rank
    model = copy.deepcopy(serial)
    zero = ZeroOptimizer(model, _adamw(model), ctx, stage=stage, bucket_cap_mb=BUCKET_MB)
    ledger = ctx.comm.ledger
    losses, since = [], 0
    for x, y in batches:
        since = len(ledger.records)
        zero.zero_grad()
        total = torch.zeros(())
        for xm, ym in zip(x.chunk(world)[rank].chunk(accum), y.chunk(world)[rank].chunk(accum)):
            loss = model(xm, ym)[1] / accum
            zero.backward(loss)
            total += loss.detach()
        zero.step(clip)
        dist.all_reduce(total)  # outside the ledger: the test's own bookkeeping
        losses.append(total.item() / world)
    traffic: dict[str, int] = {}
    for r in ledger.records[since:]:
        key = f"{r.axis}|{r.op}|{r.label}"
        traffic[key] = traffic.get(key, 0) + r.nbytes
    return {"model": model if stage < 3 else _full(zero, model), "losses": losses, "traffic": traffic,
            "held": held_by_owner(model, zero), "pieces": len(zero.layout.pieces),
            "bucket_params": [z - a - pad for a, z, _, pad in zero.buckets],
            "bucket_numels": [z - a for a, z, _, _ in zero.buckets], "shard_world": zero.world,
            "replicas": zero.replicas}


def suite(recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every HSDP check on 4 ranks (2 replicas x 2 shards); rank-local numbers, each rank's. ``recipe``: settings
    of ``lslm.recipes.zero`` run with ``dp_shard=2`` at stage 3 in this process group (its record)."""
    ctx = init_distributed(dp_shard=2)
    world = ctx.world_size
    torch.manual_seed(0)
    serial = GPT(GPTConfig(**CONFIG))
    batches = _batches(world)
    ref, ref_losses = _serial(serial, batches, world)
    ddp = _ddp(ctx, serial, batches, None)
    out: dict[str, Any] = {"rank": ctx.rank, "shard_rank": ctx.dp_shard_rank, "replicate_rank": ctx.dp_replicate_rank,
                           "shard_group": ctx.group_ranks("dp_shard"),
                           "replicate_group": ctx.group_ranks("dp_replicate"),
                           "num_params": sum(p.numel() for p in serial.parameters())}
    models = {}
    for stage in (1, 2, 3):
        run = _hsdp_run(ctx, serial, batches, stage)
        model = models[stage] = run.pop("model")
        out[f"stage{stage}"] = {**run, "vs_serial": _max_diff(model, ref), "vs_ddp": _max_diff(model, ddp),
                                "loss_vs_serial": max(abs(a - b) for a, b in zip(run["losses"], ref_losses))}
    # The clip's norm (squared norms of the slices, summed over the shard group only) and accumulation (two
    # micro-batches reduce-scattered in the shard group, one all-reduce across replicas per step).
    clipped = _hsdp_run(ctx, serial, batches, 2, clip=0.05)
    out["stage2_clip_vs_ddp"] = _max_diff(clipped["model"], _ddp(ctx, serial, batches, 0.05))
    accum = _hsdp_run(ctx, serial, batches, 3, accum=2)
    out["stage3_accum2_vs_ddp"] = _max_diff(accum["model"], _ddp(ctx, serial, batches, None, accum=2))
    out["stage3_accum2_traffic"] = accum["traffic"]

    # torch's HSDP: FSDP2 over the 2-D mesh (dp_replicate, dp_shard), per block then the root, as stage 3's units.
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.dp_mesh
    model_f = copy.deepcopy(serial)
    for block in model_f.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model_f, mesh=mesh)
    opt_f = _adamw(model_f)
    losses_f = []
    for x, y in batches:
        opt_f.zero_grad()
        loss = model_f(x.chunk(world)[ctx.rank], y.chunk(world)[ctx.rank])[1]
        loss.backward()
        opt_f.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses_f.append(total.item() / world)
    torch_full = GPT(serial.config)
    torch_full.load_state_dict({n: p.full_tensor() for n, p in model_f.named_parameters()})
    out["torch_mesh"] = {"dims": list(mesh.mesh_dim_names), "mesh": mesh.mesh.tolist()}
    out["torch_vs_serial"] = _max_diff(torch_full, ref)
    out["torch_loss_vs_serial"] = max(abs(a - b) for a, b in zip(losses_f, ref_losses))
    out["torch_shard_numel"] = sum(p.to_local().numel() for p in model_f.parameters())
    for stage in (1, 2, 3):
        out[f"stage{stage}_loss_vs_torch"] = max(abs(a - b) for a, b in zip(out[f"stage{stage}"]["losses"], losses_f))
    for stage in (1, 2, 3):
        out[f"stage{stage}_params_vs_torch"] = _max_diff(models[stage], torch_full)
    dist.barrier()  # DTensor users may abort at exit without one (DESIGN §10)
    if recipe is not None:  # the recipe's --dp-shard, in this process group (its grid is already 2 x 2)
        from lslm.harness.recipe import train_loop
        from lslm.recipes import zero as R

        for stage in (3,):  # the other stages' HSDP arithmetic is checked above; this is the recipe's wiring
            cfg = R.ZeroConfig(**recipe, stage=stage, dp_shard=2)
            ctx.comm.ledger.reset()
            rec = train_loop(cfg, R.build(cfg, ctx), ctx)
            out[f"recipe_stage{stage}"] = {k: rec[k] for k in ("losses", "dp_shard", "dp_replicate", "rs_bytes",
                                                               "ag_bytes", "replicate_bytes", "padded_numel")}
    return out
