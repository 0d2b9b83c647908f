"""A Hugging Face Llama with grouped-query attention, tensor-parallel over more ranks than it has key/value heads.

Launch target of notebook 05 (``lslm.launch("lslm.demos.hf_llama_gqa:worker", nproc=2)``). With ``t`` ranks and
``n_kv < t`` key/value heads, :func:`lslm.tensor_parallel.hf_plans.llama_plan` gives each rank its ``n_q / t`` query
heads and the one KV head they attend with, so each KV head is replicated on ``t / n_kv`` ranks. Each of those
ranks computes only its query heads' share of that head's gradient: the shares must be summed over the ranks that
share the head (:func:`lslm.tensor_parallel.grads.sync_tensor_parallel_grads`), or the copies drift apart.

The worker builds the unsharded model and the tensor-parallel one from one seed, compares logits and loss on one
batch, then trains both a few SGD steps (the tensor-parallel loss from
:func:`~lslm.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy` on the vocabulary-sharded logits, the
serial one from ``F.cross_entropy``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lslm.models.hf import build_hf_llama
from lslm.runtime import init_distributed
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import gather_logits, vocab_parallel_cross_entropy
from lslm.tensor_parallel.grads import KV_GRAD_LABEL, sync_tensor_parallel_grads

__all__ = ["worker"]


def _batch(step: int, vocab: int, rows: int, seq: int, device: torch.device) -> torch.Tensor:
    """The same token ids on every rank and in the serial model (a fixed seed per step)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (rows, seq), generator=g).to(device)  # lslm: cpu-ok (seeded, then moved)


def _serial_loss(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, next-token loss) of the unsharded model."""
    logits = model(input_ids=x).logits
    return logits, F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def worker(tp: int = 2, num_key_value_heads: int = 1, num_attention_heads: int = 4, hidden_size: int = 32,
           intermediate_size: int = 64, n_layer: int = 2, vocab_size: int = 251, seq: int = 16, rows: int = 2,
           steps: int = 3, lr: float = 0.1, seed: int = 0) -> dict[str, Any]:
    """One rank: logits and loss against the unsharded Llama, then ``steps`` SGD steps of both (see the module doc).

    Returns this rank's shapes (its ``k_proj`` rows against the whole model's), the largest logits and loss
    differences on the first batch, the per-step losses of both runs, the key/value gradient syncs the ledger
    saw per step, and the largest difference between the ranks' copies of the replicated KV weights at the end.
    """
    if tp % num_key_value_heads:
        raise ValueError(f"this demo replicates KV heads: tp={tp} must be a multiple of "
                         f"num_key_value_heads={num_key_value_heads}")
    with init_distributed(tp=tp, seed=seed) as ctx:
        def build() -> torch.nn.Module:
            return build_hf_llama(vocab_size, seq, n_layer, num_attention_heads, hidden_size, intermediate_size,
                                  num_key_value_heads=num_key_value_heads, seed=seed).to(ctx.device)

        ref = build()
        model = apply_tensor_parallel(build(), ctx)
        attn, ref_attn = model.model.layers[0].self_attn, ref.model.layers[0].self_attn
        out: dict[str, Any] = {
            "rank": ctx.rank, "tp_rank": ctx.tp_rank,
            "q_proj_rows": [attn.q_proj.weight.shape[0], ref_attn.q_proj.weight.shape[0]],
            "k_proj_rows": [attn.k_proj.weight.shape[0], ref_attn.k_proj.weight.shape[0]],
            "head_dim": hidden_size // num_attention_heads,
            "kv_groups": [attn.num_key_value_groups, ref_attn.num_key_value_groups]}
        x = _batch(0, vocab_size, rows, seq, ctx.device)
        with torch.no_grad():
            want_logits, want_loss = _serial_loss(ref, x)
            local = model(input_ids=x).logits
            loss = vocab_parallel_cross_entropy(local[:, :-1], x[:, 1:], ctx, vocab_size=vocab_size).mean()
            full = gather_logits(local, ctx, vocab_size)
        out.update(local_logits=list(local.shape), logits=list(full.shape),
                   logits_max_abs_diff=(full - want_logits).abs().max().item(),
                   loss_abs_diff=abs(loss.item() - want_loss.item()))

        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        serial_losses, tp_losses, kv_syncs = [], [], []
        for step in range(steps):
            x = _batch(step, vocab_size, rows, seq, ctx.device)
            ref_opt.zero_grad()
            _, want = _serial_loss(ref, x)
            want.backward()
            ref_opt.step()
            serial_losses.append(want.item())
            opt.zero_grad()
            loss = vocab_parallel_cross_entropy(model(input_ids=x).logits[:, :-1], x[:, 1:], ctx,
                                                vocab_size=vocab_size).mean()
            loss.backward()
            start = len(ctx.comm.ledger.records)
            sync_tensor_parallel_grads(model, ctx)  # sums each replicated KV head's gradient over its ranks
            kv_syncs.append(sum(r.label == KV_GRAD_LABEL for r in ctx.comm.ledger.records[start:]))
            opt.step()
            tp_losses.append(loss.item())
        # The replicated KV weights after training: the t / n_kv ranks holding one head must hold the same values.
        share, drift = tp // num_key_value_heads, 0.0
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                mine = proj.weight.detach().contiguous()
                copies = [torch.empty_like(mine) for _ in range(tp)]
                ctx.comm.all_gather(copies, mine, group=ctx.tp_group, label="demo")
                drift = max(drift, max((copies[r] - copies[r // share * share]).abs().max().item()
                                       for r in range(tp)))
        out.update(serial_losses=serial_losses, tp_losses=tp_losses, kv_grad_syncs_per_step=kv_syncs,
                   kv_copies_max_abs_diff=drift)
        return out
