"""Small experiments notebook 05 runs: matmuls split by hand, the MLP order, the qkv trap, per-layer traffic, SP drift.

The first three run in one process, simulating ``t`` ranks by slicing tensors (no
communication is needed to see the arithmetic); the rest are launch targets
(``lslm.launch("lslm.demos.tensor_parallel_demo:<worker>", nproc=...)``) that run the real
layers over a real process group and return numbers for the notebook to print and plot.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lslm.models.gpt import GPT, GPTConfig
from lslm.models.hf import build_hf_gpt2
from lslm.runtime import init_distributed
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import gather_logits, vocab_parallel_cross_entropy
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads
from lslm.tensor_parallel.overlap import overlap_log, overlap_summary
from lslm.tensor_parallel.qkv import qkv_rows
from lslm.tensor_parallel.random import TENSOR_PARALLEL_RNG, model_parallel_seed

__all__ = ["dropout_masks_worker", "hf_gpt2_logits_worker", "mlp_orders", "per_layer_traffic_worker", "qkv_trap",
           "sp_drift_worker", "split_matmul", "split_matmul_worker"]


def split_matmul(t: int = 2, seed: int = 0) -> dict[str, float]:
    """``Y = X A`` computed as ``t`` column blocks (concatenated) and as ``t`` row blocks (summed), in one process.

    Returns the largest difference of each from the unsplit product (fp32 rounding only).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g)  # lslm: cpu-ok (one process, no communication)
    a = torch.randn(8, 12, generator=g)  # lslm: cpu-ok (one process, no communication)
    y = x @ a
    by_columns = torch.cat([x @ a_r for a_r in a.chunk(t, dim=1)], dim=1)  # each rank: all of X, its columns of A
    by_rows = sum(x_r @ a_r for x_r, a_r in zip(x.chunk(t, dim=1), a.chunk(t, dim=0)))  # its slice of X and rows of A
    return {"columns_then_concatenate": (by_columns - y).abs().max().item(),
            "rows_then_sum": (by_rows - y).abs().max().item()}


def split_matmul_worker(seed: int = 0) -> dict[str, Any]:
    """Launch target: the same two splits across real ranks, with lslm's layers and their collectives.

    Every rank builds one ``nn.Linear`` from ``seed``; a :class:`ColumnParallelLinear` with
    ``gather_output`` (all-gather) and a :class:`RowParallelLinear` fed the whole input
    (it keeps its slice; all-reduce) each keep this rank's slice of its weights. Returns
    each one's largest difference from the unsplit layer and the collectives it issued.
    """
    from lslm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    ctx = init_distributed(tp=int(__import__("os").environ.get("WORLD_SIZE", "1")), seed=seed)
    with ctx:
        torch.manual_seed(seed)
        full = nn.Linear(8, 12).to(ctx.device)
        seeded = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(4, 8, generator=seeded).to(ctx.device)  # lslm: cpu-ok (seeded, then moved)
        out: dict[str, Any] = {"tp": ctx.tp_size, "rank": ctx.rank}
        with torch.no_grad():
            want = full(x)
            for name, layer in (("by_columns", ColumnParallelLinear.from_linear(full, ctx, gather_output=True,
                                                                                label="columns")),
                                ("by_rows", RowParallelLinear.from_linear(full, ctx, input_is_parallel=False,
                                                                          label="rows"))):
                ctx.comm.ledger.reset()
                got = layer(x)
                out[name] = {"weight_shape": list(layer.weight.shape), "max_error": (got - want).abs().max().item(),
                             "collectives": [r.op for r in ctx.comm.ledger.records]}
        return out


