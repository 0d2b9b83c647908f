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
ROWS = 12
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
        # 12 rows whatever the world size (2, 3, 4 and 6 divide it): a checkpoint continues on the same data.
        x = torch.randint(0, CONFIG["vocab_size"], (ROWS, CONFIG["block_size"] + 1), generator=g)
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


def _ddp(ctx: ParallelContext, model: GPT, batches: list, clip: float | None, accum: int = 1) -> GPT:
    """DDP itself, on these ranks: each rank's gradient of its rows all-reduced (per micro-batch, as torch DDP does
    outside ``no_sync``; the sums added up), divided by the world size, then clip and AdamW over every parameter."""
    world, rank = ctx.world_size, ctx.rank
    model = copy.deepcopy(model)
    opt = _adamw(model)
    for x, y in batches:
        opt.zero_grad()
        xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]
        total = [torch.zeros_like(p) for p in model.parameters()]
        for xm, ym in zip(xr.chunk(accum), yr.chunk(accum)):
            for p in model.parameters():
                p.grad = None
            (model(xm, ym)[1] / accum).backward()
            for t, p in zip(total, model.parameters()):
                torch.distributed.all_reduce(p.grad)
                t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / world
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
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
              reshard: bool = True, offload: str | None = None,
              offload_dir: str | None = None) -> tuple[GPT, ZeroOptimizer, list[bool]]:
    model = copy.deepcopy(serial)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10) if dtype == torch.float16 else None
    zero = ZeroOptimizer(model, _adamw(model), ctx, stage=stage, dtype=dtype, scaler=scaler,
                         bucket_cap_mb=bucket_cap_mb, reshard_after_forward=reshard, offload=offload,
                         offload_dir=offload_dir, disk_chunk_mb=0.02)
    stepped = []
    for x, y in batches:
        zero.zero_grad()
        xr, yr = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        for xm, ym in zip(xr.chunk(accum), yr.chunk(accum)):  # micro-batches: each backward reduces (stage 2)
            zero.backward(model(xm, ym)[1] / accum)
        stepped.append(zero.step(clip))
    return model, zero, stepped


def _train(zero: ZeroOptimizer, model: GPT, batches: list, world: int, rank: int) -> None:
    for x, y in batches:
        zero.zero_grad()
        zero.backward(model(x.chunk(world)[rank], y.chunk(world)[rank])[1])
        zero.step()


def _fresh(ctx: ParallelContext, serial: GPT, stage: int, dtype: torch.dtype = torch.float32,
           bucket_cap_mb: float | None = 0.02) -> tuple[GPT, ZeroOptimizer]:
    model = copy.deepcopy(serial)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10) if dtype == torch.float16 else None
    return model, ZeroOptimizer(model, _adamw(model), ctx, stage=stage, dtype=dtype, scaler=scaler,
                                bucket_cap_mb=bucket_cap_mb)


def _files_read(zero: ZeroOptimizer, folder: Any) -> dict[str, list[list[str]]]:
    """Load ``folder`` into ``zero``, counting the shard files each rank reads; also, per rank, the files that hold
    an element of its pieces, found element by element (sets), not by the loader's range test."""
    import lslm.zero.checkpoint as ckpt

    read: list[str] = []
    original = ckpt._read_shard

    def counting(where: Any, record: Any) -> Any:
        read.append(record["file"])
        return original(where, record)

    ckpt._read_shard = counting
    try:
        manifest = ckpt.load_zero(zero, folder)
    finally:
        ckpt._read_shard = original
    names = {id(p): n for n, p in zero.model.named_parameters()}
    mine = {(names[id(zero.params[pc.param])], e) for pc in zero.layout.pieces for e in range(pc.start, pc.stop)}
    needed = sorted(rec["file"] for rec in manifest["shards"]
                    if any((n, e) in mine for n, a, z in rec["ranges"] for e in range(a, z)))
    both = [sorted(read), needed]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, both)
    return {"read": [g[0] for g in gathered], "needed": [g[1] for g in gathered]}


