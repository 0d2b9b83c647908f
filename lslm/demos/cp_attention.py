"""Launch target of notebook 10: ring attention, zig-zag and Ulysses against full attention, at several cp in one job.

``lslm.launch("lslm.demos.cp_attention:suite", nproc=4, cp_sizes=[2, 4])`` runs, for each ``cp`` of
``cp_sizes`` (each dividing the world; the rest of the world is ``dp``, the cp groups side by side):

* :func:`attention_rows`: every (method, layout, causal) on random ``q, k, v`` against full single-process
  attention (``F.scaled_dot_product_attention`` on the whole sequence, on every rank): max |Δ| of the output
  and of ``dq``, ``dk``, ``dv``, and the bytes this rank's ledger recorded forward and backward, next to
  :func:`~lslm.context_parallel.cp_traffic`;
* :func:`training_row`: lslm's GPT trained a few SGD steps context-parallel (``dp × cp``) against the serial
  GPT on the whole batch: the largest loss and parameter differences;
* :func:`activation_bytes`: what autograd keeps for backward on this rank for one forward of the
  context-parallel GPT (``cp = 1`` included, as the baseline); :func:`activation_malloc`: the same forward
  measured by glibc's allocator.

Every rank returns its own numbers; the notebook takes the worst over ranks.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from lslm.context_parallel import (
    CPGroup,
    CPPlan,
    apply_context_parallel,
    context_parallel_loss,
    cp_traffic,
    local_positions,
    reduce_context_parallel_grads,
    ring_attention,
    shard_batch,
    ulysses_attention,
)
from lslm.metrics import ActivationMemory
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.context import ParallelContext
from lslm.runtime.startup import init_distributed

__all__ = ["CORES", "PLANS", "activation_bytes", "activation_malloc", "attention_rows", "suite", "token_batch",
           "training_row"]

CORES = {"ring": ring_attention, "ulysses": ulysses_attention}
PLANS = (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous"), ("ulysses", "zigzag"))


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def attention_rows(ctx: ParallelContext, batch: int = 2, n_head: int = 4, seq_len: int = 16,
                   head_dim: int = 8) -> list[dict[str, Any]]:
    """Each core, layout and mask on this rank's rows vs full attention: output, gradients, ledger bytes (and
    ``other_ops``: any other collective the core issued, which should be none)."""
    g, dev = CPGroup.of(ctx), ctx.device
    gen = torch.Generator().manual_seed(0)  # the same numbers on every rank and device
    q, k, v, dout = (torch.randn(batch, n_head, seq_len, head_dim,  # lslm: cpu-ok (seeded host draw, moved)
                                 generator=gen).to(dev) for _ in range(4))
    formula = cp_traffic(batch, n_head, seq_len, head_dim, g.size)
    rows = []
    for method, layout in PLANS:
        for causal in (True, False):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, is_causal=causal)
            ref.backward(dout)
            pos = local_positions(seq_len, g.size, g.index, layout, device=dev)
            mine = [t.index_select(2, pos).requires_grad_() for t in (q, k, v)]
            records = ctx.comm.ledger.records
            start = len(records)
            out = CORES[method](*mine, g, causal=causal, layout=layout)
            mid = len(records)
            out.backward(dout.index_select(2, pos))
            op = "send" if method == "ring" else "all_to_all"
            want = ("ring_forward", "ring_backward") if method == "ring" else ("ulysses_forward_ledger",
                                                                                "ulysses_backward_ledger")
            rows.append({
                "method": method, "layout": layout, "causal": causal, "cp": g.size,
                "out": _maxdiff(out, ref.index_select(2, pos)),
                **{f"d{n}": _maxdiff(m.grad, f.grad.index_select(2, pos)) for n, m, f in zip("qkv", mine, full)},
                "forward_bytes": sum(r.nbytes for r in records[start:mid] if r.op == op),
                "backward_bytes": sum(r.nbytes for r in records[mid:] if r.op == op),
                "formula_forward": formula[want[0]], "formula_backward": formula[want[1]],
                "other_ops": sorted({r.op for r in records[start:]} - {op, "recv"}),  # nothing else may travel
            })
    return rows


def token_batch(cfg: GPTConfig, batch: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch of token ids and targets, every 7th target ignored (-100), the same on every rank."""
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)  # lslm: cpu-ok (seeded host draw)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)  # lslm: cpu-ok (same)
    targets[targets % 7 == 0] = -100  # ranks count different numbers of tokens: the loss must use the global count
    return idx.to(device), targets.to(device)


