"""Workers for tests/test_recompute.py: activation recomputation under tensor parallelism, dropout on (gloo)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from lslm.data_parallel.grad_sync import attach_grad_buffers
from lslm.demos.recompute_check import tp_rows
from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.apply import PipelinePlan
from lslm.runtime import init_distributed
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads
from lslm.tensor_parallel.recompute import RECOMPUTE_MODES, apply_recompute
from lslm.three_d import ThreeDPlan, apply_3d

__all__ = ["autocast_suite", "pipeline_suite", "suite"]

B, T = 2, 16
CONFIG = dict(vocab_size=64, block_size=T, n_layer=2, n_head=4, n_embd=32, dropout=0.1)


def _grads(ctx: Any, mode: str, sp: bool, rng: tuple[Any, Any],
           dtype: torch.dtype | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = apply_tensor_parallel(GPT(GPTConfig(**CONFIG)), ctx, sequence_parallel=sp, rng_seed=1)
    torch.set_rng_state(rng[0])  # every mode draws from the same default and tensor-parallel streams
    ctx.rng.set_states(rng[1])
    if mode == "torch-checkpoint":  # the negative control: replays the default generator only
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    else:
        apply_recompute(model, mode, ctx)
    x = torch.randint(0, CONFIG["vocab_size"], (B, T + 1), generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits, _ = model(x[:, :-1])
        loss = vocab_parallel_cross_entropy(logits.float(), x[:, 1:], ctx, vocab_size=CONFIG["vocab_size"])
    loss.backward()  # outside autocast (torch's AMP recipe): the recomputations run here
    sync_tensor_parallel_grads(model, ctx)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def suite() -> dict[str, Any]:
    """Losses and gradients of each recompute mode against none, with and without sequence parallelism, and the
    per-block bytes and flops rows of :func:`lslm.demos.recompute_check.tp_rows`."""
    ctx = init_distributed(tp=2)
    out: dict[str, Any] = {"tp": ctx.tp_size}
    for sp in (False, True):
        torch.manual_seed(0)
        apply_tensor_parallel(GPT(GPTConfig(**CONFIG)), ctx, sequence_parallel=sp, rng_seed=1)  # sets ctx.rng up
        rng = (torch.get_rng_state(), ctx.rng.get_states())
        runs = {m: _grads(ctx, m, sp, rng) for m in (*RECOMPUTE_MODES, "torch-checkpoint")}
        base_loss, base = runs["none"]
        for mode, (loss, grads) in runs.items():
            out[f"{mode}_sp{sp}"] = {"loss_diff": abs(loss - base_loss),
                                     "max_grad_diff": max((grads[n] - base[n]).abs().max().item() for n in base),
                                     "max_grad": max(g.abs().max().item() for g in base.values())}
        ctx.rng = None
    out["rows"] = tp_rows(ctx)
    return out


def autocast_suite(sps: tuple[bool, ...] = (False, True)) -> dict[str, Any]:
    """Under CPU bf16 and fp16 autocast (forward inside, backward outside), tp = 2, dropout on, with and without
    sequence parallelism: each recompute mode's loss and gradients against none."""
    ctx = init_distributed(tp=2)
    out: dict[str, Any] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for sp in sps:
            torch.manual_seed(0)
            ctx.rng = None
            apply_tensor_parallel(GPT(GPTConfig(**CONFIG)), ctx, sequence_parallel=sp, rng_seed=1)
            rng = (torch.get_rng_state(), ctx.rng.get_states())
            runs = {m: _grads(ctx, m, sp, rng, dtype) for m in RECOMPUTE_MODES}
            base_loss, base = runs["none"]
            for mode, (loss, grads) in runs.items():
                out[f"{name}_{mode}_sp{sp}"] = {
                    "loss_equal": loss == base_loss,
                    "identical": all(torch.equal(grads[n], base[n]) for n in base),
                    "max_grad_diff": max((grads[n] - base[n]).abs().max().item() for n in base)}
        ctx.rng = None
    return out


PIPE_CONFIG = dict(vocab_size=64, block_size=T, n_layer=4, n_head=2, n_embd=32, dropout=0.1)


def _pipeline_grads(ctx: Any, variant: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    ctx.rng = None  # apply_tensor_parallel seeds the tracker afresh: every variant draws the same masks
    with torch.device("meta"):
        model = GPT(GPTConfig(**PIPE_CONFIG))
    plan = ThreeDPlan(PipelinePlan("1f1b", microbatches=2, remat=variant == "remat"))
    tdp = apply_3d(model, ctx, plan, init_seed=3)
    if variant in RECOMPUTE_MODES:
        for stage in tdp.local:
            apply_recompute(stage, variant, ctx)
    for stage in tdp.local:
        attach_grad_buffers(stage, ctx)
    tdp.local.train()
    x = torch.randint(0, PIPE_CONFIG["vocab_size"], (4, T + 1), generator=torch.Generator().manual_seed(5))
    tdp.step(x[:, :-1], x[:, 1:])
    return {n: p.main_grad.clone() for n, p in tdp.named_parameters()}


def pipeline_suite() -> dict[str, Any]:
    """TP inside pipeline stages (tp = pp = 2), dropout on: the gradients of the pipeline's own stage
    rematerialisation and of apply_recompute on the stages, against neither."""
    ctx = init_distributed(tp=2, pp=2)
    runs = {v: _pipeline_grads(ctx, v) for v in ("none", "remat", "selective", "full")}
    base = runs["none"]
    return {v: max((g[n] - base[n]).abs().max().item() for n in base) for v, g in runs.items()}
