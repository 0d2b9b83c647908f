"""Workers for tests/test_tp_clip_checkpoint.py: global-norm clipping and TP checkpoints against the serial GPT.

Every rank builds the serial reference itself from one seed (nothing shipped around)
and returns numbers (norms, largest differences, ledger counts, error messages).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.runtime.ledger import Comm
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.checkpoint import (
    gather_full_state_dict,
    gather_full_tensors,
    load_tensor_parallel,
    save_tensor_parallel,
)
from lslm.tensor_parallel.clip import CLIP_LABEL, DP_GRAD_LABEL, average_data_parallel_grads, clip_grad_norm_
from lslm.tensor_parallel.cross_entropy import gather_logits, vocab_parallel_cross_entropy
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads
from lslm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

SEED, ROWS, T = 1234, 4, 16
MAX_NORM = 0.05  # well below the first step's gradient norm (~1): clipping is active


def _config(**kw: Any) -> GPTConfig:
    return GPTConfig.tiny(vocab_size=250, **kw)  # 250: padded to 252 at tp=4


def _batch(step: int, vocab: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tok = torch.randint(0, vocab, (rows, T + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _context(base: ParallelContext, tp: int) -> ParallelContext:
    # Another grid over the same processes, with its own ledger (counted per case).
    return ParallelContext.create(RankGrid.build(base.world_size, tp=tp), rank=base.rank, local_rank=base.local_rank,
                                  node_rank=base.node_rank, device=base.device, backend=base.backend,
                                  timeout_s=base.timeout_s, comm=Comm(device=base.device))


def _tp_model(cfg: GPTConfig, ctx: ParallelContext, seed: int = SEED, sp: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return apply_tensor_parallel(GPT(cfg).to(ctx.device), ctx, sequence_parallel=sp)


def _my_rows(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    rows = x.shape[0] // ctx.dp_size
    return x[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows]


def _naive_norm(model: nn.Module, ctx: ParallelContext) -> float:
    """The plausible wrong global norm: every rank's local squares summed, replicated parameters counted t times."""
    sq = torch.zeros(1, device=ctx.device)
    for p in model.parameters():
        sq += p.grad.float().pow(2).sum()
    ctx.comm.all_reduce(sq, group=ctx.group("tp", "pp"), label="naive")
    return sq.sqrt().item()


def _clip_case(base: ParallelContext, tp: int, sp: bool) -> dict[str, Any]:
    ctx = _context(base, tp)
    cfg = _config()
    x, y = _batch(0, cfg.vocab_size)
    torch.manual_seed(SEED)
    ref = GPT(cfg)
    ref(x, y)[1].backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model = _tp_model(cfg, ctx, sp=sp)
    logits, _ = model(_my_rows(x, ctx).to(ctx.device))
    vocab_parallel_cross_entropy(logits, _my_rows(y, ctx).to(ctx.device), ctx, vocab_size=cfg.vocab_size).backward()
    sync_tensor_parallel_grads(model, ctx)
    before = len(ctx.comm.ledger.records)
    reduced = average_data_parallel_grads(model, ctx)
    dp_calls = ctx.comm.ledger.calls("all_reduce", DP_GRAD_LABEL, since=before)
    dp_bytes = ctx.comm.ledger.total_bytes("all_reduce", DP_GRAD_LABEL, since=before)
    naive = _naive_norm(model, ctx)
    unclipped = [p.grad.clone() for p in model.parameters()]
    before = len(ctx.comm.ledger.records)
    big = clip_grad_norm_(model, 1e9, ctx).item()  # coefficient 1: nothing moves
    untouched = all(torch.equal(a, p.grad) for a, p in zip(unclipped, model.parameters()))
    norm = clip_grad_norm_(model, MAX_NORM, ctx).item()
    clip_calls = ctx.comm.ledger.calls("all_reduce", CLIP_LABEL, since=before)
    clip_bytes = ctx.comm.ledger.total_bytes("all_reduce", CLIP_LABEL, since=before)
    full = gather_full_tensors(model, ctx, {n: p.grad for n, p in model.named_parameters()})
    grad_diff = max((full[n].cpu() - g).abs().max().item() for n, g in ref_grads.items())
    grad_scale = max(g.abs().max().item() for g in ref_grads.values())

    # Serial -> TP -> full -> serial, for the untied and the tied model.
    roundtrip = {}
    for tie in (False, True):
        c = _config(tie_weights=tie)
        torch.manual_seed(SEED)
        serial = GPT(c)
        back = GPT(c)  # other random weights until loaded
        back.load_state_dict(gather_full_state_dict(_tp_model(c, ctx), ctx), strict=True)
        roundtrip[str(tie)] = all(torch.equal(a, b) for a, b in zip(serial.state_dict().values(),
                                                                    back.state_dict().values()))
    return {"tp": ctx.tp_size, "dp": ctx.dp_size, "sp": sp, "ref_norm": ref_norm, "norm": norm, "big_norm": big,
            "naive_norm": naive, "untouched": untouched, "grad_diff": grad_diff, "grad_scale": grad_scale,
            "local_numel": sum(p.numel() for p in model.parameters()), "dp_reduced": reduced, "dp_calls": dp_calls,
            "dp_bytes": dp_bytes, "clip_calls": clip_calls, "clip_bytes": clip_bytes, "roundtrip": roundtrip}


