"""Workers for tests/test_zero.py: ZeRO stage 1 on 2, 3 or 4 gloo ranks against DDP's arithmetic and torch's
ZeroRedundancyOptimizer."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from lslm.models.gpt import GPT, GPTConfig
from lslm.precision.master import MixedPrecisionOptimizer
from lslm.precision.scaler import DynamicLossScaler
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.zero import ZeroOptimizer
from lslm.zero.optimizer import GATHER_LABEL, REDUCE_SCATTER_LABEL

STEPS = 3
# 3 layers of width 24 and a 50-token vocabulary: 24,528 parameters (24,528 % 3 = 0 but buckets are not).
CONFIG = dict(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=24)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(_groups(model), lr=1e-3, betas=(0.9, 0.95), foreach=False)


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, CONFIG["vocab_size"], (2 * world, CONFIG["block_size"] + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _reference(model: GPT, batches: list, world: int, clip: float | None, accum: int = 1) -> GPT:
    """DDP's arithmetic in one process: the mean over ranks of each rank's mean loss (over ``accum`` micro-batches),
    one AdamW over everything."""
    model = copy.deepcopy(model)
    opt = _adamw(model)
    for x, y in batches:
        opt.zero_grad()
        shares = [(xr.chunk(accum), yr.chunk(accum)) for xr, yr in zip(x.chunk(world), y.chunk(world))]
        for k in range(accum):  # one backward per micro-batch, as the ranks do (sums in the same order)
            (sum(model(xs[k], ys[k])[1] / accum for xs, ys in shares) / world).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def _reference_half(model: GPT, batches: list, world: int, dtype: torch.dtype) -> GPT:
    """The same in half precision with fp32 masters and fp32 main_grad: one backward per rank's share, each of
    that share's mean loss (as each rank computes it), summed in the fp32 buffer, then divided by the world."""
    model = copy.deepcopy(model)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10) if dtype == torch.float16 else None
    mp = MixedPrecisionOptimizer(model, lambda ps: torch.optim.AdamW(
        [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95),
        foreach=False), dtype=dtype, scaler=scaler)
    for x, y in batches:
        mp.zero_grad()
        for xr, yr in zip(x.chunk(world), y.chunk(world)):
            mp.backward(model(xr, yr)[1])
        for p in mp.params:
            p.main_grad.div_(world)
        mp.step()
    return model


def _full(zero: ZeroOptimizer, model: GPT) -> GPT:
    """Stage 3's parameters gathered into a plain model (every rank takes part)."""
    plain = GPT(model.config)
    plain.load_state_dict(zero.full_state_dict())
    return plain


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((pa.detach().float() - pb.detach().float()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))


def _run_zero(ctx: ParallelContext, serial: GPT, batches: list, *, stage: int = 1, dtype: torch.dtype = torch.float32,
              bucket_cap_mb: float | None = 0.02, clip: float | None = None, accum: int = 1,
              reshard: bool = True) -> tuple[GPT, ZeroOptimizer, list[bool]]:
    model = copy.deepcopy(serial)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10) if dtype == torch.float16 else None
    zero = ZeroOptimizer(model, _adamw(model), ctx, stage=stage, dtype=dtype, scaler=scaler,
                         bucket_cap_mb=bucket_cap_mb, reshard_after_forward=reshard)
    stepped = []
    for x, y in batches:
        zero.zero_grad()
        xr, yr = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        for xm, ym in zip(xr.chunk(accum), yr.chunk(accum)):  # micro-batches: each backward reduces (stage 2)
            zero.backward(model(xm, ym)[1] / accum)
        stepped.append(zero.step(clip))
    return model, zero, stepped


