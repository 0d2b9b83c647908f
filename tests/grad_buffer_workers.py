"""Workers for tests/test_grad_buffer.py: gradient buffers across ranks (gloo, 2 or 4 processes, dp = world)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lslm.data_parallel.ddp import make_ddp
from lslm.data_parallel.grad_sync import attach_grad_buffers
from lslm.precision import prepare_precision
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.clip import average_data_parallel_grads

#: finite in fp16 (its largest is 65,504); the sum over 2 or 4 ranks is not
BIG = 60000.0


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(ctx: ParallelContext) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + ctx.dp_rank))


def _refused(ctx: ParallelContext) -> dict[str, bool]:
    """The old silent path: a wrapper that reduces .grad on a model whose gradients live in main_grad."""
    out = {}
    for variant in ("naive", "fused", "torch"):
        model = _mlp()
        attach_grad_buffers(model)
        try:
            make_ddp(model, ctx, variant=variant)
            out[variant] = False
        except ValueError as e:
            out[variant] = "reduce nothing" in str(e)
    # One buffer over two pipeline stages: averaging one stage would touch the other's gradients.
    model = _mlp()
    attach_grad_buffers(model)
    try:
        average_data_parallel_grads(list(model[0].parameters()), ctx)
        out["mixed_stage"] = False
    except ValueError as e:
        out["mixed_stage"] = "also holds" in str(e)
    return out


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.main_grad if hasattr(p, "main_grad") else p.grad).flatten() for p in model.parameters()])


def _ddp_on_buffer(ctx: ParallelContext) -> dict[str, Any]:
    """Bucketed DDP reducing the buffer in place vs copying .grad through its own buckets: equal gradients."""
    x = _batch(ctx)
    plain = make_ddp(_mlp(), ctx, variant="bucketed", bucket_cap_mb=0.0005)
    plain(x).square().sum().backward()
    plain.finish_grad_sync()
    model = _mlp()
    bufs = attach_grad_buffers(model, bucket_cap_mb=0.0005)
    ddp = make_ddp(model, ctx, variant="bucketed", bucket_cap_mb=0.0005)
    since = len(ctx.comm.ledger.records)
    ddp(x).square().sum().backward()
    ddp.finish_grad_sync()
    sent = sum(r.nbytes for r in ctx.comm.ledger.records[since:])
    assert len(ddp.buckets) == sum(len(b.buckets) for b in bufs) > 1
    return {"ddp_max_diff": (_grads(model) - _grads(plain.module)).abs().max().item(), "ddp_bytes": sent,
            "buffer_bytes": sum(b.nbytes for b in bufs)}


def _dp_average(ctx: ParallelContext) -> float:
    """average_data_parallel_grads on the buffer (in place, per bucket) vs on .grad (one flat message)."""
    x = _batch(ctx)
    a, b = _mlp(), _mlp()
    attach_grad_buffers(b, bucket_cap_mb=0.0003)
    for m in (a, b):
        m(x).square().sum().backward()
        average_data_parallel_grads(m, ctx)
    return (_grads(a) - _grads(b)).abs().max().item()


def _overflow_step(ctx: ParallelContext, choice: str) -> bool:
    """fp16 DDP with a gradient of BIG on every rank: does the step happen with an fp32 / an fp16 buffer?"""
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)  # the forward stays 0 (finite); the weight's gradient is the input, BIG
    attach_grad_buffers(model, dtype=torch.float32 if choice == "fp32" else torch.float16)
    setup = prepare_precision(model, "fp16", lambda ps: torch.optim.SGD(ps, lr=1e-9),
                              scaler={"init_scale": 1.0}, comm=ctx.comm)
    ddp = make_ddp(model, ctx, variant="bucketed")
    setup.optimizer.zero_grad()
    x = torch.full((1, 4), BIG, dtype=torch.float16)
    setup.optimizer.scale_loss(ddp(x).sum()).backward()
    ddp.finish_grad_sync()
    return setup.optimizer.step()


def suite() -> dict[str, Any]:
    """Every check in one launch."""
    with init_distributed() as ctx:
        return {"rank": ctx.rank, "refused": _refused(ctx), **_ddp_on_buffer(ctx), "dp_avg_max_diff": _dp_average(ctx),
                "stepped": {c: _overflow_step(ctx, c) for c in ("fp32", "param")}}