def _params(zero: ZeroOptimizer, model: GPT) -> GPT:
    return model if zero.stage < 3 else _full(zero, model)


def _ddp_from(ctx: ParallelContext, serial: GPT, folder: Any, batches: list) -> GPT:
    """DDP (all-reduce, / N, AdamW) continuing from a checkpoint's consolidated parameters and optimizer state."""
    from lslm.zero.checkpoint import consolidate

    params, state = consolidate(folder, with_state=True)
    plain = GPT(serial.config)
    plain.load_state_dict(params)
    opt = _adamw(plain)
    for n, p in plain.named_parameters():
        opt.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state[n].items()}
    world, rank = ctx.world_size, ctx.rank
    for x, y in batches:
        opt.zero_grad()
        plain(x.chunk(world)[rank], y.chunk(world)[rank])[1].backward()
        for p in plain.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    return plain


def checkpoints(ctx: ParallelContext, serial: GPT, batches: list, folder: str) -> dict[str, Any]:
    """Save after 2 steps, resume in a fresh optimizer, 2 more steps: the same parameters as without the break.
    Also: load the checkpoint another world size saved (``folder/w2``, if there), and refuse bad ones."""
    from pathlib import Path

    from lslm.zero.checkpoint import consolidate, load_zero, save_zero

    world, rank = ctx.world_size, ctx.rank
    out: dict[str, Any] = {}
    root = Path(folder)
    for stage, dtype in ((1, torch.float32), (2, torch.float16), (3, torch.bfloat16), (3, torch.float32)):
        tag = f"stage{stage}-{str(dtype)[6:]}"
        model, zero = _fresh(ctx, serial, stage, dtype)
        _train(zero, model, batches[:2], world, rank)
        where = save_zero(zero, root / f"w{world}" / tag / "step2", step=2, extra={"tag": tag})
        at_save = {n: p.detach().clone() for n, p in _params(zero, model).named_parameters()}
        _train(zero, model, batches[2:], world, rank)
        model_b, zero_b = _fresh(ctx, serial, stage, dtype)
        manifest = load_zero(zero_b, where)
        _train(zero_b, model_b, batches[2:], world, rank)
        out[f"resume_{tag}"] = _max_diff(_params(zero, model), _params(zero_b, model_b))
        out[f"manifest_{tag}"] = {k: manifest[k] for k in ("world", "stage", "step", "extra")}
        if stage == 1 and dtype == torch.float32 and rank == 0:
            full = consolidate(where)  # fp32 from the files alone, no process group
            out["consolidated_exact"] = all(torch.equal(full[n], at_save[n]) for n in at_save)
    # Under disk offload the states come from, and go back to, the files.
    kw = dict(offload="disk", offload_dir=str(root / f"w{world}" / "disk-a"), disk_chunk_mb=0.02)
    model_d = copy.deepcopy(serial)
    zero_d = ZeroOptimizer(model_d, _adamw(model_d), ctx, stage=2, bucket_cap_mb=0.02, **kw)
    _train(zero_d, model_d, batches[:2], world, rank)
    where = save_zero(zero_d, root / f"w{world}" / "disk" / "step2", step=2)
    _train(zero_d, model_d, batches[2:], world, rank)
    model_e = copy.deepcopy(serial)
    zero_e = ZeroOptimizer(model_e, _adamw(model_e), ctx, stage=2, bucket_cap_mb=0.02,
                           **{**kw, "offload_dir": str(root / f"w{world}" / "disk-b")})
    load_zero(zero_e, where)
    _train(zero_e, model_e, batches[2:], world, rank)
    out["resume_disk"] = _max_diff(model_d, model_e)
    four = root / "w4" / "stage3-float32" / "step2"
    if world == 2 and four.exists():  # 4 -> 2: a stage-3 checkpoint of 4 ranks, continued here at stage 2
        params, _ = consolidate(four, with_state=True)
        model_f, zero_f = _fresh(ctx, serial, 2)
        load_zero(zero_f, four)
        out["reshard_4_exact"] = all(torch.equal(p.detach(), params[n]) for n, p in model_f.named_parameters())
        plain = _ddp_from(ctx, serial, four, batches[2:])
        _train(zero_f, model_f, batches[2:], world, rank)
        out["reshard_4_to_here"] = _max_diff(model_f, plain)
    # One bucket at stage 1: a rank's slice is one range, so it needs only the files whose ranges meet it.
    one = root / "w4" / "stage1-onebucket" / "step2"
    if world == 2 and one.exists():  # 4 -> 2: rank r of 2 holds what ranks 2r and 2r + 1 of 4 wrote
        out["read_4_to_2"] = _files_read(_fresh(ctx, serial, 1, bucket_cap_mb=None)[1], one)
        model_o, zero_o = _fresh(ctx, serial, 1, bucket_cap_mb=None)
        _train(zero_o, model_o, batches[:2], world, rank)
        save_zero(zero_o, root / "w2" / "stage1-onebucket" / "step2", step=2)
    one = root / "w2" / "stage1-onebucket" / "step2"
    if world == 3 and one.exists():  # 2 -> 3: ranks 0 and 2 of 3 lie inside one file each, rank 1 across both
        out["read_2_to_3"] = _files_read(_fresh(ctx, serial, 1, bucket_cap_mb=None)[1], one)
    other = root / "w2" / "stage1-float32" / "step2"
    if world != 2 and other.exists():  # resharding: a 2-rank checkpoint continues at this world size
        model_r, zero_r = _fresh(ctx, serial, 1)
        load_zero(zero_r, other)
        # The load is exact: saved again at this size, the files hold the same parameters and Adam state.
        again = save_zero(zero_r, root / f"w{world}" / "reloaded", step=2)
        if rank == 0:
            (p2, s2), (p3, s3) = consolidate(other, with_state=True), consolidate(again, with_state=True)
            out["reshard_exact"] = all(torch.equal(p2[n], p3[n]) for n in p2) and all(
                torch.equal(torch.as_tensor(s2[n][k]), torch.as_tensor(s3[n][k])) for n in s2 for k in s2[n])
        # And the run goes on as DDP would from that state, on this many ranks.
        plain = _ddp_from(ctx, serial, other, batches[2:])
        _train(zero_r, model_r, batches[2:], world, rank)
        out["reshard_2_to_here"] = _max_diff(model_r, plain)
        model_r3, zero_r3 = _fresh(ctx, serial, 3)
        load_zero(zero_r3, other)  # a stage-1 checkpoint into stage 3: ranges are ranges
        _train(zero_r3, model_r3, batches[2:], world, rank)
        out["reshard_2_stage1_to_stage3_here"] = _max_diff(_full(zero_r3, model_r3), model_r)
    # Refusals: another model; an existing complete checkpoint is never overwritten.
    small = GPT(GPTConfig(**{**CONFIG, "n_layer": 2}))
    _, zero_s = _fresh(ctx, small, 1)
    errors = {}
    for name, fn in (("other_model", lambda: load_zero(zero_s, root / f"w{world}" / "stage1-float32" / "step2")),
                     ("overwrite", lambda: save_zero(zero_s, root / f"w{world}" / "stage1-float32" / "step2", step=2))):
        try:
            fn()
            errors[name] = ""
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def save_at_four(folder: str) -> dict[str, Any]:
    """At 4 ranks: stage 3 for 2 steps, then a checkpoint in ``folder/w4`` (the 2-rank suite loads it: 4 -> 2)."""
    from pathlib import Path

    from lslm.zero.checkpoint import save_zero

    ctx = init_distributed()
    torch.manual_seed(0)
    serial = GPT(GPTConfig(**CONFIG))
    batches = _batches(ctx.world_size) + _batches(ctx.world_size)[:1]
    model, zero = _fresh(ctx, serial, 3)
    _train(zero, model, batches[:2], ctx.world_size, ctx.rank)
    save_zero(zero, Path(folder) / "w4" / "stage3-float32" / "step2", step=2)
    return {"rank": ctx.rank, **_refusals_at_four(ctx, serial, batches, Path(folder))}


