"""Workers for tests/test_context_parallel.py: every multi-process check of one world size in one launch.

Each check returns plain numbers (max |Δ| against a single-process reference computed on the
same rank from the same seed, bytes from this rank's ledger records); the test asserts on them.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from lslm.context_parallel import (
    CPGroup,
    CPPlan,
    apply_context_parallel,
    context_parallel_loss,
    cp_traffic,
    local_positions,
    reduce_context_parallel_grads,
    shard_batch,
)
from lslm.context_parallel.apply import ContextParallelAttention
from lslm.demos.cp_attention import CORES, PLANS, activation_bytes, attention_rows, token_batch, training_row
from lslm.models.gpt import GPT, Block, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext

B, H, T, D = 2, 4, 16, 8


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def block_cases(ctx: ParallelContext) -> list[dict[str, Any]]:
    """One GPT block with the attention core swapped vs the serial block: output, input and parameter gradients."""
    g, dev = CPGroup.of(ctx), ctx.device
    cfg = GPTConfig.tiny(n_embd=32, n_head=4, block_size=T)
    torch.manual_seed(0)
    serial = Block(cfg).to(dev)
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, T, 32, generator=gen).to(dev), torch.randn(2, T, 32, generator=gen).to(dev)
    xs = x.clone().requires_grad_()
    y = serial(xs)
    y.backward(dy)
    rows = []
    for method, layout in PLANS:
        block = copy.deepcopy(serial)
        block.zero_grad()
        block.attn = ContextParallelAttention(block.attn, g, CPPlan(method, layout))
        pos = local_positions(T, g.size, g.index, layout, device=dev)
        xl = x.index_select(1, pos).requires_grad_()
        yl = block(xl)
        yl.backward(dy.index_select(1, pos))
        flat = torch.cat([p.grad.flatten() for p in block.parameters()])
        ctx.comm.all_reduce(flat, group=ctx.cp_group)  # every rank saw only its tokens: the sum is the gradient
        want = torch.cat([p.grad.flatten() for p in serial.parameters()])
        rows.append({"method": method, "layout": layout, "cp": g.size, "out": _maxdiff(yl, y.index_select(1, pos)),
                     "grad_x": _maxdiff(xl.grad, xs.grad.index_select(1, pos)), "grad_params": _maxdiff(flat, want)})
    return rows


def gpt_step_bytes(ctx: ParallelContext, method: str) -> dict[str, int]:
    """Bytes this rank's ledger records, by label, for one training step of the context-parallel GPT (the shapes
    of :func:`activation_bytes`): the calculator's cp and dp x cp axes are checked against them."""
    cfg = GPTConfig.tiny(block_size=32)
    idx, targets = token_batch(cfg, 2, 32, ctx.device)
    torch.manual_seed(0)
    model = apply_context_parallel(GPT(cfg).to(ctx.device), ctx, CPPlan(method, "zigzag"))
    idx_l, tgt_l = shard_batch(ctx, "zigzag", idx, targets)
    start = len(ctx.comm.ledger.records)
    logits, _ = model(idx_l)
    loss, _ = context_parallel_loss(logits, tgt_l, ctx)
    loss.backward()
    reduce_context_parallel_grads(model, ctx)
    out: dict[str, int] = {}
    for r in ctx.comm.ledger.records[start:]:
        if r.op != "recv":  # a p2p pair is recorded on both ends; what a rank sends is its send
            out[r.label] = out.get(r.label, 0) + r.nbytes
    return out


def traffic(cp: int) -> dict[str, int]:
    """The formula for the shapes the attention rows use (``B, H, T, D``)."""
    return cp_traffic(B, H, T, D, cp)


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by the launcher before init_distributed reads it


def suite() -> dict[str, Any]:
    """Every check at cp = world size; at 4 processes also dp = 2 × cp = 2 training; cp = 1 for the memory ratio."""
    with init_distributed(cp=_world()) as ctx:
        out: dict[str, Any] = {"rank": ctx.rank, "attention": attention_rows(ctx, B, H, T, D),
                               "block": block_cases(ctx), "traffic": traffic(ctx.cp_size)}
        out["training"] = [training_row(ctx, CPPlan(m, lay)) for m, lay in (("ring", "zigzag"), ("ring", "contiguous"),
                                                                            ("ulysses", "zigzag"))]
        out["activations"] = {m: activation_bytes(ctx, CPPlan(m, "zigzag"), seq_len=32) for m in CORES}
        out["gpt_step_bytes"] = {m: gpt_step_bytes(ctx, m) for m in CORES}
        one = ctx.with_grid(cp=1)
        out["activations_cp1"] = {m: activation_bytes(one, CPPlan(m, "zigzag"), seq_len=32) for m in CORES}
        if ctx.world_size == 4:
            two = ctx.with_grid(dp=2, cp=2)
            out["training"] += [training_row(two, CPPlan(m, lay)) for m, lay in (("ring", "zigzag"),
                                                                                 ("ulysses", "contiguous"))]
        return out