def mlp_orders(t: int = 2, seed: int = 0) -> dict[str, Any]:
    """The MLP ``GeLU(X A) B`` split column-then-row vs row-then-column over ``t`` simulated ranks.

    Column-then-row: each rank applies GeLU to its own columns of ``X A`` (exact: GeLU acts
    element by element) and its rows of B give a partial sum: **one** all-reduce at the end.
    Row-then-column: ``X A`` is a sum of partial products, and ``GeLU(a + b) != GeLU(a) + GeLU(b)``,
    so the partial sums must be all-reduced *before* GeLU, and the column-split second matmul
    leaves column slices to all-gather: **two** collectives. Returns the errors of each
    order done without its extra collective, and the collectives each needs.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g)  # lslm: cpu-ok (one process, no communication)
    a = torch.randn(8, 16, generator=g)  # lslm: cpu-ok (one process, no communication)
    b = torch.randn(16, 8, generator=g)  # lslm: cpu-ok (one process, no communication)
    ref = F.gelu(x @ a) @ b
    col_row = sum(F.gelu(x @ a_r) @ b_r for a_r, b_r in zip(a.chunk(t, dim=1), b.chunk(t, dim=0)))
    partials = [x_r @ a_r for x_r, a_r in zip(x.chunk(t, dim=1), a.chunk(t, dim=0))]
    gelu_of_partials = sum(F.gelu(p) for p in partials) @ b  # skipping the all-reduce before GeLU
    gelu_of_sum = F.gelu(sum(partials)) @ b  # with it
    return {"column_then_row_error": (col_row - ref).abs().max().item(), "column_then_row_collectives": 1,
            "row_then_column_without_reduce_error": (gelu_of_partials - ref).abs().max().item(),
            "row_then_column_with_reduce_error": (gelu_of_sum - ref).abs().max().item(),
            "row_then_column_collectives": 2}


def qkv_trap(t: int = 2, seed: int = 0) -> dict[str, float]:
    """Attention heads of one rank computed from a plain contiguous split of the fused ``[q|k|v]`` weight vs per-head
    rows (:func:`lslm.tensor_parallel.qkv.qkv_rows`), against the serial model's output for those heads.

    Returns the largest error of each way, over all ``t`` simulated ranks.
    """
    torch.manual_seed(seed)
    n_embd, n_head, T = 16, 4, 6
    c_attn = nn.Linear(n_embd, 3 * n_embd)
    x = torch.randn(1, T, n_embd)  # lslm: cpu-ok (one process, no communication)
    head_dim = n_embd // n_head

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.chunk(3, dim=-1)
        heads = q.shape[-1] // head_dim
        q, k, v = (z.view(1, T, heads, head_dim).transpose(1, 2) for z in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, T, -1)

    with torch.no_grad():
        full = attend(c_attn(x))  # (1, T, n_embd): heads in order
        worst = {"plain_split": 0.0, "per_head_rows": 0.0}
        for r in range(t):
            want = full.chunk(t, dim=-1)[r]  # this rank's heads of the serial output
            plain = attend(F.linear(x, c_attn.weight.chunk(t)[r], c_attn.bias.chunk(t)[r]))
            rows = qkv_rows(n_embd, n_head, t, r)
            right = attend(F.linear(x, c_attn.weight[rows], c_attn.bias[rows]))
            worst["plain_split"] = max(worst["plain_split"], (plain - want).abs().max().item())
            worst["per_head_rows"] = max(worst["per_head_rows"], (right - want).abs().max().item())
    return worst


def _tiny(dropout: float = 0.0) -> GPTConfig:
    return GPTConfig.tiny(dropout=dropout)


def per_layer_traffic_worker(tp: int, sequence_parallel: bool = False, async_grad_allreduce: bool = False,
                             batch: int = 4, seq: int = 32, steps: int = 3, seed: int = 0,
                             variants: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One TP training step of the tiny GPT: every ledger record (op, label, bytes, bus bytes), and with
    ``async_grad_allreduce`` the overlap summary over ``steps`` steps (the first one skipped: warm-up).
    ``variants``: several settings (e.g. ``[{"sequence_parallel": False}, {"sequence_parallel": True}]``) run one
    after the other in the same processes, returned as ``{"variants": [result, ...]}`` (one launch, not one each)."""
    ctx = init_distributed(tp=tp, seed=seed)
    with ctx:
        base = dict(sequence_parallel=sequence_parallel, async_grad_allreduce=async_grad_allreduce, batch=batch,
                    seq=seq, steps=steps, seed=seed)
        if variants is not None:
            return {"variants": [_per_layer_traffic(ctx, **{**base, **v}) for v in variants]}
        return _per_layer_traffic(ctx, **base)


