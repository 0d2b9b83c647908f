"""Workers for tests/test_three_d.py: TP (+SP) inside pipeline stages, DP or ZeRO-1 across, against one process.

One launch runs a list of cases (processes start once: 2 CPU cores are shared by 8 ranks).
Every rank trains the serial GPT itself (same seed, same batches, fp32), then each case:
builds the GPT on the meta device, :func:`lslm.three_d.apply_3d` over the case's grid,
trains ``STEPS`` steps of AdamW with global-norm clipping (plain data parallelism on per-stage
gradient buffers, or ZeRO-1), and reports the largest loss and parameter differences against
the serial run, its parameters compared shard by shard (the serial weights cut by
``apply_tensor_parallel`` on the same tp rank).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lslm.data_parallel.grad_sync import attach_grad_buffers
from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.apply import PipelinePlan
from lslm.recipes.train import TrainConfig, adamw, prepare_training
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.three_d import ThreeDPlan, apply_3d
from lslm.zero import ZeroOptimizer

SEED, ROWS, T, VOCAB, STEPS = 1234, 8, 16, 96, 3
#: A clip low enough that every step clips (the norm of these gradients is ~1-3), so a wrong norm shows.
CLIP = 0.5
#: lr 1e-3: Adam's near-sign first updates turn an fp32 rounding in a gradient into up to ~lr x that relative
#: error on a parameter whose gradient is near 0; a missing or doubled reduction moves parameters by ~lr.
OPTIM = TrainConfig(lr=1e-3, weight_decay=0.1, grad_clip=CLIP)


def config(tied: bool) -> GPTConfig:
    """The tiny GPT every case trains: 4 blocks (interleaved needs 2 x pp = 4 stages), 2 heads (tp = 2)."""
    return GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=T, vocab_size=VOCAB, dropout=0.0, tie_weights=tied)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` fixed global batches of token ids and next-token targets."""
    g = torch.Generator().manual_seed(7)
    tok = torch.randint(0, VOCAB, (STEPS, ROWS, T + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tok]


def serial(tied: bool) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, gradient norms and final parameters of the whole run in one process (fp32 AdamW, torch's clip)."""
    torch.manual_seed(SEED)
    model = GPT(config(tied))
    opt = prepare_training(model, OPTIM).optimizer
    losses, norms = [], []

    def clip(params: Any, max_norm: float) -> torch.Tensor:
        norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm).item())
        return norms[-1]
    for x, y in batches():
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step(CLIP, clip=clip)
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_shards(ctx: ParallelContext, state: dict[str, torch.Tensor], tied: bool,
                     sp: bool) -> dict[str, torch.Tensor]:
    """The serial parameters as this tp rank holds them: the serial GPT cut by ``apply_tensor_parallel``."""
    with torch.device("meta"):
        model = GPT(config(tied))
    model.to_empty(device=ctx.device)
    model.load_state_dict(state)
    if tied:
        model.lm_head.weight = model.wte.weight
    if ctx.tp_size > 1:
        apply_tensor_parallel(model, ctx, sequence_parallel=sp)
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def run_case(ctx: ParallelContext, case: dict[str, Any], refs: dict[bool, tuple[list[float], list[float], dict]]
             ) -> dict[str, Any]:
    """One configuration: train ``STEPS`` steps on the case's grid; the largest differences from the serial run."""
    t0 = time.perf_counter()
    pctx = ctx.with_grid(tp=case["tp"], pp=case["pp"], dp=case["dp"])
    tied, sp, zero = case.get("tied", False), case.get("sp", False), case.get("zero", 0)
    v = 2 if case["schedule"] == "interleaved" else 1
    plan = ThreeDPlan(PipelinePlan(case["schedule"], microbatches=case.get("m", 2), virtual_stages=v),
                      sequence_parallel=sp, zero=zero)
    with torch.device("meta"):
        model = GPT(config(tied))
    tdp = apply_3d(model, pctx, plan, init_seed=SEED)
    norms: list[float] = []
    if zero:
        zopt = ZeroOptimizer(tdp.local, adamw(list(tdp.local.parameters()), OPTIM), pctx, stage=zero)

        def step() -> None:
            zopt.step(CLIP)
            norms.append(zopt.last_grad_norm)
        opt: Any = zopt
    else:
        for stage in tdp.local:
            attach_grad_buffers(stage, pctx)
        opt = prepare_training(tdp.local, OPTIM, ctx=pctx).optimizer

        def clip(params: Any, max_norm: float) -> torch.Tensor:
            norms.append(tdp.clip_grad_norm_(params, max_norm).item())
            return norms[-1]

        def step() -> None:
            opt.step(CLIP, clip=clip)
    rows = ROWS // pctx.dp_size
    losses = []
    for x, y in batches():
        opt.zero_grad()
        mine = slice(pctx.dp_rank * rows, (pctx.dp_rank + 1) * rows)
        loss = tdp.step(x[mine], y[mine])
        step()
        # The replica's mean; the serial loss is the mean of the replicas' (equal rows).
        total = loss.detach().clone().reshape(1)
        pctx.comm.all_reduce(total, group=pctx.group("dp"), label="test loss")
        losses.append(total.item() / pctx.dp_size)
    ref_losses, ref_norms, ref_state = refs[tied]
    ref = reference_shards(pctx, ref_state, tied, sp)
    dparam = max((p.detach() - ref[n]).abs().max().item() for n, p in tdp.named_parameters())
    local = {id(p) for p in tdp.parameters()}
    # The meta-device build: no parameter outside this rank's stages was ever given storage here.
    outside = [n for n, p in tdp.pipe.model.named_parameters() if not p.is_meta and id(p) not in local]
    sharded = {n: (tuple(p.shape), tuple(ref[n].shape)) for n, p in tdp.named_parameters()}
    return {"dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "dparam": dparam, "outside": outside,
            "coords": pctx.coords._asdict(), "shapes": sharded,
            "dnorm": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "names": sorted(n for n, _ in tdp.named_parameters()), "losses": losses, "s": time.perf_counter() - t0}


def suite(cases: list[dict[str, Any]], **_: Any) -> dict[str, Any]:
    """Run every case on this rank (a world of any size; each case picks its grid); per-case results."""
    ctx = init_distributed()
    refs = {tied: serial(tied) for tied in sorted({c.get("tied", False) for c in cases})}
    out = [run_case(ctx, case, refs) for case in cases]
    return {"rank": ctx.rank, "cases": out}
