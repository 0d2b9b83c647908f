"""Workers for tests/test_cp_compose.py: context parallelism composed with tensor parallelism and gradient buffers,
and the expert-parallel MoE on gradient buffers, in one 4-process launch.

Every case trains a few SGD steps against a single-process reference built on the same rank from the
same seed and data, and returns plain numbers (max |Δ| of losses and parameters, ledger bytes and
counts of one step); the test asserts on them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from lslm.context_parallel import (
    CPPlan,
    apply_context_parallel,
    context_parallel_loss,
    reduce_context_parallel_grads,
    shard_batch,
)
from lslm.context_parallel.apply import GRAD_LABEL as CP_GRAD_LABEL
from lslm.data_parallel.grad_buffer import GradBuffer, main_grad_or_grad
from lslm.data_parallel.grad_sync import attach_grad_buffers, zero_grad_buffers
from lslm.demos.moe_training import phrase_batch
from lslm.expert_parallel import (
    EPGroup,
    ExpertParallelMoE,
    MoE,
    apply_expert_parallel,
    apply_moe,
    expert_parameters,
    moe_aux_loss,
    reduce_expert_parallel_grads,
)
from lslm.expert_parallel.parallel import GRAD_LABEL as EP_GRAD_LABEL
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.checkpoint import gather_full_state_dict
from lslm.tensor_parallel.grads import SP_GRAD_LABEL

VOCAB, SEQ, STEPS, LR = 251, 32, 3, 0.5  # 251: padded to 252 over tp = 2
CAP_MB = 0.05  # ~13k fp32 elements per bucket: several buckets per buffer


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    targets[targets % 7 == 0] = -100  # uneven token counts per rank: the loss must count the whole batch
    return idx, targets


def _sgd(params: list[torch.nn.Parameter], lr: float) -> None:
    with torch.no_grad():
        for p in params:
            g = main_grad_or_grad(p)
            if g is not None:
                p.sub_(g, alpha=lr)


def _zero(params: list[torch.nn.Parameter]) -> None:
    zero_grad_buffers(params)  # the buffers (if any) in one fill each, and every .grad dropped


def _buffer_ledger(records: list[Any], label: str, buffers: list[GradBuffer]) -> dict[str, Any]:
    mine = [r for r in records if r.label == label and r.op == "all_reduce"]
    return {"count": len(mine), "bytes": sum(r.nbytes for r in mine), "group_sizes": sorted({r.group_size
                                                                                             for r in mine}),
            "want_count": sum(len(b.buckets) for b in buffers), "want_bytes": sum(b.nbytes for b in buffers)}


def cp_training(ctx: ParallelContext, method: str, layout: str, *, sp: bool = False,
                buffers: bool = False) -> dict[str, Any]:
    """The GPT trained under (dp ×) cp (× tp, ± sequence parallelism), ± gradient buffers, vs serially."""
    cfg = GPTConfig.tiny(vocab_size=VOCAB, block_size=SEQ)
    idx, targets = (t.to(ctx.device) for t in _data(2 * ctx.dp_size))
    torch.manual_seed(0)
    serial = GPT(cfg).to(ctx.device)
    model = copy.deepcopy(serial)
    if ctx.tp_size > 1:
        apply_tensor_parallel(model, ctx, sequence_parallel=sp)
    apply_context_parallel(model, ctx, CPPlan(method, layout))
    bufs = attach_grad_buffers(model, ctx, bucket_cap_mb=CAP_MB) if buffers else []
    params = list(model.parameters())
    rows = slice(2 * ctx.dp_rank, 2 * ctx.dp_rank + 2)
    idx_l, tgt_l = shard_batch(ctx, layout, idx[rows], targets[rows])
    vocab = VOCAB if ctx.tp_size > 1 else None
    losses_s, losses, ledger = [], [], {}
    for step in range(STEPS):
        serial.zero_grad()
        _, loss = serial(idx, targets)
        loss.backward()
        _sgd(list(serial.parameters()), LR)
        losses_s.append(loss.item())
        _zero(params)
        records = ctx.comm.ledger.records
        start = len(records)
        logits, _ = model(idx_l)
        loss, reported = context_parallel_loss(logits, tgt_l, ctx, vocab_size=vocab)
        loss.backward()
        reduced = ctx.comm.ledger.records[start:]  # the forward's and backward's traffic
        mid = len(records)
        elements = reduce_context_parallel_grads(model, ctx)
        if step == 0:
            grads = records[mid:]
            ledger = {"cp": _buffer_ledger(grads, CP_GRAD_LABEL, bufs),
                      "sp": _buffer_ledger(grads, SP_GRAD_LABEL, [b for b in bufs if b.kind == "sp"]),
                      "elements": elements, "local_numel": sum(p.numel() for p in params),
                      "grad_axes": sorted({r.axis for r in grads if r.label == CP_GRAD_LABEL}),
                      "forward_ops": sorted({r.op for r in reduced})}
        _sgd(params, LR)
        losses.append(reported.item())
    full = gather_full_state_dict(model, ctx) if ctx.tp_size > 1 else model.state_dict()
    ps = serial.state_dict()
    return {"config": f"{'dp2 x ' if ctx.dp_size > 1 else ''}cp{ctx.cp_size}"
                      f"{f' x tp{ctx.tp_size}' if ctx.tp_size > 1 else ''}{' +sp' if sp else ''} {method}/{layout}"
                      f"{' buffers' if buffers else ''}",
            "dp": ctx.dp_size, "cp": ctx.cp_size, "tp": ctx.tp_size, "sp": sp, "buffers": buffers,
            "kinds": sorted(b.kind for b in bufs), "same_keys": sorted(full) == sorted(ps),
            "losses": losses, "serial_losses": losses_s,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, losses_s)),
            "param_diff": max(_maxdiff(full[k], ps[k]) for k in ps), "ledger": ledger}


def moe_layer(ctx: ParallelContext) -> dict[str, Any]:
    """One MoE layer expert-parallel on gradient buffers vs the serial MoE on every shard: the gradient rule."""
    g, dev, ep = EPGroup.of(ctx), ctx.device, ctx.dp_size
    C, hidden, E, B, T = 16, 32, 8, 2, 8
    torch.manual_seed(0)
    serial = MoE(C, hidden, E, 2, 1.25, True).to(dev)
    layer = ExpertParallelMoE(copy.deepcopy(serial), g)
    bufs = attach_grad_buffers(layer, bucket_cap_mb=0.002)  # ~500 elements a bucket: several for the experts
    gen = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(ep * B, T, C, generator=gen).to(dev) for _ in range(2))
    shards = [slice(s * B, (s + 1) * B) for s in range(ep)]

    def loss_of(m: torch.nn.Module, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return (y * d).sum() + 0.1 * m.aux["load_balancing"] + 0.01 * m.aux["z"]

    total = sum(loss_of(serial, serial(x[sl]), dy[sl]) / ep for sl in shards)
    total.backward()
    mine = shards[g.index]
    loss_of(layer, layer(x[mine]), dy[mine]).backward()
    first = g.index * (E // ep)
    want = [p.grad for e in serial.experts[first:first + E // ep] for p in e.parameters()]
    experts = expert_parameters(layer)
    ep_buf = [b for b in bufs if b.kind == "ep"]
    unreduced = max(_maxdiff(p.main_grad, w) for p, w in zip(experts, want))
    # the rule a dense parameter gets (average over dp), applied to the experts' buffer: a different expert's
    # gradient is added in, so it is wrong
    as_dense = ep_buf[0].data.clone()
    ctx.comm.all_reduce(as_dense, group=g.group, label="test")
    as_dense /= ep
    want_of = {id(p): w for p, w in zip(experts, want)}
    buf = ep_buf[0]
    wrong = max(_maxdiff(as_dense[buf.offsets[i]:buf.offsets[i] + p.numel()].view_as(p), want_of[id(p)])
                for i, p in enumerate(buf.params))
    records = ctx.comm.ledger.records
    start = len(records)
    reduce_expert_parallel_grads(layer, g)
    dense = [b for b in bufs if b.kind != "ep"]
    return {"ep": ep, "kinds": sorted(b.kind for b in bufs), "ep_buckets": len(ep_buf[0].buckets),
            "grad_experts": max(_maxdiff(p.main_grad, w) for p, w in zip(experts, want)),
            "grad_router": _maxdiff(layer.router.gate.weight.main_grad, serial.router.gate.weight.grad),
            "grad_experts_unreduced": unreduced, "grad_experts_averaged_as_dense": wrong,
            "ledger": _buffer_ledger(records[start:], EP_GRAD_LABEL, dense),
            "other_ops": sorted({(r.op, r.label) for r in records[start:]} - {("all_reduce", EP_GRAD_LABEL)})}


def moe_training(ctx: ParallelContext) -> dict[str, Any]:
    """The MoE GPT trained expert-parallel on gradient buffers vs serially on every shard (losses averaged)."""
    g, dev, ep = EPGroup.of(ctx), ctx.device, ctx.dp_size
    cfg = GPTConfig.tiny(n_layer=2, block_size=16)
    torch.manual_seed(0)
    serial = apply_moe(GPT(cfg).to(dev), num_experts=4, top_k=2, capacity_factor=1.0)
    model = apply_expert_parallel(copy.deepcopy(serial), ctx)
    bufs = attach_grad_buffers(model, bucket_cap_mb=CAP_MB)
    params = list(model.parameters())
    loss_diff = 0.0
    for step in range(STEPS):
        shards = [phrase_batch(cfg.vocab_size, 2, 17, step, s, dev) for s in range(ep)]
        serial.zero_grad()
        total, per_shard = 0.0, []
        for idx in shards:
            _, loss = serial(idx[:, :-1], idx[:, 1:])
            aux = moe_aux_loss(serial, 0.1, 0.01)  # per shard: the routing groups are the shards
            total = total + (loss + aux) / ep
            per_shard.append(loss.item())
        total.backward()
        _sgd(list(serial.parameters()), LR)
        _zero(params)
        idx = shards[g.index]
        _, loss = model(idx[:, :-1], idx[:, 1:])
        (loss + moe_aux_loss(model, 0.1, 0.01)).backward()
        reduce_expert_parallel_grads(model, g)
        _sgd(params, LR)
        loss_diff = max(loss_diff, abs(loss.item() - per_shard[g.index]))
    n_loc = 4 // ep
    diffs = []
    for b_s, b in zip(serial.blocks, model.blocks):
        for mine, ref in zip(b.mlp.experts, b_s.mlp.experts[g.index * n_loc:(g.index + 1) * n_loc]):
            diffs += [_maxdiff(p, q) for p, q in zip(mine.parameters(), ref.parameters())]
    ref_shared = {n: p for n, p in serial.named_parameters() if ".experts." not in n}
    diffs += [_maxdiff(p, ref_shared[n]) for n, p in model.named_parameters() if ".experts." not in n]
    return {"config": f"ep{ep} (dp{ep}) MoE buffers", "ep": ep, "kinds": sorted(b.kind for b in bufs),
            "loss_diff": loss_diff, "param_diff": max(diffs)}


def suite() -> dict[str, Any]:
    """4 processes: tp2 x cp2 (ring, Ulysses; ± SP), dp2 x cp2 on buffers, ep2 (= dp2, tp2 idle) MoE on buffers."""
    with init_distributed(tp=2, cp=2) as ctx:
        runs = [cp_training(ctx, "ring", "zigzag"), cp_training(ctx, "ulysses", "contiguous"),
                cp_training(ctx, "ring", "zigzag", sp=True, buffers=True),
                cp_training(ctx, "ulysses", "zigzag", sp=True, buffers=True)]
        runs.append(cp_training(ctx.with_grid(dp=2, cp=2), "ring", "zigzag", buffers=True))
        ep_ctx = ctx.with_grid(dp=2, tp=2)  # ep = dp = 2; the tp pairs repeat the same work (the MoE is not TP)
        return {"rank": ctx.rank, "cp": runs, "moe_layer": moe_layer(ep_ctx), "moe": moe_training(ep_ctx)}
