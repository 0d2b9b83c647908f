"""Workers for tests/test_tp_dtensor.py: the DTensor GPT against the serial GPT, the two vocab-parallel
losses against each other, and the collectives each tensor-parallel version issues."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from lslm.demos.dtensor_compare import compare_with_serial
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lslm.tensor_parallel.dtensor_reference import dtensor_comm_counts, dtensor_loss, full_parameters, parallelize_gpt
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

SEED, STEPS, ROWS, T = 1234, 3, 4, 16
VOCAB = 256  # divisible by tp = 2 and 4: no padding, so both losses see the same shards


def config() -> GPTConfig:
    """The model every case uses: GPTConfig.tiny (2 layers, 4 heads, width 64) with a 256-token vocabulary."""
    return GPTConfig.tiny(vocab_size=VOCAB)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of one step, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    tok = torch.randint(0, VOCAB, (ROWS, T + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _train(model: GPT, step_loss: Any) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(step_loss(model, *batch(step)))
        opt.step()
    return losses


def _serial_step(model: GPT, x: torch.Tensor, y: torch.Tensor) -> float:
    _, loss = model(x, y)
    loss.backward()
    return loss.item()


def _dtensor_step(model: GPT, x: torch.Tensor, y: torch.Tensor) -> float:
    return dtensor_loss(model, x, y, backward=True).item()


def _training(ctx: ParallelContext) -> dict[str, Any]:
    """3 SGD-momentum steps serial and DTensor-parallel (SP off / on): loss and final-weight differences."""
    torch.manual_seed(SEED)
    ref = GPT(config())
    ref_losses = _train(ref, _serial_step)
    want = dict(ref.named_parameters())
    x, _ = batch(99)
    with torch.no_grad():
        want_logits = ref(x)[0]
    out = {}
    for sp in (False, True):
        torch.manual_seed(SEED)
        model = parallelize_gpt(GPT(config()), ctx, sequence_parallel=sp)
        losses = _train(model, _dtensor_step)
        got = full_parameters(model)
        with torch.no_grad():
            logits = model(x)[0].full_tensor()
        out[f"sp={sp}"] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max((got[n] - p.detach()).abs().max().item() for n, p in want.items()),
            "logits_diff": (logits - want_logits).abs().max().item(),
            "losses": losses,
        }
    return out


def _losses(ctx: ParallelContext) -> dict[str, float]:
    """lslm's vocab-parallel cross-entropy vs DTensor loss_parallel vs F.cross_entropy, on the same shards."""
    g = torch.Generator().manual_seed(7)
    n = 24
    logits = torch.randn(n, VOCAB, generator=g) * 3
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    targets[::5] = -100  # ignored tokens: both must leave them out of the mean
    shard = logits.chunk(ctx.tp_size, dim=-1)[ctx.tp_rank]

    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, targets)
    want.backward()
    want_grad = full.grad.chunk(ctx.tp_size, dim=-1)[ctx.tp_rank]

    mine = shard.clone().requires_grad_()
    lslm_loss = vocab_parallel_cross_entropy(mine, targets, ctx, vocab_size=VOCAB)
    lslm_loss.backward()

    local = shard.clone().requires_grad_()
    dt_logits = DTensor.from_local(local, ctx.mesh["tp"], [Shard(-1)], run_check=False)
    with loss_parallel():
        dt_loss = F.cross_entropy(dt_logits, targets)
        dt_loss.backward()
    dt_value = dt_loss.detach().to_local()
    return {
        "lslm_vs_dtensor_loss": (lslm_loss.detach() - dt_value).abs().item(),
        "lslm_vs_dtensor_grad": (mine.grad - local.grad).abs().max().item(),
        "lslm_vs_torch_loss": (lslm_loss.detach() - want.detach()).abs().item(),
        "dtensor_vs_torch_grad": (local.grad - want_grad).abs().max().item(),
    }


def _lslm_key(label: str) -> tuple[str, str]:
    """Ledger label -> (owner in dtensor_comm_counts' terms, the rest): ``"blocks.0.attn.c_proj fwd"`` ->
    ``("blocks.0", "fwd")``, ``"lm_head regather bwd"`` -> ``("lm_head", "regather bwd")``."""
    name, _, rest = label.partition(" ")
    parts = name.split(".")
    if parts[0] == "blocks":
        return ".".join(parts[:2]), rest
    if parts[0] in ("wte", "wpe", "lm_head"):
        return parts[0], rest
    return label, ""


def lslm_comm_counts(ctx: ParallelContext, sp: bool, regather: bool = True) -> dict[str, Any]:
    """The lslm TP model's one forward + backward (+ gradient sync) from the ledger.

    ``{"by_owner": {owner: {"op|phase": calls}}, "elements": {owner: [elements per call]}}``.
    """
    torch.manual_seed(SEED)
    model = apply_tensor_parallel(GPT(config()), ctx, sequence_parallel=sp, regather_input=regather)
    x, y = batch(0)
    ledger = ctx.comm.ledger
    ledger.reset()
    logits, _ = model(x)
    vocab_parallel_cross_entropy(logits, y, ctx, vocab_size=VOCAB).backward()
    sync_tensor_parallel_grads(model, ctx)
    counts: dict[str, Counter[str]] = {}
    elements: dict[str, list[int]] = {}
    for rec in ledger.records:
        owner, rest = _lslm_key(rec.label)
        counts.setdefault(owner, Counter())[f"{rec.op}|{rest}" if rest else rec.op] += 1
        elements.setdefault(owner, []).append(rec.nbytes // 4)  # fp32
    ledger.reset()
    return {"by_owner": {k: dict(v) for k, v in counts.items()}, "elements": elements}


def _counts(ctx: ParallelContext) -> dict[str, Any]:
    out = {}
    for sp in (False, True):
        torch.manual_seed(SEED)
        model = parallelize_gpt(GPT(config()), ctx, sequence_parallel=sp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        out[f"dtensor sp={sp}"] = dtensor_comm_counts(model, *batch(0), optimizer=opt)
        out[f"lslm sp={sp}"] = lslm_comm_counts(ctx, sp)
    out["lslm sp=True regather=False"] = lslm_comm_counts(ctx, True, regather=False)
    return out


def suite(**_: Any) -> dict[str, Any]:
    """Every case on one launch (tp = world size): training equality, the two losses, communication counts,
    and what notebook 05's cell prints (lslm.demos.dtensor_compare.compare_with_serial)."""
    import os

    with init_distributed(tp=int(os.environ["WORLD_SIZE"])) as ctx:
        return {"tp": ctx.tp_size, "training": _training(ctx), "losses": _losses(ctx), "counts": _counts(ctx),
                "notebook": compare_with_serial(ctx)}