def training_row(ctx: ParallelContext, plan: CPPlan, steps: int = 3, seq_len: int = 32,
                 **overrides: Any) -> dict[str, Any]:
    """The GPT trained ``steps`` SGD steps under ``dp × cp`` vs serially on the whole batch; ``overrides``: of
    :meth:`GPTConfig.tiny` (e.g. ``n_head=8, n_kv_head=2``, grouped-query attention). ``grad_diff``: the first
    step's gradients (after the dp × cp sum) against the serial ones."""
    cfg = GPTConfig.tiny(block_size=seq_len, **overrides)
    idx, targets = token_batch(cfg, 2 * ctx.dp_size, seq_len, ctx.device)
    torch.manual_seed(0)
    serial = GPT(cfg).to(ctx.device)
    model = apply_context_parallel(copy.deepcopy(serial), ctx, plan)
    opt_s, opt = torch.optim.SGD(serial.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    rows = slice(2 * ctx.dp_rank, 2 * ctx.dp_rank + 2)
    idx_l, tgt_l = shard_batch(ctx, plan.layout, idx[rows], targets[rows])
    losses, serial_losses, grad_diff = [], [], 0.0
    for step in range(steps):
        opt_s.zero_grad()
        _, loss = serial(idx, targets)
        loss.backward()
        opt_s.step()
        serial_losses.append(loss.item())
        opt.zero_grad()
        logits, _ = model(idx_l)
        loss, reported = context_parallel_loss(logits, tgt_l, ctx)
        loss.backward()
        reduce_context_parallel_grads(model, ctx)
        if step == 0:
            grad_diff = max(_maxdiff(p.grad, q.grad) for p, q in zip(serial.parameters(), model.parameters()))
        opt.step()
        losses.append(reported.item())
    ps, pm = serial.state_dict(), model.state_dict()
    return {"method": plan.method, "layout": plan.layout, "dp": ctx.dp_size, "cp": ctx.cp_size,
            "n_head": cfg.n_head, "n_kv_head": cfg.kv_heads, "grad_diff": grad_diff, "losses": losses,
            "serial_losses": serial_losses, "same_keys": list(ps) == list(pm),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, serial_losses)),
            "param_diff": max(_maxdiff(ps[name], pm[name]) for name in ps)}


def activation_bytes(ctx: ParallelContext, plan: CPPlan, seq_len: int = 64, batch: int = 2) -> int:
    """Bytes autograd keeps on this rank for one forward (and loss) of the context-parallel GPT."""
    cfg = GPTConfig.tiny(block_size=seq_len)
    idx, targets = token_batch(cfg, batch, seq_len, ctx.device)
    torch.manual_seed(0)
    model = apply_context_parallel(GPT(cfg).to(ctx.device), ctx, plan)
    idx_l, tgt_l = shard_batch(ctx, plan.layout, idx, targets)
    with ActivationMemory(model) as act:
        logits, _ = model(idx_l)
        loss, _ = context_parallel_loss(logits, tgt_l, ctx)
    loss.backward()
    return act.bytes


