"""Workers for tests/test_context_parallel.py: every multi-process check of one world size in one launch.

Each check returns plain numbers (max |Δ| against a single-process reference computed on the
same rank from the same seed, bytes from this rank's ledger records); the test asserts on them.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lslm.context_parallel import (
    CPGroup,
    CPPlan,
    apply_context_parallel,
    context_parallel_loss,
    cp_traffic,
    local_positions,
    reduce_context_parallel_grads,
    ring_attention,
    shard_batch,
    ulysses_attention,
)
from lslm.context_parallel.apply import ContextParallelAttention
from lslm.demos.cp_attention import (
    CORES,
    PLANS,
    activation_bytes,
    activation_malloc,
    attention_rows,
    token_batch,
    training_row,
)
from lslm.models.gpt import GPT, Block, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext

B, H, T, D = 2, 4, 16, 8
GQA_HEADS = 8  # query heads of the grouped-query rows; the ring's rows use 2 key/value heads, Ulysses' cp
HALF = (torch.bfloat16, torch.float16)
PEAK_LOGIT = 50.0  # where a bf16 log-sum-exp moves in steps of 0.25


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


def _ledger_bytes(records: list[Any], op: str) -> int:
    return sum(r.nbytes for r in records if r.op == op)


def gqa_rows(ctx: ParallelContext) -> list[dict[str, Any]]:
    """Grouped-query attention (8 query heads; the ring with 2 key/value heads, Ulysses with cp) against full
    attention on ``repeat_interleave``'d keys/values, fp32: output, dq, dk, dv and the ledger's bytes."""
    g, dev = CPGroup.of(ctx), ctx.device
    gen = torch.Generator().manual_seed(4)
    rows = []
    for method, layout, kv_heads in (("ring", "contiguous", 2), ("ring", "zigzag", 2), ("ring", "zigzag", 1),
                                     ("ulysses", "contiguous", g.size), ("ulysses", "zigzag", g.size)):
        q, dout = (torch.randn(B, GQA_HEADS, T, D, generator=gen).to(dev) for _ in range(2))
        k, v = (torch.randn(B, kv_heads, T, D, generator=gen).to(dev) for _ in range(2))
        for causal in (True, False):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            group = GQA_HEADS // kv_heads
            ref = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(group, 1),
                                                 full[2].repeat_interleave(group, 1), is_causal=causal)
            ref.backward(dout)
            pos = local_positions(T, g.size, g.index, layout, device=dev)
            mine = [t.index_select(2, pos).requires_grad_() for t in (q, k, v)]
            records = ctx.comm.ledger.records
            start = len(records)
            out = (ring_attention if method == "ring" else ulysses_attention)(*mine, g, causal=causal, layout=layout)
            mid = len(records)
            out.backward(dout.index_select(2, pos))
            op = "send" if method == "ring" else "all_to_all"
            grads = {f"d{n}": _maxdiff(m.grad, f.grad.index_select(2, pos)) for n, m, f in zip("qkv", mine, full)}
            rows.append({"method": method, "layout": layout, "causal": causal, "kv_heads": kv_heads, "cp": g.size,
                         "out": _maxdiff(out, ref.index_select(2, pos)), **grads,
                         "forward_bytes": _ledger_bytes(records[start:mid], op),
                         "backward_bytes": _ledger_bytes(records[mid:], op),
                         "other_ops": sorted({r.op for r in records[start:]} - {op, "recv"})})
    return rows


def large_logit_inputs(batch: int = 1, n_head: int = 4, seq_len: int = 48, head_dim: int = 16,
                       peak: float = PEAK_LOGIT) -> tuple[torch.Tensor, ...]:
    """fp32 ``q, k, v, dout`` whose causal attention logits ``q·k/sqrt(D)`` reach ``±peak`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(batch, n_head, seq_len, head_dim, generator=gen) for _ in range(4))
    logits = (q @ k.transpose(-2, -1)) * head_dim ** -0.5
    return q * (peak / logits.abs().max()), k, v, dout


def _relative(a: torch.Tensor, want: torch.Tensor, whole: torch.Tensor) -> float:
    # max |a - want| over max |whole| (the whole sequence's reference tensor, of which want may be a rank's rows):
    # every rank's error in one unit, the tensor's scale (a rank's own rows can hold much smaller gradients)
    return ((a.double() - want.double()).abs().max() / whole.double().abs().max()).item()


def precision_rows(g: CPGroup, dev: torch.device, core: Callable[..., torch.Tensor] = ring_attention,
                   dtypes: tuple[torch.dtype, ...] = HALF) -> list[dict[str, Any]]:
    """Ring attention in bf16 and fp16 on large logits (:func:`large_logit_inputs`) against fp32 full attention on
    the same (half-rounded) inputs, next to what one-process ``F.scaled_dot_product_attention`` in the same dtype
    achieves against that reference on this rank's rows (``torch_*``) and on the whole tensor (``torch_all_*``):
    errors of out, dq, dk, dv relative to the whole reference tensor's largest value (:func:`_relative`), and the
    bytes ``g``'s ledger recorded. ``core``: the implementation measured (the one before the fix, to
    report the change)."""
    base = [t.to(dev) for t in large_logit_inputs()]
    seq_len = base[0].shape[2]
    rows = []
    for dtype in dtypes:
        q, k, v, dout = (t.to(dtype) for t in base)
        ref_in = [t.float().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
        ref.backward(dout.float())
        same = [t.clone().requires_grad_() for t in (q, k, v)]
        torch_out = F.scaled_dot_product_attention(*same, is_causal=True)
        torch_out.backward(dout)
        for layout in ("contiguous", "zigzag"):
            pos = local_positions(seq_len, g.size, g.index, layout, device=dev)
            mine = [t.index_select(2, pos).requires_grad_() for t in (q, k, v)]
            records = g.comm.ledger.records
            start = len(records)
            out = core(*mine, g, causal=True, layout=layout)
            mid = len(records)
            out.backward(dout.index_select(2, pos))
            row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "layout": layout, "cp": g.size,
                                   "out_dtype": str(out.dtype).removeprefix("torch."),
                                   "forward_bytes": _ledger_bytes(records[start:mid], "send"),
                                   "backward_bytes": _ledger_bytes(records[mid:], "send")}
            for name, got, torch_same, want in (("out", out, torch_out, ref),
                                                *((f"d{n}", m.grad, s.grad, r.grad)
                                                  for n, m, s, r in zip("qkv", mine, same, ref_in))):
                row[name] = _relative(got, want.index_select(2, pos), want)
                row[f"torch_{name}"] = _relative(torch_same.index_select(2, pos), want.index_select(2, pos), want)
                row[f"torch_all_{name}"] = _relative(torch_same, want, want)
            rows.append(row)
    return rows


def precision_suite() -> dict[str, Any]:
    """Only :func:`precision_rows`, at cp = world size (the cp = 3 launch: the full suite needs 4 | n_head)."""
    with init_distributed(cp=_world()) as ctx:
        return {"rank": ctx.rank, "precision": precision_rows(CPGroup.of(ctx), ctx.device),
                "traffic_half": half_traffic(ctx.cp_size)}


def half_traffic(cp: int) -> dict[str, int]:
    """The formula for :func:`large_logit_inputs`' shapes with 2-byte elements (bf16, fp16)."""
    return cp_traffic(1, 4, 48, 16, cp, element_size=2)


def traffic(cp: int) -> dict[str, int]:
    """The formula for the shapes the attention rows use (``B, H, T, D``)."""
    return cp_traffic(B, H, T, D, cp)


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by the launcher before init_distributed reads it


def suite() -> dict[str, Any]:
    """Every check at cp = world size; at 4 processes also dp = 2 × cp = 2 training; cp = 1 for the memory ratio."""
    with init_distributed(cp=_world()) as ctx:
        out: dict[str, Any] = {"rank": ctx.rank, "attention": attention_rows(ctx, B, H, T, D),
                               "block": block_cases(ctx), "traffic": traffic(ctx.cp_size),
                               "gqa": gqa_rows(ctx), "precision": precision_rows(CPGroup.of(ctx), ctx.device),
                               "traffic_half": half_traffic(ctx.cp_size)}
        out["training"] = [training_row(ctx, CPPlan(m, lay)) for m, lay in (("ring", "zigzag"), ("ring", "contiguous"),
                                                                            ("ulysses", "zigzag"))]
        out["activations"] = {m: activation_bytes(ctx, CPPlan(m, "zigzag"), seq_len=32) for m in CORES}
        out["gpt_step_bytes"] = {m: gpt_step_bytes(ctx, m) for m in CORES}
        one = ctx.with_grid(cp=1)
        out["activations_cp1"] = {m: activation_bytes(one, CPPlan(m, "zigzag"), seq_len=32) for m in CORES}
        out["malloc"] = {str(c): {m: activation_malloc(g, CPPlan(m, "zigzag")) for m in CORES}
                         for c, g in ((1, one), (ctx.cp_size, ctx))}
        # grouped-query attention in the GPT: 8 query heads over 2 key/value heads (ring), over cp (Ulysses)
        out["gqa_training"] = [training_row(ctx, CPPlan(m, "zigzag"), steps=2, n_head=8, n_kv_head=kv)
                               for m, kv in (("ring", 2), ("ulysses", ctx.cp_size))]
        if ctx.world_size == 4:
            two = ctx.with_grid(dp=2, cp=2)
            out["training"] += [training_row(two, CPPlan(m, lay)) for m, lay in (("ring", "zigzag"),
                                                                                 ("ulysses", "contiguous"))]
        return out

