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
# Rows never fed: the warm-up feeds ids < SEEN, the later steps ids < FED_LATER, ids from FED_LATER never appear.
SEEN, FED_LATER = 30, 40
UNSEEN_WARMUP, UNSEEN_STEPS = 5, 25
CKPT_WARMUP = 10


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


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _rows_batch(step: int, rank: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose inputs use token ids below ``high`` only (the targets too, so no id enters any other way)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, high, (4, CONFIG["block_size"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _unseen_rows(ctx: Any) -> dict[str, Any]:
    """Adam and 1-bit Adam on batches whose warm-up feeds ids < SEEN only and whose later steps ids < FED_LATER:
    how far the input-embedding rows of ids never fed, and of ids first fed after the warm-up, move from the start."""
    torch.manual_seed(0)
    start = GPT(GPTConfig(**CONFIG))
    seen = torch.zeros(CONFIG["vocab_size"])
    for step in range(UNSEEN_WARMUP):
        seen += torch.bincount(_rows_batch(step, ctx.rank, SEEN)[0].flatten(), minlength=seen.numel())
    dist.all_reduce(seen)
    out: dict[str, Any] = {"warmup_ids_fed": int((seen > 0).sum())}
    for name, warmup in (("adam", UNSEEN_STEPS + 1), ("1-bit", UNSEEN_WARMUP)):
        model = copy.deepcopy(start)
        opt = OneBitAdam(model.parameters(), ctx, lr=3e-3, warmup_steps=warmup)
        c = CONFIG["n_embd"]  # c_attn's bias is (query, key, value): the key's is [c, 2c)
        for step in range(UNSEEN_STEPS):
            if step == UNSEEN_WARMUP:  # the key biases at the freeze: they drift on rounding noise before it
                frozen = [b.attn.c_attn.bias[c:2 * c].detach().clone() for b in model.blocks]
            x, y = _rows_batch(step, ctx.rank, SEEN if step < UNSEEN_WARMUP else FED_LATER)
            opt.zero_grad()
            model(x, y)[1].backward()
            opt.step()
        moved = (model.wte.weight - start.wte.weight).detach().abs()
        key_bias = max((b.attn.c_attn.bias[c:2 * c] - f).abs().max().item() for b, f in zip(model.blocks, frozen))
        out[name] = {"never_fed": moved[FED_LATER:].max().item(), "fed_later": moved[SEEN:FED_LATER].max().item(),
                     "key_bias": key_bias,
                     "seen": moved[:SEEN].max().item(), "frozen_numel": opt.frozen_numel,
                     "compressed_numel": opt.compressed_numel, "finite": bool(torch.isfinite(_flat(model)).all())}
    return out


def _paper_step(ctx: Any) -> dict[str, Any]:
    """The first compressed step's update against Algorithm 1's ``lr * m / frozen preconditioner`` (no bias
    correction of m), recomputed with the optimizer's own per-parameter addcdiv on the same views: bit-equal."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    lr, (beta1, beta2), eps = 1e-2, (0.9, 0.999), 1e-8
    opt = OneBitAdam(model.parameters(), ctx, lr=lr, betas=(beta1, beta2), eps=eps, warmup_steps=WARMUP)
    out: dict[str, Any] = {}
    for step in range(WARMUP + 1):
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(step, ctx.rank)
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    denom = (opt.exp_avg_sq.sqrt() / (1 - beta2 ** WARMUP) ** 0.5).add_(eps)
    paper_diff, corrected_diff, offset = 0.0, 0.0, 0
    for p, b in zip(model.parameters(), before):
        m, d = opt.exp_avg[offset:offset + p.numel()].view_as(p), denom[offset:offset + p.numel()].view_as(p)
        paper_diff = max(paper_diff, (b.addcdiv(m, d, value=-lr) - p).abs().max().item())
        corrected = b.addcdiv(m, d, value=-lr / (1 - beta1 ** (WARMUP + 1)))  # torch's Adam's step size
        corrected_diff = max(corrected_diff, (corrected - p).abs().max().item())
        offset += p.numel()
    out["paper_step_diff"], out["bias_corrected_step_diff"] = paper_diff, corrected_diff
    return out


def _checkpoint(ctx: Any) -> dict[str, Any]:
    """Save model and optimizer two compressed steps in, go on 3 steps; then load the save into fresh objects and go
    on again: with the error buffers restored, without them (reset_errors), and from another rank's dict.

    A 10-step warm-up: after 3, some variances are still so small that the compressed steps move their elements by
    hundreds, and any change (such as restarting the error buffers) shows at that scale."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    opt = OneBitAdam(model.parameters(), ctx, lr=3e-3, warmup_steps=CKPT_WARMUP)

    def train(m: torch.nn.Module, o: OneBitAdam, steps: range) -> None:
        for step in steps:
            x, y = _batch(step, ctx.rank)
            o.zero_grad()
            m(x, y)[1].backward()
            o.step()

    train(model, opt, range(CKPT_WARMUP + 2))
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), opt.state_dict()
    train(model, opt, range(CKPT_WARMUP + 2, CKPT_WARMUP + 5))
    uninterrupted = _flat(model)
    out: dict[str, Any] = {"saved_has_errors": saved_opt["worker_error"] is not None
                           and bool(saved_opt["worker_error"].abs().sum() > 0)}
    for case in ("restored", "reset", "other rank"):
        resumed = GPT(GPTConfig(**CONFIG))
        resumed.load_state_dict(saved_model)
        opt2 = OneBitAdam(resumed.parameters(), ctx, lr=3e-3, warmup_steps=CKPT_WARMUP)
        state = dict(saved_opt, rank=(saved_opt["rank"] + 1) % ctx.world_size) if case == "other rank" else saved_opt
        opt2.load_state_dict(state, reset_errors=case == "reset")
        out[f"{case}: errors kept"] = opt2.state.worker_error is not None
        train(resumed, opt2, range(CKPT_WARMUP + 2, CKPT_WARMUP + 5))
        out[f"{case}: equal"] = torch.equal(_flat(resumed), uninterrupted)
        out[f"{case}: max diff"] = (_flat(resumed) - uninterrupted).abs().max().item()
    return out


def suite() -> dict[str, Any]:
    """Every check at this world size; rank 0's results (the replica check compares all ranks).

    One rank runs only the checks that need no peer: the rows never fed and the paper's step.
    """
    ctx = init_distributed()
    out: dict[str, Any] = {"world": ctx.world_size}
    out["unseen"] = _unseen_rows(ctx)
    out.update(_paper_step(ctx))
    if ctx.world_size == 1:
        ctx.destroy()
        return out
    out.update(_checkpoint(ctx))
    out.update(_warmup_vs_adam(ctx))
    out.update(_bytes(ctx))
    out.update(_error_feedback(ctx))
    if ctx.world_size == 2:
        start = time.perf_counter()
        out["curves"] = onebit_loss_curves(ctx)
        out["curves_s"] = time.perf_counter() - start  # reported, never asserted
    ctx.destroy()
    return out
