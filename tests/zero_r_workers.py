"""Workers for tests/test_zero_r.py: ZeRO-R partitioned activation checkpoints under tensor parallelism (gloo)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from lslm.metrics.activations import ActivationMemory
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads
from lslm.zero.activations import GATHER_LABEL, apply_partitioned_checkpoints

B, T = 2, 16
CONFIG = dict(vocab_size=64, block_size=T, n_layer=3, n_head=4, n_embd=32)


def _run(ctx: Any, dropout: float, mode: str, rng: tuple[Any, Any],
         dtype: torch.dtype | None = None) -> dict[str, Any]:
    torch.set_rng_state(rng[0])
    torch.manual_seed(0)
    model = apply_tensor_parallel(GPT(GPTConfig(**CONFIG, dropout=dropout)), ctx, rng_seed=1)
    if rng[1] is not None and ctx.rng is not None:
        ctx.rng.set_states(rng[1])
    if mode in ("partitioned", "partitioned-cpu"):
        apply_partitioned_checkpoints(model, ctx, offload=mode.endswith("cpu"))
    elif mode == "checkpoint":
        for block in model.blocks:
            inner = block.forward
            block.forward = lambda x, inner=inner: checkpoint(inner, x, use_reentrant=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, CONFIG["vocab_size"], (B, T + 1), generator=g)
    since = len(ctx.comm.ledger.records)
    with ActivationMemory(model) as act, torch.autocast("cpu", dtype=dtype or torch.bfloat16,
                                                        enabled=dtype is not None):
        logits, _ = model(x[:, :-1])
        loss = vocab_parallel_cross_entropy(logits.float(), x[:, 1:], ctx, vocab_size=CONFIG["vocab_size"])
    loss.backward()  # outside autocast: the recomputations run here
    sync_tensor_parallel_grads(model, ctx)
    gathers = [r for r in ctx.comm.ledger.records[since:] if r.label == GATHER_LABEL]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "saved": act.bytes, "gathers": len(gathers),
            "gather_bytes": sum(r.nbytes for r in gathers)}


def suite() -> dict[str, Any]:
    """Plain TP, reentrant-free checkpointing and partitioned checkpoints (in memory and on the host), with and
    without dropout: losses, gradients, saved bytes and the gathers."""
    ctx = init_distributed(tp=2)
    out: dict[str, Any] = {"tp": ctx.tp_size}
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        apply_tensor_parallel(GPT(GPTConfig(**CONFIG, dropout=dropout)), ctx, rng_seed=1)  # sets ctx.rng up
        rng = (torch.get_rng_state(), ctx.rng.get_states() if ctx.rng is not None else None)
        runs = {m: _run(ctx, dropout, m, rng) for m in ("plain", "checkpoint", "partitioned", "partitioned-cpu")}
        base = runs["plain"]
        for mode, r in runs.items():
            out[f"{mode}_d{dropout}"] = {
                "loss_equal": r["loss"] == base["loss"],
                "max_grad_diff": max((r["grads"][n] - base["grads"][n]).abs().max().item() for n in base["grads"]),
                "saved": r["saved"], "gathers": r["gathers"], "gather_bytes": r["gather_bytes"]}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):  # forward under autocast, dropout on
        torch.manual_seed(0)
        ctx.rng = None
        apply_tensor_parallel(GPT(GPTConfig(**CONFIG, dropout=0.1)), ctx, rng_seed=1)
        rng = (torch.get_rng_state(), ctx.rng.get_states())
        runs = {m: _run(ctx, 0.1, m, rng, dtype) for m in ("plain", "partitioned")}
        base, part = runs["plain"], runs["partitioned"]
        out[f"partitioned_{name}"] = {
            "loss_equal": part["loss"] == base["loss"],
            "identical": all(torch.equal(part["grads"][n], base["grads"][n]) for n in base["grads"]),
            "max_grad_diff": max((part["grads"][n] - base["grads"][n]).abs().max().item() for n in base["grads"])}
    return out
