"""Workers for tests/test_three_d.py's torch-native side: the same 3D run with torch's own pieces, step by step.

DTensor TP on ``ctx.mesh["tp"]`` (:func:`lslm.tensor_parallel.dtensor_reference.parallelize_gpt`),
``torch.distributed.pipelining`` over ``ctx.group("pp")`` (:class:`lslm.pipeline.torch_reference.TorchPipeline`),
then FSDP2's ``fully_shard`` over ``ctx.mesh["dp"]`` on each stage. Each composition is tried in
order and what happens is reported (a loss compared with the serial one, or the exception torch
raised, by type and first line), so the test can say exactly where torch stops composing on CPU.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed

SEED, ROWS, T, VOCAB, STEPS, LR = 1234, 8, 16, 96, 3, 1e-3


def config() -> GPTConfig:
    """The tiny GPT (untied: the DTensor reference and torch pipelining refuse tied weights)."""
    return GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=T, vocab_size=VOCAB, dropout=0.0)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed global batch."""
    g = torch.Generator().manual_seed(7)
    tok = torch.randint(0, VOCAB, (ROWS, T + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _attempt(fn: Any) -> dict[str, Any]:
    try:
        return {"ok": True, **fn()}
    except Exception as exc:  # noqa: BLE001 - reported, not hidden: the point is to see where torch stops
        frames = [ln for ln in traceback.format_exc().strip().splitlines() if ln.lstrip().startswith("File")]
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "where": frames[-6:]}


def probe(tp: int = 2, pp: int = 2, timeout_s: float = 60.0, **_: Any) -> dict[str, Any]:
    """Train 3 AdamW steps with torch's pieces (TP x PP at dp = 1; TP x PP x FSDP2) against the serial run."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from lslm.pipeline.torch_reference import TorchPipeline
    from lslm.tensor_parallel.dtensor_reference import parallelize_gpt
    from lslm.tensor_parallel.qkv import qkv_permutation

    ctx = init_distributed(tp=tp, pp=pp, timeout_s=timeout_s)
    x, y = batch()
    rows = ROWS // ctx.dp_size
    mine = slice(ctx.dp_rank * rows, (ctx.dp_rank + 1) * rows)
    out: dict[str, Any] = {"rank": ctx.rank}

    def serial_run() -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(SEED)
        model = GPT(config())
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, {n: p.detach() for n, p in model.named_parameters()}

    def tp_pp(fsdp: bool, schedule: str = "1f1b", sp: bool = False) -> dict[str, Any]:
        torch.manual_seed(SEED)
        model = parallelize_gpt(GPT(config()), ctx, sequence_parallel=sp)
        pipe = TorchPipeline(model, ctx, schedule, microbatches=2)
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for stage in pipe.stages.values():
                for block in stage.blocks:
                    fully_shard(block, mesh=ctx.mesh["dp"])
                fully_shard(stage, mesh=ctx.mesh["dp"])
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=LR, foreach=False)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            with loss_parallel():
                loss = pipe.step(x[mine], y[mine], sync_grads=not fsdp)
            opt.step()
            total = loss.detach().clone().reshape(1)
            ctx.comm.all_reduce(total, group=ctx.group("dp"), label="probe loss")
            losses.append(total.item() / ctx.dp_size)
        # Whole parameters back from their (dp x tp) shards, c_attn's rows in the serial order again.
        perm = qkv_permutation(config().n_embd, config().n_head, ctx.tp_size)
        dparam = 0.0
        for name, p in pipe.named_parameters():
            full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
                full = full[torch.argsort(perm)]
            dparam = max(dparam, (full - ref_params[name]).abs().max().item())
        return {"losses": losses, "dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "dparam": dparam}

    ref_losses, ref_params = serial_run()
    if ctx.dp_size == 1:  # without FSDP the replicas' DTensor gradients would need a DTensor-aware dp average
        out["tp_pp"] = _attempt(lambda: tp_pp(False))
    out["tp_pp_fsdp"] = _attempt(lambda: tp_pp(True))
    out["tp_pp_fsdp_interleaved"] = _attempt(lambda: tp_pp(True, "interleaved"))
    out["tp_pp_fsdp_sp"] = _attempt(lambda: tp_pp(True, sp=True))
    ctx.barrier()
    return out