def _refusals_at_four(ctx: ParallelContext, serial: GPT, batches: list, root: Any) -> dict[str, Any]:
    """Stage 1, one bucket, 4 ranks: a good checkpoint at step 2, a later one (step 3) broken in one file that only
    one rank reads (truncated: rank 0's file; deleted: rank 3's). Every rank tries the broken one, then falls back
    to the good one: each rank's error, whether the refused load changed anything, the step resumed, and how far
    the fallback run is from the uninterrupted one after the same next step."""
    import shutil

    from lslm.zero.checkpoint import load_zero, save_zero, shard_name

    world, rank = ctx.world_size, ctx.rank
    model, zero = _fresh(ctx, serial, 1, bucket_cap_mb=None)
    _train(zero, model, batches[:2], world, rank)
    good = save_zero(zero, root / "w4" / "stage1-onebucket" / "step2", step=2)
    _train(zero, model, batches[2:3], world, rank)
    bad = save_zero(zero, root / "w4-truncated" / "step3", step=3)
    torch.distributed.barrier()
    deleted = root / "w4-deleted" / "step3"
    if rank == 0:
        shutil.copytree(bad, deleted)
        (deleted / shard_name(3, world)).unlink()
        first = bad / shard_name(0, world)
        first.write_bytes(first.read_bytes()[:1000])
    torch.distributed.barrier()
    out: dict[str, Any] = {}
    for tag, folder in (("truncated", bad), ("deleted", deleted)):
        model_t, zero_t = _fresh(ctx, serial, 1, bucket_cap_mb=None)
        before = [m.detach().clone() for m in zero_t.masters] + [p.detach().clone() for p in model_t.parameters()]
        try:
            load_zero(zero_t, folder)
            out[f"{tag}_error"] = ""
        except ValueError as e:
            out[f"{tag}_error"] = str(e)
        after = [m.detach() for m in zero_t.masters] + [p.detach() for p in model_t.parameters()]
        out[f"{tag}_untouched"] = all(torch.equal(a, b) for a, b in zip(before, after)) and not zero_t.state
        out[f"{tag}_resumed_step"] = load_zero(zero_t, good)["step"]
        _train(zero_t, model_t, batches[2:3], world, rank)
        out[f"{tag}_fallback_diff"] = _max_diff(model_t, model)
    return out


