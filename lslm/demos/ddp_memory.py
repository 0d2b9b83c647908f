"""DDP's memory on one rank, counted and read from glibc's allocator, in one process (no peers needed).

What notebook 04 counts per rank (parameters, the gradient buckets, AdamW's states) is built here the way the
``lslm.recipes.ddp`` recipe builds it, as rank 0 of a ``world_size``-rank group on torch's fake backend
(:func:`lslm.runtime.fake_world.fake_world`: collectives return at once, so the buffers and the step are the real
ones and nothing waits for peers). Each piece is built inside its own
:class:`~lslm.metrics.malloc_delta.MallocDelta`, so the allocator's figure for it sits beside the count:

* ``parameters``: building the GPT, counted as its parameters' bytes;
* ``gradient buckets``: the recipe's layout, a bucketed fp32 gradient buffer (``main_grad``) that
  :class:`~lslm.data_parallel.ddp.BucketedDDP` all-reduces bucket by bucket in place; counted as the buffer's bytes;
* ``AdamW states``: what the first training step leaves behind (``exp_avg``, ``exp_avg_sq`` and a ``step``
  scalar per tensor), counted from the optimizer's state;
* ``copying buckets``: :class:`~lslm.data_parallel.ddp.BucketedDDP` on a plain model (no buffer) keeps one flat
  buffer per bucket beside ``.grad`` and copies into it; counted as its registered ``comm_buffers``.

Off glibc the allocator's figures are ``None``.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from lslm.data_parallel.ddp import make_ddp
from lslm.metrics.malloc_delta import MallocDelta
from lslm.recipes.ddp import DDPConfig, model_loss
from lslm.recipes.train import build_model, prepare_training
from lslm.runtime.context import ParallelContext
from lslm.runtime.fake_world import fake_world
from lslm.runtime.grid import RankGrid

__all__ = ["ddp_memory_rows", "format_rows"]


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def ddp_memory_rows(model: dict[str, Any], *, world_size: int = 2, bucket_cap_mb: float = 0.1,
                    rows_per_rank: int = 4) -> list[dict[str, Any]]:
    """Rank 0's memory in a ``world_size``-rank bucketed DDP run of the GPT ``model``, counted and by the allocator.

    ``model``: :class:`~lslm.recipes.ddp.DDPConfig` fields of the model (``n_layer``, ``n_embd``, ...). Returns rows
    ``{"what", "counted", "allocator"}`` in bytes (see the module doc; ``allocator`` is ``None`` off glibc), the last
    one ``"copying buckets"``. One forward and backward of ``rows_per_rank`` sequences, then AdamW's step.
    """
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 for data parallelism, got {world_size}")
    cfg = DDPConfig(**model, batch_size=rows_per_rank * world_size, bucket_cap_mb=bucket_cap_mb, variant="bucketed")
    device = torch.device("cpu")
    with fake_world(0, world_size):
        ctx = ParallelContext.create(RankGrid.build(world_size, dp=world_size), rank=0, local_rank=0, node_rank=0,
                                     device=device, backend="fake", timeout_s=5)
        gen = torch.Generator().manual_seed(cfg.seed)
        xy = torch.randint(0, cfg.vocab_size, (rows_per_rank, cfg.block_size + 1), generator=gen, device=device)
        # Every MallocDelta collects garbage at both ends; freezing what exists now (the interpreter's modules)
        # keeps those collections to the objects made since, tens of milliseconds instead of a second each.
        gc.collect()
        gc.freeze()
        try:
            _measure(cfg, ctx, xy)  # once unread: first calls allocate caches (lazy imports, kernels' first runs)
            return _measure(cfg, ctx, xy)
        finally:
            gc.unfreeze()


def _measure(cfg: DDPConfig, ctx: ParallelContext, xy: torch.Tensor) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    torch.manual_seed(cfg.seed)
    with MallocDelta() as built:
        net = build_model(cfg)
    rows.append({"what": "parameters", "counted": _nbytes(net.parameters()), "allocator": built.bytes})
    with MallocDelta() as wrapped:
        setup = prepare_training(net, cfg, main_grad=True, ctx=ctx, bucket_cap_mb=cfg.bucket_cap_mb)
        ddp = make_ddp(net, ctx, variant="bucketed", bucket_cap_mb=cfg.bucket_cap_mb)
    rows.append({"what": f"gradient buckets ({len(ddp.grad_buffers[0].buckets)}, the gradient buffer)",
                 "counted": ddp.grad_bytes, "allocator": wrapped.bytes})
    optimizer = setup.optimizer
    with MallocDelta() as stepped:
        optimizer.zero_grad()
        loss = model_loss(ddp, xy[:, :-1], xy[:, 1:])
        optimizer.scale_loss(loss).backward()
        ddp.finish_grad_sync()
        optimizer.step(None)
        del loss
    inner = getattr(optimizer, "optimizer", optimizer)
    rows.append({"what": "AdamW states", "counted": _nbytes(_state_tensors(inner)), "allocator": stepped.bytes})
    del ddp, setup, optimizer, inner, net
    gc.collect()
    torch.manual_seed(cfg.seed)
    plain = build_model(cfg)
    with MallocDelta() as copying:
        ddp = make_ddp(plain, ctx, variant="bucketed", bucket_cap_mb=cfg.bucket_cap_mb)
    rows.append({"what": f"copying buckets ({len(ddp._plan)}, beside .grad)",
                 "counted": _nbytes(ddp.memory_owners()["comm_buffers"]), "allocator": copying.bytes})
    del ddp, plain
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows as a table: what, counted bytes, the allocator's bytes and their difference."""
    lines = [f"{'rank 0':<40} {'counted':>11} {'allocator':>11} {'difference':>10}"]
    for r in rows:
        alloc = r["allocator"]
        lines.append(f"{r['what']:<40} {r['counted']:>11,} " + ("   (no glibc)" if alloc is None else
                     f"{alloc:>11,} {alloc / r['counted'] - 1:>+10.1%}"))
    return "\n".join(lines)
