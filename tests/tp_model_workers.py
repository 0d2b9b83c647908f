"""Workers for tests/test_tp_model.py: the lslm GPT trained tensor-parallel (and DP x TP, and with SP) vs serial."""

from __future__ import annotations

import os
from typing import Any

import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import gather_logits, vocab_parallel_cross_entropy
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

SEED, STEPS, ROWS, T = 1234, 3, 4, 16


def _config(**kw: Any) -> GPTConfig:
    return GPTConfig.tiny(vocab_size=250, **kw)  # 250: padded at tp=4 (252)


def _batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tok = torch.randint(0, vocab, (ROWS, T + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _serial(cfg: GPTConfig) -> tuple[list[float], GPT]:
    torch.manual_seed(SEED)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, cfg.vocab_size)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def train(tp: int, sp: bool = False, async_ar: bool = False, sync: bool = True, **_: Any) -> dict[str, Any]:
    """Train serially and tensor-parallel from the same seed; return losses, logits diff and replica drift."""
    world = int(os.environ["WORLD_SIZE"])
    ctx = init_distributed(tp=tp)
    cfg = _config()
    with ctx:
        ref_losses, ref = _serial(cfg)
        torch.manual_seed(SEED)
        model = apply_tensor_parallel(GPT(cfg), ctx, sequence_parallel=sp, async_grad_allreduce=async_ar)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(STEPS):
            x, y = _batch(step, cfg.vocab_size)
            rows = x.shape[0] // ctx.dp_size
            x, y = (t[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows] for t in (x, y))
            logits, _ = model(x)
            loss = vocab_parallel_cross_entropy(logits, y, ctx, vocab_size=cfg.vocab_size)
            opt.zero_grad()
            loss.backward()
            if sync:
                sync_tensor_parallel_grads(model, ctx)
            for p in model.parameters():  # data parallel: average over dp
                if ctx.dp_size > 1:
                    ctx.comm.all_reduce(p.grad, group=ctx.dp_group, label="dp")
                    p.grad /= ctx.dp_size
            opt.step()
            gl = torch.tensor([loss.item()])
            ctx.comm.all_reduce(gl, group=ctx.dp_group, label="report")
            losses.append(gl.item() / ctx.dp_size)
        x, _ = _batch(99, cfg.vocab_size)
        with torch.no_grad():
            full = gather_logits(model(x)[0], ctx, cfg.vocab_size)
            want = ref(x)[0]
        # replicated parameters: identical on every TP rank?
        drift = 0.0
        for _name, p in model.named_parameters():
            if not getattr(p, "tensor_model_parallel", False):
                other = p.detach().clone()
                ctx.comm.broadcast(other, src=ctx.group_ranks("tp")[0], group=ctx.tp_group, label="test")
                drift = max(drift, (other - p.detach()).abs().max().item())
    return {"world": world, "losses": losses, "ref_losses": ref_losses,
            "logits_diff": (full - want).abs().max().item(), "replica_drift": drift}