def activation_malloc(ctx: ParallelContext, plan: CPPlan, seq_len: int = 256,
                      batch: int = 2) -> dict[str, int | None]:
    """One forward (and loss) of the context-parallel GPT measured by glibc's allocator on this rank, beside the count.

    ``held``: the bytes the forward added and still holds when backward would start (what autograd saved, the
    logits and the loss, the graph's nodes), the step's activation peak; ``peak``: the most bytes in use above the
    start at any module's output during the forward (a sampled lower bound of the forward's peak, transients such
    as the ring's blocks in flight included); ``counted``: :class:`~lslm.metrics.ActivationMemory`'s bytes of the same
    forward; ``logits``: the bytes of the logits, which the caller holds and autograd does not save; ``tokens``: this
    rank's. Read after ``gc.collect()``; ``held`` is the largest of forwards 2 to 5 (the first allocates what is kept
    between steps), ``peak`` likewise: a reading comes out low when memory allocated before its window is released
    inside it, and under Ulysses one now and then does, by about the previous step's all-to-all buffers
    (released late, it seems, by gloo's worker threads; a cause not pinned down here).
    ``held``/``peak`` are ``None`` off glibc (:func:`~lslm.metrics.malloc.malloc_in_use_bytes`).
    """
    import gc

    from lslm.metrics.malloc import malloc_in_use_bytes

    cfg = GPTConfig.tiny(block_size=seq_len)
    idx, targets = token_batch(cfg, batch, seq_len, ctx.device)
    torch.manual_seed(0)
    model = apply_context_parallel(GPT(cfg).to(ctx.device), ctx, plan)
    idx_l, tgt_l = shard_batch(ctx, plan.layout, idx, targets)
    peak = [0]

    def sample(*_: Any) -> None:  # a forward hook returning None leaves the output alone
        peak[0] = max(peak[0], malloc_in_use_bytes() or 0)

    # Objects that exist now cannot be what this forward allocates: frozen, gc.collect() skips them (a full
    # collection of the process's heap takes the better part of a second here, one of the new objects microseconds).
    gc.freeze()
    held, peaks = [], []
    try:
        for step in range(5):
            gc.collect()
            start = malloc_in_use_bytes()
            peak[0] = 0
            hooks = [m.register_forward_hook(sample) for m in model.modules()] if step else []
            with ActivationMemory(model) as act:
                logits, _ = model(idx_l)
                loss, _ = context_parallel_loss(logits, tgt_l, ctx)
            for h in hooks:
                h.remove()
            gc.collect()
            end = malloc_in_use_bytes()
            if step and start is not None:
                held.append(end - start)
                peaks.append(max(peak[0], end) - start)
            logits_bytes = logits.untyped_storage().nbytes()
            loss.backward()
            del logits, loss
    finally:
        gc.unfreeze()
    if not held:
        return {"counted": act.bytes, "logits": logits_bytes, "tokens": idx_l.numel(), "held": None, "peak": None}
    return {"counted": act.bytes, "logits": logits_bytes, "tokens": idx_l.numel(), "held": max(held),
            "peak": max(peaks)}


def suite(cp_sizes: tuple[int, ...] | list[int] = (2, 4), memory_seq_len: int = 64,
          malloc_seq_len: int = 256) -> dict[str, Any]:
    """Every check at each cp of ``cp_sizes`` (the world split as ``dp = world / cp``); activations also at cp = 1,
    counted (``memory_seq_len`` tokens) and by the allocator (:func:`activation_malloc`, ``malloc_seq_len`` tokens);
    the GPT with grouped-query attention (8 query heads, 2 key/value heads) trained by both cores at every cp."""
    with init_distributed() as ctx:
        world = ctx.world_size
        bad = [cp for cp in cp_sizes if world % cp]
        if bad:
            raise ValueError(f"cp = {bad} does not divide the {world} processes launched")
        out: dict[str, Any] = {"rank": ctx.rank, "attention": [], "training": [], "activations": {}, "malloc": {}}
        for cp in sorted({1, *cp_sizes}):
            sub = ctx.with_grid(dp=world // cp, cp=cp)
            out["activations"][str(cp)] = {m: activation_bytes(sub, CPPlan(m, "zigzag"), memory_seq_len)
                                           for m in CORES}
            out["malloc"][str(cp)] = {m: activation_malloc(sub, CPPlan(m, "zigzag"), malloc_seq_len) for m in CORES}
            if cp == 1:
                continue
            out["attention"] += attention_rows(sub)
            out["training"] += [training_row(sub, CPPlan("ring", "zigzag")),
                                training_row(sub, CPPlan("ulysses", "contiguous"))]
            if 2 % cp == 0:  # Ulysses splits the 2 key/value heads over cp
                out["training"].append(training_row(sub, CPPlan("ulysses", "zigzag"), n_head=8, n_kv_head=2))
            out["training"].append(training_row(sub, CPPlan("ring", "zigzag"), n_head=8, n_kv_head=2))
        return out
