"""Notebook 09's 3D run with PyTorch's own pieces, on the same ``DeviceMesh``: DTensor TP, pipelining, FSDP2.

:func:`torch_case` trains the GPT on one ``pp x dp x tp`` grid with torch's composition, the
order torchtitan uses: DTensor tensor parallelism on ``ctx.mesh["tp"]``
(:func:`lslm.tensor_parallel.dtensor_reference.parallelize_gpt`), then
``torch.distributed.pipelining`` over ``ctx.group("pp")``
(:class:`lslm.pipeline.torch_reference.TorchPipeline`), then FSDP2's ``fully_shard`` over
``ctx.mesh["dp"]`` on every block and stage. It reports the losses and the largest parameter
difference against :func:`serial_run`, the same GPT, batches and AdamW in one process.

Where the composition stops (both on lslm's side of the seam, not torch's):

* **tied embeddings**: ``parallelize_gpt`` and ``TorchPipeline`` refuse a GPT whose head shares
  the embedding's weight (:func:`tied_refusals` returns their messages). A pipeline puts the
  two ends on different ranks; summing their gradients is a step neither torch piece takes.
* **plain data parallelism at dp > 1**: without FSDP the replicas' gradients are DTensors
  (``Shard`` over tp, ``Partial`` under SP), and lslm's data-parallel average
  (:func:`~lslm.tensor_parallel.clip.average_data_parallel_grads`) concatenates plain
  tensors into one flat all-reduce. So at dp > 1 the gradients are averaged by
  ``fully_shard``'s reduce-scatter; plain averaging runs only with one replica (dp = 1).

The run has no gradient clipping: torch's ``clip_grad_norm_`` does not sum the norm over the
pipeline's ranks, so its serial run does not clip either. tests/test_three_d.py checks every
variant against the serial run in the same launch as lslm's own 3D cases.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.context import ParallelContext

__all__ = ["serial_run", "tied_refusals", "torch_case"]

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def serial_run(cfg: GPTConfig, batches: Batches, *, seed: int, lr: float,
               weight_decay: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters of ``cfg``'s GPT trained on ``batches`` in one process (fp32 AdamW, no clip)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def tied_refusals(cfg: GPTConfig, ctx: ParallelContext) -> dict[str, str]:
    """What ``parallelize_gpt`` and ``TorchPipeline`` say to a GPT with tied embeddings (checked before any
    communication, on a model of the meta device)."""
    from lslm.pipeline.torch_reference import TorchPipeline
    from lslm.tensor_parallel.dtensor_reference import parallelize_gpt

    tied = replace(cfg, tie_weights=True)
    out = {}
    for name, build in (("parallelize_gpt", lambda m: parallelize_gpt(m, ctx)),
                        ("TorchPipeline", lambda m: TorchPipeline(m, ctx, "1f1b", microbatches=2))):
        with torch.device("meta"):
            model = GPT(tied)
        try:
            build(model)
        except ValueError as exc:
            out[name] = str(exc)
        else:  # pragma: no cover - would mean the refusal was removed; the caller's checks then fail
            out[name] = ""
    return out


def torch_case(ctx: ParallelContext, case: dict[str, Any], cfg: GPTConfig, batches: Batches,
               ref: tuple[list[float], dict[str, torch.Tensor]], *, seed: int, lr: float,
               weight_decay: float) -> dict[str, Any]:
    """Train ``cfg``'s GPT on ``batches`` with torch's TP x PP (x FSDP2 over dp) on ``case``'s grid.

    ``case``: ``dp``, ``tp``, ``pp``, ``schedule`` (a :class:`~lslm.pipeline.torch_reference.TorchPipeline`
    name) and optionally ``sp`` and ``m`` (micro-batches, default 2). ``ref``: :func:`serial_run`'s
    result. Every rank of ``ctx``'s world calls this at once. Returns ``losses`` / ``ref_losses``, ``dloss``,
    ``dparam`` (this rank's parameters, gathered whole, against the serial ones) and ``dparam_all`` (the
    maximum over every rank), and ``fsdp`` (whether ``fully_shard`` ran: dp > 1).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from lslm.pipeline.torch_reference import TorchPipeline
    from lslm.tensor_parallel.dtensor_reference import parallelize_gpt
    from lslm.tensor_parallel.qkv import qkv_permutation

    t0 = time.perf_counter()
    pctx = ctx.with_grid(tp=case["tp"], pp=case["pp"], dp=case["dp"])
    fsdp = pctx.dp_size > 1  # plain averaging cannot take DTensor gradients (module doc)
    torch.manual_seed(seed)
    model = parallelize_gpt(GPT(cfg).to(pctx.device), pctx, sequence_parallel=case.get("sp", False))
    pipe = TorchPipeline(model, pctx, case["schedule"], microbatches=case.get("m", 2))
    if fsdp:
        for stage in pipe.stages.values():
            for block in stage.blocks:
                fully_shard(block, mesh=pctx.mesh["dp"])
            fully_shard(stage, mesh=pctx.mesh["dp"])
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=lr, weight_decay=weight_decay, foreach=False)
    rows = batches[0][0].shape[0] // pctx.dp_size
    mine = slice(pctx.dp_rank * rows, (pctx.dp_rank + 1) * rows)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        with loss_parallel():
            loss = pipe.step(x[mine], y[mine], sync_grads=not fsdp)
        opt.step()
        total = loss.detach().clone().reshape(1)
        pctx.comm.all_reduce(total, group=pctx.group("dp"), label="demo loss")
        losses.append(total.item() / pctx.dp_size)
    ref_losses, ref_params = ref
    # Whole parameters back from their (dp x tp) shards, c_attn's rows in the serial order again.
    perm = torch.argsort(qkv_permutation(cfg.n_embd, cfg.n_head, pctx.tp_size))
    dparam = 0.0
    for name, p in pipe.named_parameters():
        full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            full = full[perm.to(full.device)]
        dparam = max(dparam, (full - ref_params[name].to(full.device)).abs().max().item())
    worst = torch.tensor([dparam], device=pctx.device)
    pctx.comm.all_reduce(worst, op=dist.ReduceOp.MAX, label="demo check")
    return {"case": case, "fsdp": fsdp, "losses": losses, "ref_losses": ref_losses,
            "dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "dparam": dparam,
            "dparam_all": worst.item(), "s": time.perf_counter() - t0}