def suite() -> dict[str, Any]:
    """Every check of one world size; rank 0's numbers (the replicas are compared by all ranks)."""
    ctx = init_distributed()
    world = ctx.world_size
    torch.manual_seed(0)
    serial = GPT(GPTConfig(**CONFIG))
    batches = _batches(world)
    out: dict[str, Any] = {"world": world}

    # fp32, several buckets, with and without clipping, against DDP's arithmetic; stage 2 also with 2 micro-batches.
    for clip in (None, 0.05):
        ref = _reference(serial, batches, world, clip)
        for stage in (3, 2, 1):
            model, zero, _ = _run_zero(ctx, serial, batches, stage=stage, clip=clip)
            out[f"stage{stage}_fp32_diff_clip{clip}"] = _max_diff(model if stage < 3 else _full(zero, model), ref)
    model2, _, _ = _run_zero(ctx, serial, batches, stage=2, accum=2)
    out["stage2_accum2_diff"] = _max_diff(model2, _reference(serial, batches, world, None, accum=2))
    model3, zero3, _ = _run_zero(ctx, serial, batches, stage=3, accum=2)
    out["stage3_accum2_diff"] = _max_diff(_full(zero3, model3), _reference(serial, batches, world, None, accum=2))
    out["stage3_units"] = len(zero3.unit_modules)
    out["stage3_max_buckets_gathered"] = zero3.max_buckets_gathered
    out["stage3_param_bytes"] = zero3.param_shard.numel() * 4
    out["stage3_empty_between_steps"] = all(p.numel() == 0 for p in model3.parameters())
    # Stage 3's traffic per step, with and without freeing each unit after its forward.
    ledger = ctx.comm.ledger
    for reshard in (True, False):
        m3, z3, _ = _run_zero(ctx, serial, batches[:1], stage=3, reshard=reshard)
        since = len(ledger.records)
        z3.zero_grad()
        z3.backward(m3(batches[0][0].chunk(world)[ctx.rank], batches[0][1].chunk(world)[ctx.rank])[1])
        z3.step()
        recs = ledger.snapshot()[since:]
        out[f"stage3_reshard{reshard}_ag_bytes"] = sum(r.nbytes for r in recs if r.label == GATHER_LABEL)
        out[f"stage3_reshard{reshard}_rs_bytes"] = sum(r.nbytes for r in recs if r.label == REDUCE_SCATTER_LABEL)
        out[f"stage3_reshard{reshard}_diff"] = _max_diff(_full(z3, m3), _reference(serial, batches[:1] * 2, world,
                                                                                    None))
    out["stage3_bucket_numels"] = [z - a for a, z, _, _ in z3.buckets]
    out["buckets"] = len(zero.grad_buffer.buckets)
    out["padding"] = sum(b.padding for b in zero.grad_buffer.buckets)
    out["owned"] = zero.layout.param_numel
    out["numel"] = zero.grad_buffer.numel
    out["num_params"] = sum(p.numel() for p in serial.parameters())
    # Every rank holds the same parameters after the all-gather.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    out["replicas_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
    # One step's traffic: a reduce-scatter and an all-gather of every bucket (padding included).
    ledger = ctx.comm.ledger
    since = len(ledger.records)
    zero.zero_grad()
    zero.backward(model(batches[0][0].chunk(world)[ctx.rank], batches[0][1].chunk(world)[ctx.rank])[1])
    zero.step()
    recs = ledger.snapshot()[since:]
    out["rs_bytes"] = sum(r.nbytes for r in recs if r.label == REDUCE_SCATTER_LABEL)
    out["ag_bytes"] = sum(r.nbytes for r in recs if r.label == GATHER_LABEL)
    out["state_numel"] = sum(t.numel() for s in zero.state.values() for k, t in s.items() if k != "step")

    # torch's ZeroRedundancyOptimizer (whole parameters per rank) on the same arithmetic.
    model_t = copy.deepcopy(serial)
    zro = ZeroRedundancyOptimizer(_groups(model_t), optimizer_class=torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95),
                                  foreach=False)
    for x, y in batches:
        zro.zero_grad()
        model_t(x.chunk(world)[ctx.rank], y.chunk(world)[ctx.rank])[1].backward()
        for p in model_t.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        zro.step()
    model_z, _, _ = _run_zero(ctx, serial, batches)
    out["vs_zero_redundancy"] = _max_diff(model_z, model_t)

    # torch's FSDP2 (fully_shard per block, then the root: the same units as stage 3's) on the same arithmetic.
    from torch.distributed.fsdp import fully_shard

    model_f = copy.deepcopy(serial)
    for block in model_f.blocks:
        fully_shard(block)
    fully_shard(model_f)
    opt_f = _adamw(model_f)
    for x, y in batches:
        opt_f.zero_grad()
        model_f(x.chunk(world)[ctx.rank], y.chunk(world)[ctx.rank])[1].backward()
        opt_f.step()
    fsdp_full = GPT(serial.config)
    fsdp_full.load_state_dict({n: p.full_tensor() for n, p in model_f.named_parameters()})
    model_3, zero_3, _ = _run_zero(ctx, serial, batches, stage=3)
    out["stage3_vs_fsdp2"] = _max_diff(_full(zero_3, model_3), fsdp_full)
    torch.distributed.barrier()  # DTensor users may abort at exit without one (DESIGN §10)

    # Half precision: bf16 and fp16 (loss scaling, vote over the group) against the same arithmetic in one
    # process (fp32 masters, fp32 main_grad), and how far either is from fp32 training.
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for stage in (3, 2, 1):
            model_h, zero_h, stepped = _run_zero(ctx, serial, batches, stage=stage, dtype=dtype)
            full = model_h if stage < 3 else _full(zero_h, model_h)
            out[f"{name}_stage{stage}_diff"] = _max_diff(full, _reference_half(serial, batches, world, dtype))
        out[f"{name}_vs_fp32"] = _max_diff(model_h, _reference(serial, batches, world, None))
        out[f"{name}_stepped"] = stepped
        out[f"{name}_dtype"] = str(next(model_h.parameters()).dtype)
    return out
