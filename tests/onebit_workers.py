"""Workers for tests/test_onebit_adam.py: 1-bit Adam on 2 or 4 gloo ranks."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist

from lslm.data_parallel.onebit_adam import OneBitAdam
from lslm.data_parallel.onebit_compress import (
    OneBitState,
    compressed_all_reduce,
    compressed_all_reduce_bus_bytes,
    padded_numel,
    sign_compress,
)
from lslm.data_parallel.onebit_run import onebit_loss_curves
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed

CONFIG = dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=24)
WARMUP = 3
STEPS = 6
EF_STEPS = 30
EF_NUMEL = 1000  # not a multiple of 8 x world: the padding is exercised


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, CONFIG["vocab_size"], (4, CONFIG["block_size"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _warmup_vs_adam(ctx: Any) -> dict[str, Any]:
    """OneBitAdam's warm-up steps against torch.optim.Adam on the same averaged flat gradient; then the replicas."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    ref = copy.deepcopy(model)
    opt = OneBitAdam(model.parameters(), ctx, lr=1e-2, warmup_steps=WARMUP)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=False)
    diffs, labels_per_step = [], []
    for step in range(STEPS):
        x, y = _batch(step, ctx.rank)
        since = len(ctx.comm.ledger.records)
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
        labels_per_step.append(sorted({r.label for r in ctx.comm.ledger.records[since:]}))
        if step < WARMUP:
            ref_opt.zero_grad()
            ref(x, y)[1].backward()
            flat = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
            dist.all_reduce(flat)  # the same flat sum, outside the ledger: the reference's own arithmetic
            flat /= ctx.world_size
            offset = 0
            for p in ref.parameters():
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            ref_opt.step()
            diffs.append(max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat)
    return {"warmup_diffs": diffs, "labels_per_step": labels_per_step,
            "replicas_equal": all(torch.equal(gathered[0], t) for t in gathered),
            "moved_after_warmup": (flat - torch.cat([p.detach().reshape(-1) for p in ref.parameters()])).abs().max()
            .item()}


def _bytes(ctx: Any) -> dict[str, Any]:
    """One compressed all-reduce and one fp32 all-reduce of the same 100,003-element tensor, from the ledger."""
    numel = 100_003
    x = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank))
    ledger = ctx.comm.ledger
    since = len(ledger.records)
    compressed_all_reduce(x, ctx.comm, OneBitState())
    recs = ledger.records[since:]
    since = len(ledger.records)
    ctx.comm.all_reduce(x.clone(), label="fp32")
    return {"bytes_numel": numel, "compressed_bus": sum(r.bus_bytes for r in recs),
            "compressed_ops": [(r.op, r.dtype, r.nbytes, r.label) for r in recs],
            "formula_bus": compressed_all_reduce_bus_bytes(numel, ctx.world_size),
            "fp32_bus": ledger.total_bus_bytes(since=since), "fp32_nbytes": ledger.total_bytes(since=since)}


def _reference_step(xs: list[torch.Tensor], worker_errors: list[torch.Tensor], server_errors: list[torch.Tensor],
                    feedback: bool) -> torch.Tensor:
    """The compressed all-reduce in one process, from every rank's input (updates the error lists in place)."""
    world, numel = len(xs), xs[0].numel()
    p = padded_numel(numel, world)
    decoded = []
    for i, x in enumerate(xs):
        y = torch.zeros(p)
        y[:numel] = x
        y += worker_errors[i]
        dec = sign_compress(y, world)[2]
        if feedback:
            worker_errors[i] = y - dec
        decoded.append(dec.view(world, -1))
    out = []
    for j in range(world):
        z = torch.stack([d[j] for d in decoded]).sum(dim=0) / world + server_errors[j]
        dec = sign_compress(z, 1)[2]
        if feedback:
            server_errors[j] = z - dec
        out.append(dec)
    return torch.cat(out)[:numel]


def _error_feedback(ctx: Any) -> dict[str, Any]:
    """Running sums of compressed all-reduces against the true mean, with and without error feedback."""
    out: dict[str, Any] = {}
    for feedback in (True, False):
        state = OneBitState(error_feedback=feedback)
        true_sum = torch.zeros(EF_NUMEL)
        comp_sum = torch.zeros(EF_NUMEL)
        errors, ref_diffs = [], []
        p = padded_numel(EF_NUMEL, ctx.world_size)
        ref_w = [torch.zeros(p) for _ in range(ctx.world_size)]
        ref_s = [torch.zeros(p // ctx.world_size) for _ in range(ctx.world_size)]
        for t in range(EF_STEPS):
            # A drifting signal plus noise, different on every rank, deterministic.
            g = torch.Generator().manual_seed(100 * t + ctx.rank)
            x = torch.linspace(-1, 1, EF_NUMEL) * (1 + ctx.rank) + 0.3 * torch.randn(EF_NUMEL, generator=g)
            everyone = [torch.empty_like(x) for _ in range(ctx.world_size)]
            dist.all_gather(everyone, x)
            true_sum += torch.stack(everyone).mean(dim=0)
            reduced = compressed_all_reduce(x, ctx.comm, state)
            ref_diffs.append((reduced - _reference_step(everyone, ref_w, ref_s, feedback)).abs().max().item())
            comp_sum += reduced
            errors.append((comp_sum - true_sum).norm().item() / true_sum.norm().item())
        out[f"errors_ef{feedback}"] = errors
        out[f"reference_diff_ef{feedback}"] = max(ref_diffs)
        if feedback:
            # The telescoping identity: sum(out) = sum(mean x) - mean_i(worker error) - server error.
            w = state.worker_error.clone()
            dist.all_reduce(w)
            w /= ctx.world_size
            s = torch.empty(w.numel())
            dist.all_gather_into_tensor(s, state.server_error)
            predicted = true_sum - (w + s)[:EF_NUMEL]
            out["identity_gap"] = (comp_sum - predicted).abs().max().item()
            out["identity_scale"] = comp_sum.abs().max().item()
    return out


def suite() -> dict[str, Any]:
    """Every check at this world size; rank 0's results (the replica check compares all ranks)."""
    ctx = init_distributed()
    out: dict[str, Any] = {"world": ctx.world_size}
    out.update(_warmup_vs_adam(ctx))
    out.update(_bytes(ctx))
    out.update(_error_feedback(ctx))
    if ctx.world_size == 2:
        start = time.perf_counter()
        out["curves"] = onebit_loss_curves(ctx)
        out["curves_s"] = time.perf_counter() - start  # reported, never asserted
    ctx.destroy()
    return out