def clip_suite(cases: list[dict[str, Any]], **_: Any) -> list[dict[str, Any]]:
    """Every clipping case (``{"tp": t, "sp": bool}``; dp = the rest) in one process group."""
    with init_distributed() as base:
        return [_clip_case(base, c["tp"], c.get("sp", False)) for c in cases]


# -- checkpoints ---------------------------------------------------------------------------------------------
DROPOUT = 0.1  # exercises the random streams of an exact resume


def _train(model: nn.Module, opt: torch.optim.Optimizer, ctx: ParallelContext, steps: range,
           vocab: int) -> list[float]:
    losses = []
    model.train()
    for step in steps:
        x, y = (t.to(ctx.device) for t in _batch(step, vocab))
        logits, _ = model(x)
        loss = vocab_parallel_cross_entropy(logits, y, ctx, vocab_size=vocab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_tensor_parallel_grads(model, ctx)
        clip_grad_norm_(model, 1.0, ctx)
        opt.step()
        losses.append(loss.item())
    return losses


def _probe(model: nn.Module, ctx: ParallelContext, vocab: int) -> list[float]:
    model.eval()  # no dropout: draws nothing from the random streams
    with torch.no_grad():
        logits = gather_logits(model(_batch(999, vocab, rows=1)[0].to(ctx.device))[0], ctx, vocab)
    model.train()
    return logits.flatten().tolist()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def save_run(path: str, before: int = 3, after: int = 3, **_: Any) -> dict[str, Any]:
    """Train ``before`` steps at tp=2, save, probe, then train ``after`` more (the uninterrupted curve)."""
    cfg = _config(dropout=DROPOUT)
    with init_distributed(tp=int(os.environ["WORLD_SIZE"])) as ctx:
        model = _tp_model(cfg, ctx)
        opt = _optimizer(model)
        first = _train(model, opt, ctx, range(before), cfg.vocab_size)
        file = save_tensor_parallel(model, ctx, path, optimizer=opt, extra={"step": before})
        probe = _probe(model, ctx, cfg.vocab_size)
        full = gather_full_state_dict(model, ctx)
        if ctx.rank == 0:
            torch.save(full, Path(path) / "full_by_gather.pt")
        rest = _train(model, opt, ctx, range(before, before + after), cfg.vocab_size)
    return {"first": first, "rest": rest, "probe": probe, "file": str(file)}


def _error(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def load_run(path: str, after: int = 3, **_: Any) -> dict[str, Any]:
    """A fresh process group: load the tp=2 checkpoint into a TP model of other weights, probe, resume training;
    then try loading into wrong layouts."""
    cfg = _config(dropout=DROPOUT)
    with init_distributed(tp=int(os.environ["WORLD_SIZE"])) as ctx:
        model = _tp_model(cfg, ctx, seed=SEED + 1)
        opt = _optimizer(model)
        extra = load_tensor_parallel(model, ctx, path, optimizer=opt)
        kinds = {"lm_head": type(model.lm_head).__name__, "wte": type(model.wte).__name__,
                 "c_attn": type(model.blocks[0].attn.c_attn).__name__,
                 "c_proj": type(model.blocks[0].mlp.c_proj).__name__}
        parallel = (isinstance(model.lm_head, ColumnParallelLinear) and isinstance(model.wte, VocabParallelEmbedding)
                    and isinstance(model.blocks[1].attn.c_proj, RowParallelLinear))
        probe = _probe(model, ctx, cfg.vocab_size)
        full = gather_full_state_dict(model, ctx)
        rest = _train(model, opt, ctx, range(extra["step"], extra["step"] + after), cfg.vocab_size)
        # The unsharded weights load into the serial GPT and give the same logits. (Built only now: building
        # a GPT draws from the default random stream, which the resumed run above must find as it was saved.)
        serial = GPT(cfg)
        serial.load_state_dict(full, strict=True)  # on the CPU: the values are copied over
        serial.eval()
        with torch.no_grad():
            serial_probe = serial(_batch(999, cfg.vocab_size, rows=1)[0])[0].flatten()
        serial_diff = (serial_probe - torch.tensor(probe)).abs().max().item()

        # Wrong layouts: each must raise ValueError, never load silently.
        errors = {"plain_gpt": _error(lambda: load_tensor_parallel(GPT(cfg), ctx, path))}
        errors["other_width"] = _error(lambda: load_tensor_parallel(
            _tp_model(_config(dropout=DROPOUT, n_embd=32), ctx), ctx, path))
        swapped = _tp_model(cfg, ctx)
        # The picotron bug in reverse: a plain Linear with exactly the shard's shape where the parallel head was.
        swapped.lm_head = nn.Linear(cfg.n_embd, swapped.lm_head.weight.shape[0], bias=False)
        errors["plain_head"] = _error(lambda: load_tensor_parallel(swapped, ctx, path))
        one = ParallelContext.create(RankGrid.build(ctx.world_size, tp=1), rank=ctx.rank, local_rank=ctx.local_rank,
                                     node_rank=ctx.node_rank, device=ctx.device, backend=ctx.backend,
                                     timeout_s=ctx.timeout_s, comm=Comm(device=ctx.device))
        errors["other_tp"] = _error(lambda: load_tensor_parallel(_tp_model(cfg, one), one, path))
    return {"extra": extra, "kinds": kinds, "parallel": parallel, "probe": probe, "rest": rest,
            "serial_diff": serial_diff, "errors": errors}