def suite(folder: str | None = None) -> dict[str, Any]:
    """Every check of one world size; rank 0's numbers (the replicas are compared by all ranks)."""
    ctx = init_distributed()
    world = ctx.world_size
    torch.manual_seed(0)
    serial = GPT(GPTConfig(**CONFIG))
    batches = _batches(world)
    out: dict[str, Any] = {"world": world}

    # fp32, several buckets, with and without clipping, against DDP's arithmetic; stage 2 also with 2 micro-batches.
    for clip in (None, 0.05):
        ref = _ddp(ctx, serial, batches, clip)
        for stage in (3, 2, 1):
            model, zero, _ = _run_zero(ctx, serial, batches, stage=stage, clip=clip)
            out[f"stage{stage}_fp32_diff_clip{clip}"] = _max_diff(model if stage < 3 else _full(zero, model), ref)
    model2, _, _ = _run_zero(ctx, serial, batches, stage=2, accum=2)
    out["stage2_accum2_diff"] = _max_diff(model2, _ddp(ctx, serial, batches, None, accum=2))
    model3, zero3, _ = _run_zero(ctx, serial, batches, stage=3, accum=2)
    out["stage3_accum2_diff"] = _max_diff(_full(zero3, model3), _ddp(ctx, serial, batches, None, accum=2))
    # The same arithmetic in one process (sum over ranks' mean losses / world): bit-equal at dp = 2, where x 1/2 is
    # exact and a sum of two has one order; at dp = 3 autograd scales each rank's share by 1/3 before summing.
    out["stage1_vs_one_process"] = _max_diff(_run_zero(ctx, serial, batches, stage=1)[0],
                                             _reference(serial, batches, world, None))
    out["stage3_units"] = len(zero3.unit_modules)
    out["stage3_max_buckets_gathered"] = zero3.max_buckets_gathered
    out["stage3_param_bytes"] = zero3.param_shard.numel() * 4
    out["stage3_empty_between_steps"] = all(p.numel() == 0 for p in model3.parameters())
    out["stage3_buffer_bytes_between_steps"] = zero3.gather.storage_bytes()
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
        out[f"stage3_reshard{reshard}_diff"] = _max_diff(_full(z3, m3), _ddp(ctx, serial, batches[:1] * 2, None))
    out["stage3_bucket_numels"] = [z - a for a, z, _, _ in z3.buckets]
    # Stage 3 from the meta device: each rank materialises only its slices (replaying the serial build), the same run.
    from lslm.metrics.allocations import track_live_bytes

    ref3, zref3, _ = _run_zero(ctx, serial, batches, stage=3, dtype=torch.bfloat16)
    with track_live_bytes() as live:
        with torch.device("meta"):
            meta_model = GPT(GPTConfig(**CONFIG))
        zero_m = ZeroOptimizer(meta_model, _adamw(meta_model), ctx, stage=3, dtype=torch.bfloat16,
                               bucket_cap_mb=0.02, init_seed=0)
    out["stage3_meta_start_peak"] = live.peak["cpu"]
    out["stage3_meta_start_held"] = live.current["cpu"]
    for x, y in batches:
        zero_m.zero_grad()
        zero_m.backward(meta_model(x.chunk(world)[ctx.rank], y.chunk(world)[ctx.rank])[1])
        zero_m.step()
    out["stage3_meta_diff"] = _max_diff(_full(zero_m, meta_model), _full(zref3, ref3))
    # ZeRO-Offload: the same arithmetic with the states and the step on the host, the bytes moved counted.
    for stage, dtype in ((1, torch.float32), (2, torch.bfloat16), (3, torch.float32)):
        tag = f"stage{stage}-{str(dtype)[6:]}"
        plain, zp, _ = _run_zero(ctx, serial, batches, stage=stage, dtype=dtype)
        off, zo, _ = _run_zero(ctx, serial, batches, stage=stage, dtype=dtype, offload="cpu", clip=None)
        out[f"offload_{tag}_diff"] = _max_diff(_params(zp, plain), _params(zo, off))
        out[f"offload_{tag}_bytes"] = dict(zo.offload_bytes)
        out[f"offload_{tag}_owned"] = zo.layout.param_numel
        out[f"offload_{tag}_states_on"] = sorted({t.device.type for st in zo.state.values() for t in st.values()
                                                  if isinstance(t, torch.Tensor)} | {m.device.type for m in zo.masters})
    if folder is not None:  # ZeRO-Infinity-style: states in files, streamed in chunks through memory
        from pathlib import Path

        for stage in (1, 3):
            disk_dir = str(Path(folder) / f"disk-w{world}-stage{stage}")
            plain, zp, _ = _run_zero(ctx, serial, batches, stage=stage, clip=0.05)
            ondisk, zd, _ = _run_zero(ctx, serial, batches, stage=stage, clip=0.05, offload="disk",
                                      offload_dir=disk_dir)
            out[f"disk_stage{stage}_diff"] = _max_diff(_params(zp, plain), _params(zd, ondisk))
            out[f"disk_stage{stage}_chunks"] = len(zd.disk.chunks)
            out[f"disk_stage{stage}_moved"] = dict(zd.disk.bytes_moved)
            out[f"disk_stage{stage}_resident_states"] = sum(
                t.numel() for st in zd.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim())
            out[f"disk_stage{stage}_owned"] = zd.layout.param_numel
            zd.disk.close()
    if folder is not None:
        out["checkpoints"] = checkpoints(ctx, serial, _batches(world) + _batches(world)[:1], folder)
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
