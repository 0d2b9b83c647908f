"""Workers for tests/test_tp_model.py: the lslm GPT trained tensor-parallel (TP, SP, DP x TP) against one process.

One launch per grid runs several cases; each rank returns its losses, the serial
losses it computed itself from the same seed and data, the gathered logits' difference,
the largest difference of each replicated parameter from TP rank 0's copy, and the
ledger of one training step (op, label, bytes) for the exact communication counts.
"""

from __future__ import annotations

from typing import Any

import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import gather_logits, vocab_parallel_cross_entropy
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads
from lslm.tensor_parallel.overlap import overlap_log, overlap_summary

SEED, STEPS, ROWS, T = 1234, 3, 4, 16
VOCAB = 250  # not divisible by 4: padded to 252 at tp=4


def _config(dropout: float = 0.0) -> GPTConfig:
    return GPTConfig.tiny(vocab_size=VOCAB, dropout=dropout)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tok = torch.randint(0, VOCAB, (ROWS, T + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _serial() -> tuple[list[float], GPT]:
    torch.manual_seed(SEED)
    model = GPT(_config())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def _drift(model: torch.nn.Module, ctx: ParallelContext) -> float:
    """Largest difference of any replicated parameter from TP rank 0's copy."""
    worst = 0.0
    for p in model.parameters():
        if not getattr(p, "tensor_model_parallel", False):
            first = p.detach().clone()
            ctx.comm.broadcast(first, src=ctx.group_ranks("tp")[0], group=ctx.tp_group, label="test")
            worst = max(worst, (first - p.detach()).abs().max().item())
    return worst


def _case(ctx: ParallelContext, ref: GPT, *, sp: bool = False, async_ar: bool = False, sync: bool = True,
          dropout: float = 0.0) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = apply_tensor_parallel(GPT(_config(dropout)), ctx, sequence_parallel=sp, async_grad_allreduce=async_ar)
    log = overlap_log(model) if async_ar else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, step_ledger = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        rows = x.shape[0] // ctx.dp_size  # data parallel: this dp rank's rows; TP ranks share them
        x, y = (t[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows] for t in (x, y))
        ctx.comm.ledger.reset()
        logits, _ = model(x)
        loss = vocab_parallel_cross_entropy(logits, y, ctx, vocab_size=VOCAB)
        opt.zero_grad()
        loss.backward()
        if sync:
            sync_tensor_parallel_grads(model, ctx)
        if step == 0:
            step_ledger = [[r.op, r.label, r.nbytes, r.bus_bytes] for r in ctx.comm.ledger.records]
        if ctx.dp_size > 1:  # average over data-parallel replicas only: TP ranks hold one loss
            for p in model.parameters():
                ctx.comm.all_reduce(p.grad, group=ctx.dp_group, label="dp")
                p.grad /= ctx.dp_size
        opt.step()
        total = torch.tensor([loss.item()])
        ctx.comm.all_reduce(total, group=ctx.dp_group, label="report")
        losses.append(total.item() / ctx.dp_size)
    out: dict[str, Any] = {"losses": losses, "drift": _drift(model, ctx), "ledger": step_ledger,
                           "padded_vocab": model.tensor_parallel.padded_vocab_size}
    if dropout == 0.0:
        x, _ = _batch(99)
        model.eval()
        with torch.no_grad():
            out["logits_diff"] = (gather_logits(model(x)[0], ctx, VOCAB) - ref(x)[0]).abs().max().item()
    if log is not None:
        out["overlap"] = overlap_summary(log)
    return out


CASES = {
    "tp": {}, "sp": {"sp": True}, "async": {"async_ar": True},
    "sp_without_grad_sync": {"sp": True, "sync": False}, "dropout": {"dropout": 0.1}, "sp_dropout": {"sp": True,
                                                                                                     "dropout": 0.1},
}


def suite(tp: int, cases: list[str], **_: Any) -> dict[str, Any]:
    """Run ``cases`` (names of :data:`CASES`) on a grid with tensor-parallel size ``tp`` (dp = the rest)."""
    ctx = init_distributed(tp=tp)
    with ctx:
        ref_losses, ref = _serial()
        ref.eval()
        results = {name: _case(ctx, ref, **CASES[name]) for name in cases}
        desc = ctx.describe()
    return {"ref_losses": ref_losses, "cases": results, "rank": desc["rank"], "tp_rank": desc["tp"],
            "dp_rank": desc["dp"]}