def _per_layer_traffic(ctx: Any, sequence_parallel: bool, async_grad_allreduce: bool, batch: int, seq: int,
                       steps: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = apply_tensor_parallel(GPT(_tiny()).to(ctx.device), ctx, sequence_parallel=sequence_parallel,
                                  async_grad_allreduce=async_grad_allreduce)
    log = overlap_log(model)
    g = torch.Generator().manual_seed(seed)
    records: list[list[Any]] = []
    for step in range(steps):
        tok = torch.randint(0, model.tensor_parallel.vocab_size, (batch, seq + 1),
                            generator=g).to(ctx.device)  # lslm: cpu-ok (seeded, then moved)
        ctx.comm.ledger.reset()
        if step == 1:
            log.clear()
        logits, _ = model(tok[:, :-1])
        loss = vocab_parallel_cross_entropy(logits, tok[:, 1:], ctx, vocab_size=model.tensor_parallel.vocab_size)
        loss.backward()
        sync_tensor_parallel_grads(model, ctx)
        if step == 0:
            records = [[r.op, r.label, r.nbytes, r.bus_bytes] for r in ctx.comm.ledger.records]
    return {"records": records, "overlap": overlap_summary(log) if async_grad_allreduce else None,
            "n_layer": model.config.n_layer, "bsh_bytes": batch * seq * model.config.n_embd * 4}


def sp_drift_worker(tp: int = 2, steps: int = 8, sync: bool | list[bool] = True, seed: int = 0, batch: int = 4,
                    seq: int = 32) -> dict[str, Any]:
    """Train the tiny GPT with sequence parallelism, with or without the replicated-gradient sync; after every step,
    the largest difference between TP ranks' copies of a replicated parameter (LayerNorm weights, biases), the same
    number on every rank. ``sync`` a list: each setting in turn in the same processes, returned as
    ``{"by_sync": {"True": result, "False": result}}`` (one launch, not one each)."""
    ctx = init_distributed(tp=tp, seed=seed)
    with ctx:
        if isinstance(sync, list):
            return {"by_sync": {str(s): _sp_drift(ctx, steps, bool(s), seed, batch, seq) for s in sync}}
        return _sp_drift(ctx, steps, sync, seed, batch, seq)


def _sp_drift(ctx: Any, steps: int, sync: bool, seed: int, batch: int, seq: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = apply_tensor_parallel(GPT(_tiny()).to(ctx.device), ctx, sequence_parallel=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    replicated = [p for p in model.parameters() if not p.tensor_model_parallel]
    g = torch.Generator().manual_seed(seed)
    drift, losses = [], []
    for _ in range(steps):
        tok = torch.randint(0, model.tensor_parallel.vocab_size, (batch, seq + 1),
                            generator=g).to(ctx.device)  # lslm: cpu-ok (seeded, then moved)
        logits, _ = model(tok[:, :-1])
        loss = vocab_parallel_cross_entropy(logits, tok[:, 1:], ctx, vocab_size=model.tensor_parallel.vocab_size)
        opt.zero_grad()
        loss.backward()
        if sync:
            sync_tensor_parallel_grads(model, ctx)
        opt.step()
        worst = torch.zeros((), device=ctx.device)
        for p in replicated:
            first = p.detach().clone()
            ctx.comm.broadcast(first, src=ctx.group_ranks("tp")[0], group=ctx.tp_group, label="check")
            worst = torch.maximum(worst, (first - p.detach()).abs().max())
        # The largest over the TP ranks (TP rank 0 compares its copy with itself), on every rank.
        ctx.comm.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=ctx.tp_group, label="check")
        drift.append(worst.item())
        losses.append(loss.item())
    return {"drift": drift, "losses": losses, "replicated_params": sum(p.numel() for p in replicated)}


def dropout_masks_worker(tp: int = 2, seed: int = 0, n: int = 16, p: float = 0.5) -> dict[str, Any]:
    """Launch target for the notebook: this rank's dropout mask of ``n`` ones on each stream, as ``"1"/"0"``."""
    with init_distributed(tp=tp) as ctx:
        tracker = model_parallel_seed(ctx, seed)
        ones = torch.ones(n, device=ctx.device)

        def mask() -> str:
            return "".join("1" if v else "0" for v in torch.nn.functional.dropout(ones, p).ne(0).tolist())

        default = mask()
        with tracker.fork(TENSOR_PARALLEL_RNG):
            sharded = mask()
        return {"rank": ctx.rank, "dp": ctx.dp_rank, "tp": ctx.tp_rank, "default": default,
                TENSOR_PARALLEL_RNG: sharded}


def hf_gpt2_logits_worker(tp: int = 2, vocab_size: int = 50257, n_layer: int = 2, n_head: int = 4, n_embd: int = 32,
                          seq: int = 16, rows: int = 2) -> dict[str, Any]:
    """Launch target: a Hugging Face GPT-2 made tensor-parallel, without and with sequence parallelism; the
    gathered logits of each against the unsharded model's (the same seed, the same tokens)."""
    with init_distributed(tp=tp) as ctx:
        def build() -> nn.Module:
            return build_hf_gpt2(vocab_size, seq, n_layer, n_head, n_embd, seed=0).to(ctx.device)

        ref = build()
        seeded = torch.Generator().manual_seed(1)
        x = torch.randint(0, vocab_size, (rows, seq), generator=seeded).to(ctx.device)  # lslm: cpu-ok (then moved)
        out: dict[str, Any] = {"rank": ctx.rank, "tp_rank": ctx.tp_rank}
        with torch.no_grad():
            want = ref(input_ids=x).logits
            for key, sp in (("tp", False), ("sp", True)):
                model = apply_tensor_parallel(build(), ctx, sequence_parallel=sp)
                local = model(input_ids=x).logits
                full = gather_logits(local, ctx, vocab_size)
                out[key] = {"local_logits": list(local.shape), "logits": list(full.shape),
                            "max_abs_diff": (full - want).abs().max().item()}
        out["padded_vocab_size"] = model.tensor_parallel.padded_vocab_size
        out["reference_logits"] = list(want.shape)
        return out
