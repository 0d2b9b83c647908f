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

SEED, ROWS, T, VOCAB = 1234, 8, 16, 96


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
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "where": [ln for ln in traceback.format_exc().strip().splitlines() if ln.lstrip().startswith("File")][-6:]}


def probe(tp: int = 2, pp: int = 2, timeout_s: float = 60.0, **_: Any) -> dict[str, Any]:
    """Try TP x PP, then TP x PP x FSDP2, with torch's pieces on this world's dp = tp = pp = 2 grid."""
    from torch.distributed.tensor.parallel import loss_parallel

    from lslm.pipeline.torch_reference import TorchPipeline
    from lslm.tensor_parallel.dtensor_reference import parallelize_gpt

    ctx = init_distributed(tp=tp, pp=pp, timeout_s=timeout_s)
    x, y = batch()
    torch.manual_seed(SEED)
    serial = GPT(config())
    _, ref = serial(x, y)
    rows = ROWS // ctx.dp_size
    mine = slice(ctx.dp_rank * rows, (ctx.dp_rank + 1) * rows)
    out: dict[str, Any] = {"rank": ctx.rank, "serial_loss": ref.item()}

    def tp_pp(fsdp: bool) -> dict[str, Any]:
        torch.manual_seed(SEED)
        model = parallelize_gpt(GPT(config()), ctx)
        pipe = TorchPipeline(model, ctx, "1f1b", microbatches=2)
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for stage in pipe.stages.values():
                fully_shard(stage, mesh=ctx.mesh["dp"])
        with loss_parallel():
            loss = pipe.step(x[mine], y[mine], sync_grads=not fsdp)
        total = loss.detach().clone().reshape(1)
        ctx.comm.all_reduce(total, group=ctx.group("dp"), label="probe loss")
        return {"loss": total.item() / ctx.dp_size}

    out["tp_pp"] = _attempt(lambda: tp_pp(False))
    out["tp_pp_fsdp"] = _attempt(lambda: tp_pp(True))
    ctx.barrier()
    return out
