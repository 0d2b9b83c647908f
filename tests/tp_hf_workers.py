"""Workers for tests/test_tp_hf.py: Hugging Face GPT-2 and Llama made tensor-parallel (and sequence-parallel)
by :mod:`lslm.tensor_parallel.hf_plans`, against the unsharded model built from the same seed."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lslm.data_parallel.grad_sync import attach_grad_buffers
from lslm.models.hf import build_hf_gpt2, build_hf_llama
from lslm.precision import prepare_precision
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import gather_logits, vocab_parallel_cross_entropy
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

SEED, STEPS, ROWS, T, N_LAYER = 7, 3, 2, 16, 2
GPT2_VOCAB, LLAMA_VOCAB = 50257, 251  # both odd: padded at every tp > 1

#: case name -> (model, builder kwargs, sequence_parallel, sync the gradients)
CASES: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "gpt2": ("gpt2", {}, False, True),
    "gpt2_sp": ("gpt2", {}, True, True),
    "gpt2_tied_sp": ("gpt2", {"tie_word_embeddings": True}, True, True),
    "llama_kv2": ("llama", {"num_key_value_heads": 2}, False, True),
    "llama_kv2_sp": ("llama", {"num_key_value_heads": 2}, True, True),
    "llama_kv1": ("llama", {"num_key_value_heads": 1}, False, True),
    # eager attention: the explicit causal mask (built for the whole sequence) and repeat_kv by the fixed-up groups
    "llama_kv1_eager_sp": ("llama", {"num_key_value_heads": 1, "attn_implementation": "eager"}, True, True),
    "llama_kv1_no_sync": ("llama", {"num_key_value_heads": 1}, False, False),
    # the gradients in buffers (the API default of lslm's optimizers): the kv-heads buffer has a slot per head
    "llama_kv1_buffered": ("llama", {"num_key_value_heads": 1}, False, True),
    "llama_kv2_buffered_sp": ("llama", {"num_key_value_heads": 2}, True, True),
}
#: cases trained with gradient buffers (attach_grad_buffers, then the optimizer on main_grad)
BUFFERED = {"llama_kv1_buffered", "llama_kv2_buffered_sp"}


def build(model: str, **kw: Any) -> nn.Module:
    """The tiny model of a case, from the fixed seed (the same weights on every rank and in the reference)."""
    if model == "gpt2":
        return build_hf_gpt2(GPT2_VOCAB, T, N_LAYER, 4, 32, seed=SEED, **kw)
    return build_hf_llama(LLAMA_VOCAB, T, N_LAYER, 4, 32, 64, seed=SEED, **kw)


def vocab_of(model: str) -> int:
    """The true vocabulary of a case's model."""
    return GPT2_VOCAB if model == "gpt2" else LLAMA_VOCAB


def batch(step: int, vocab: int) -> torch.Tensor:
    """Token ids ``(ROWS, T)`` for a step, the same on every rank."""
    return torch.randint(0, vocab, (ROWS, T), generator=torch.Generator().manual_seed(100 + step))


def shifted_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Next-token loss of full logits: position i predicts token i + 1 (what HF computes from ``labels=x``)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


@functools.cache
def _serial(model: str, kw_items: tuple[tuple[str, Any], ...], device: str) -> tuple[list[float], float, nn.Module]:
    net = build(model, **dict(kw_items)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses, hf_gap = [], 0.0
    for step in range(STEPS):
        x = batch(step, vocab_of(model)).to(device)
        out = net(input_ids=x, labels=x)
        loss = shifted_loss(out.logits, x)
        hf_gap = max(hf_gap, abs(loss.item() - out.loss.item()))  # our shift is HF's
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, hf_gap, net


def _ops(ctx: ParallelContext, start: int, end: int) -> dict[str, int]:
    return dict(Counter(rec.op for rec in ctx.comm.ledger.records[start:end]))


def _drift(model: nn.Module, ctx: ParallelContext) -> float:
    # Replicated parameters (not tensor-parallel) must stay bitwise identical on every TP rank.
    worst = 0.0
    for p in model.parameters():
        if not getattr(p, "tensor_model_parallel", False):
            other = p.detach().clone()
            ctx.comm.broadcast(other, src=ctx.group_ranks("tp")[0], group=ctx.tp_group, label="test")
            worst = max(worst, (other - p.detach()).abs().max().item())
    return worst


def run_case(ctx: ParallelContext, name: str) -> dict[str, Any]:
    """Train one case tensor-parallel next to its serial reference; losses, logits diff, op counts, drift."""
    model_name, kw, sp, sync = CASES[name]
    vocab = vocab_of(model_name)
    ref_losses, hf_gap, ref = _serial(model_name, tuple(sorted(kw.items())), str(ctx.device))
    model = apply_tensor_parallel(build(model_name, **kw).to(ctx.device), ctx, sequence_parallel=sp)
    if name in BUFFERED:  # after apply_tensor_parallel marked the parameters: one buffer per kind of reduction
        kinds = sorted(b.kind for b in attach_grad_buffers(model, ctx))
        assert kinds == (["dp", "kv-heads", "sp"] if sp else ["dp", "kv-heads"]), kinds
        opt = prepare_precision(model, "fp32", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)).optimizer
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, fwd_ops, bwd_ops = [], {}, {}
    for step in range(STEPS):
        x = batch(step, vocab).to(ctx.device)
        start = len(ctx.comm.ledger.records)
        logits = model(input_ids=x).logits
        loss = vocab_parallel_cross_entropy(logits[:, :-1], x[:, 1:], ctx, vocab_size=vocab)
        mid = len(ctx.comm.ledger.records)
        opt.zero_grad()
        loss.backward()
        if step == 0:  # the forward's collectives (the loss's two included) and the backward's
            fwd_ops, bwd_ops = _ops(ctx, start, mid), _ops(ctx, mid, len(ctx.comm.ledger.records))
        if sync:
            sync_tensor_parallel_grads(model, ctx)
        opt.step()
        losses.append(loss.item())
    x = batch(99, vocab).to(ctx.device)
    with torch.no_grad():
        full = gather_logits(model(input_ids=x).logits, ctx, vocab)
        want = ref(input_ids=x).logits
    return {"losses": losses, "ref_losses": ref_losses, "hf_loss_gap": hf_gap,
            "logits_diff": (full - want).abs().max().item(), "drift": _drift(model, ctx),
            "fwd_ops": fwd_ops, "bwd_ops": bwd_ops, "padded_vocab": model.tensor_parallel.padded_vocab_size,
            "local_vocab": model.lm_head.weight.shape[0],
            "tied": model.lm_head.weight is model.get_input_embeddings().weight}


def suite(tp: int, cases: list[str]) -> dict[str, Any]:
    """Every case in one launch (launches dominate the time)."""
    with init_distributed(tp=tp) as ctx:
        return {"rank": ctx.rank, "cases": {name: run_case(ctx, name) for name in cases}}
