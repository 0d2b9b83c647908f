"""``apply_context_parallel(model, ctx, plan)``: lslm's GPT with its sequence split over the ``cp`` ranks.

From outside the model, as for tensor parallelism: every rank builds the same GPT from one
seed, then this function

* swaps each block's attention core for ring attention or Ulysses
  (:class:`ContextParallelAttention` keeps ``c_attn``/``c_proj``, so parameter names and
  ``state_dict`` keys are unchanged);
* makes the position embedding look up this rank's *global* positions (GPT's forward asks
  for ``arange(T_local)``; a forward pre-hook, :class:`CPPositions`, maps local index ``i`` to
  the position of the rank's ``i``-th token in the layout, and ``wpe`` stays an ``nn.Embedding``);

and everything else (embeddings, LayerNorms, MLPs, the head) is per token, so it runs on the
local slice unchanged. The training step then needs two more pieces, both here:

* :func:`shard_batch` gives each rank its slice of the token ids and targets (``zigzag`` or
  ``contiguous``; lengths the layout cannot split are refused);
* :func:`context_parallel_loss`: the *global* mean cross-entropy, as a local sum divided by the
  token count of the whole ``dp × cp`` batch (one all-reduce of one number), so that summing the
  ranks' gradients gives the serial gradient even when ``-100`` targets make ranks' counts differ;
* :func:`reduce_context_parallel_grads`: the gradients summed over ``ctx.group("dp", "cp")``
  (every parameter saw only this rank's tokens): one all-reduce per bucket of the model's
  gradient buffers (:func:`lslm.data_parallel.grad_sync.attach_grad_buffers`), in place, or one
  flat all-reduce of the ``.grad`` tensors when the model has no buffers.

**With tensor parallelism** (Megatron-LM's CP × TP): call
:func:`~lslm.tensor_parallel.apply.apply_tensor_parallel` first, then this. Each tp rank holds
``n_head / tp`` heads (``c_attn`` is column-parallel) and ``cp`` ranks of the same tp coordinate
form a ring, so ring attention and Ulysses run inside each tp rank's heads (Ulysses then needs
``n_head / tp`` divisible by ``cp``). The head gives a vocabulary slice, so the loss is the
vocabulary-parallel cross-entropy (``context_parallel_loss(..., vocab_size=V)``). With sequence
parallelism too, the sequence is split twice: over ``cp`` by the layout, then each cp rank's
``T / cp`` tokens contiguously over ``tp`` (the residual stream, ``(T / (cp·tp), B, C)``
sequence-first); ``c_attn``'s all-gather over tp gives attention this cp rank's ``T / cp``
tokens, and the sequence-parallel parameters' gradients are summed over tp before the dp × cp
sum (:func:`reduce_context_parallel_grads` does both).

Checked in tests/test_context_parallel.py (cp = 2 and 4, dp = 2 × cp = 2) and
tests/test_cp_compose.py (tp = 2 × cp = 2 with and without sequence parallelism, ring and
Ulysses; dp = 2 × cp = 2 on gradient buffers): a few training steps equal the serial run
(losses and parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lslm.context_parallel.group import CPGroup
from lslm.context_parallel.layout import LAYOUTS, check_sequence, local_positions, shard_sequence
from lslm.context_parallel.ring import ring_attention
from lslm.context_parallel.ulysses import check_heads, ulysses_attention
from lslm.data_parallel.grad_sync import reduce_buffers, split_by_holder
from lslm.models.gpt import GPT, CausalSelfAttention, split_qkv
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.cross_entropy import vocab_parallel_token_losses
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

__all__ = ["CPInfo", "CPPlan", "CPPositions", "ContextParallelAttention", "GRAD_LABEL", "LOSS_LABEL",
           "METHODS", "apply_context_parallel", "check_context_parallel", "context_parallel_loss",
           "reduce_context_parallel_grads", "shard_batch"]

METHODS = ("ring", "ulysses")
GRAD_LABEL = "cp-grads"
LOSS_LABEL = "cp-loss"
_CORES = {"ring": ring_attention, "ulysses": ulysses_attention}


@dataclass(frozen=True)
class CPPlan:
    """How to split: ``method`` (``"ring"`` or ``"ulysses"``) and ``layout`` (``"zigzag"`` or ``"contiguous"``)."""

    method: str = "ring"
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"CPPlan.method must be one of {METHODS}, got {self.method!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"CPPlan.layout must be one of {LAYOUTS}, got {self.layout!r}")


@dataclass(frozen=True)
class CPInfo:
    """What :func:`apply_context_parallel` did, kept on ``model.context_parallel`` (``tp``: the heads' split)."""

    cp: int
    cp_rank: int
    plan: CPPlan
    tp: int = 1
    sequence_parallel: bool = False


def check_context_parallel(seq_len: int, cp: int, n_head: int, plan: CPPlan, *, tp: int = 1,
                           sequence_parallel: bool = False, kv_heads: int | None = None) -> None:
    """Refuse, before any process starts, a sequence length or head count ``plan`` cannot split over ``cp``.

    With tensor parallelism (``tp``) each rank holds ``n_head / tp`` heads, which Ulysses splits
    again over ``cp``; with sequence parallelism each cp rank's ``seq_len / cp`` tokens are split
    over ``tp``. ``kv_heads``: key/value heads with grouped-query attention (Ulysses splits them over ``cp`` too).
    """
    check_sequence(seq_len, cp, plan.layout)
    if n_head % tp:
        raise ValueError(f"n_head = {n_head} heads do not split over tp = {tp}; choose tp dividing {n_head}")
    if plan.method == "ulysses":
        _check_ulysses_heads(n_head, tp, cp, kv_heads)
    if sequence_parallel and (seq_len // cp) % tp:
        raise ValueError(f"sequence parallelism splits each cp rank's {seq_len // cp} tokens (sequence {seq_len} / "
                         f"cp = {cp}) over tp = {tp}: choose a length divisible by cp·tp = {cp * tp}")


def _check_ulysses_heads(n_head: int, tp: int, cp: int, kv_heads: int | None = None) -> None:
    if tp == 1:
        check_heads(n_head, cp, kv_heads)
    elif (n_head // tp) % cp:
        raise ValueError(f"Ulysses splits each tensor-parallel rank's heads over the cp ranks: n_head / tp = "
                         f"{n_head} / {tp} = {n_head // tp} is not divisible by cp = {cp}; choose tp·cp dividing "
                         f"{n_head}, or ring attention (no such constraint)")


class ContextParallelAttention(nn.Module):
    """:class:`~lslm.models.gpt.CausalSelfAttention` on this rank's tokens, its core swapped for ring or Ulysses.

    Holds the original's ``c_attn``, ``c_proj`` and ``resid_dropout`` (same parameter objects, same names),
    and its layout (``sequence_first`` under tensor parallelism's sequence parallelism). The heads are
    read from ``c_attn``'s output, so under tensor parallelism the core runs on this tp rank's heads.
    """

    def __init__(self, attn: CausalSelfAttention, group: CPGroup, plan: CPPlan) -> None:
        super().__init__()
        self.head_dim, self.group_size = attn.head_dim, attn.group_size
        self.c_attn, self.c_proj, self.resid_dropout = attn.c_attn, attn.c_proj, attn.resid_dropout
        self.group, self.plan = group, plan
        self.sequence_first = attn.sequence_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T_local, C) -> (B, T_local, C)`` (``(T_local, B, C)`` sequence-first): causal attention over the
        whole (distributed) sequence."""
        # under SP, c_attn all-gathers this cp rank's tokens over tp
        q, k, v = split_qkv(self.c_attn(x), self.group_size)
        if self.sequence_first:
            T, B, width = q.shape  # width: the query heads' (k and v have group_size times fewer with GQA)
            q, k, v = (t.view(T, B, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        else:
            B, T, width = q.shape
            q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = _CORES[self.plan.method](q, k, v, self.group, causal=True, layout=self.plan.layout)
        y = y.permute(2, 0, 1, 3).reshape(T, B, width) if self.sequence_first else y.transpose(1, 2).reshape(B, T,
                                                                                                            width)
        return self.resid_dropout(self.c_proj(y))


class CPPositions:
    """A forward pre-hook on ``wpe``: GPT's local indices ``arange(T_local)`` -> this rank's global positions.

    Local index ``i`` becomes the position of the rank's ``i``-th token in the layout (zig-zag:
    two separate ranges), from ``T = T_local · cp``. A hook rather than a new module, so ``wpe``
    keeps its class, its name and any hook tensor parallelism put on it (sequence parallelism
    slices the looked-up rows over tp after the lookup).
    """

    def __init__(self, cp: int, cp_rank: int, layout: str, block_size: int) -> None:
        self.cp, self.cp_rank, self.layout, self.block_size = cp, cp_rank, layout, block_size

    def __call__(self, _module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The hook: replace the positions argument by the global positions it stands for."""
        pos = args[0]
        seq_len = pos.numel() * self.cp
        if seq_len > self.block_size:
            raise ValueError(f"the whole sequence ({pos.numel()} per rank x cp = {self.cp} = {seq_len}) exceeds "
                             f"block_size = {self.block_size}")
        positions = local_positions(seq_len, self.cp, self.cp_rank, self.layout, device=pos.device)
        return (positions[pos], *args[1:])


def apply_context_parallel(model: GPT, ctx: ParallelContext, plan: CPPlan | None = None) -> GPT:
    """Make lslm's GPT context-parallel over ``ctx.cp_group`` in place (see the module doc); returns it.

    A tensor-parallel GPT (:func:`~lslm.tensor_parallel.apply.apply_tensor_parallel` called first,
    with or without sequence parallelism) runs the core on its tp rank's heads. Refused
    (``ValueError``): a model that is not lslm's GPT, dropout (the ring and Ulysses cores draw no
    attention dropout, and per-rank dropout masks would not match a serial run), a sequence-first
    model that is not tensor parallelism's sequence-parallel one, a second application, and, for
    Ulysses, a head count (per tp rank) ``cp`` does not divide.
    """
    plan = plan or CPPlan()
    if not isinstance(model, GPT):
        raise ValueError(f"apply_context_parallel knows lslm's GPT, got {type(model).__name__}")
    if model.config.dropout:
        raise ValueError(f"dropout = {model.config.dropout}: context-parallel attention has no dropout; build the "
                         "GPT with dropout=0.0")
    if getattr(model, "context_parallel", None) is not None:
        raise ValueError("apply_context_parallel was already applied to this model")
    tp_info = getattr(model, "tensor_parallel", None)
    tp = tp_info.tp if tp_info is not None else 1
    sp = bool(tp_info is not None and tp_info.sequence_parallel and tp > 1)
    if tp_info is not None and tp != ctx.tp_size:
        raise ValueError(f"the model was made tensor-parallel over tp = {tp} but ctx has tp = {ctx.tp_size}")
    if model.sequence_first and not sp:
        raise ValueError("the model runs sequence-first without tensor parallelism's sequence parallelism; "
                         "context parallelism expects batch-first hidden states or apply_tensor_parallel's "
                         "sequence-parallel layout")
    n_head = model.config.n_head
    if n_head % tp:
        raise ValueError(f"n_head = {n_head} heads do not split over tp = {tp}")
    if plan.method == "ulysses":
        _check_ulysses_heads(n_head, tp, ctx.cp_size, model.config.kv_heads)
    group = CPGroup.of(ctx)
    for block in model.blocks:
        block.attn = ContextParallelAttention(block.attn, group, plan)
    model.wpe.register_forward_pre_hook(CPPositions(ctx.cp_size, ctx.cp_rank, plan.layout, model.config.block_size))
    model.context_parallel = CPInfo(cp=ctx.cp_size, cp_rank=ctx.cp_rank, plan=plan, tp=tp, sequence_parallel=sp)
    return model


def shard_batch(ctx: ParallelContext, layout: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This cp rank's slice of each ``(B, T)`` tensor (token ids, targets) along the sequence."""
    return tuple(shard_sequence(t, 1, ctx.cp_size, ctx.cp_rank, layout) for t in tensors)


def context_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, ctx: ParallelContext, *,
                          vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, global_loss)``: this rank's share of the batch's mean cross-entropy, and the mean itself.

    ``loss`` (to call ``backward`` on) is the sum of this rank's token losses divided by the
    number of counted tokens (targets != -100) in the whole ``dp × cp`` batch, so the ``dp × cp``
    gradients *summed* (:func:`reduce_context_parallel_grads`) are the serial mean's gradient.
    ``global_loss`` (detached) is the serial loss, summed over ``dp × cp``. Two all-reduces of one number.

    ``vocab_size``: pass the true vocabulary when ``logits`` are this tp rank's vocabulary slice
    (a tensor-parallel head): the token losses are then the vocabulary-parallel cross-entropy
    (:func:`~lslm.tensor_parallel.cross_entropy.vocab_parallel_token_losses`, the same on every tp rank).
    """
    group = ctx.group("dp", "cp")
    count = (targets != -100).sum().to(torch.float32).reshape(1)
    ctx.comm.all_reduce(count, group=group, label=LOSS_LABEL)
    if vocab_size is None:
        total = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    else:
        total = vocab_parallel_token_losses(logits.float(), targets, ctx, vocab_size=vocab_size).sum()
    loss = total / count.clamp_min(1.0).squeeze(0)
    reported = loss.detach().clone().reshape(1)
    ctx.comm.all_reduce(reported, group=group, label=LOSS_LABEL)
    return loss, reported.squeeze(0)


def reduce_context_parallel_grads(model: nn.Module, ctx: ParallelContext) -> int:
    """Sum every gradient over ``ctx.group("dp", "cp")``; returns the elements all-reduced over it.

    A sum, not an average: :func:`context_parallel_loss` already divides by the whole batch's
    token count. Gradients in buffers (``main_grad``, :func:`~lslm.data_parallel.grad_sync.attach_grad_buffers`)
    are reduced in place, one all-reduce per bucket; otherwise the ``.grad`` tensors go in one
    flat all-reduce. A tensor-parallel model's own fix-ups run first
    (:func:`~lslm.tensor_parallel.grads.sync_tensor_parallel_grads`: under sequence parallelism
    the replicated parameters' partial gradients summed over tp); the two sums commute.
    """
    if getattr(model, "tensor_parallel", None) is not None:
        sync_tensor_parallel_grads(model, ctx)
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    if any(getattr(p, "expert_parallel", False) for p in params):
        raise ValueError("an expert-parallel MoE under context parallelism is not composed here: its experts differ "
                         "over dp (= ep) and would be summed with other ranks' experts; use cp = 1 for the MoE")
    buffers, plain = split_by_holder(params)
    if buffers and plain:
        raise ValueError(f"{len(plain)} parameters hold .grad while the others have gradient buffers: attach "
                         "buffers to the whole model")
    if ctx.dp_size * ctx.cp_size == 1:
        return 0
    group = ctx.group("dp", "cp")
    if buffers:
        reduce_buffers(buffers, ctx, group, label=GRAD_LABEL)
        return sum(b.numel for b in buffers)
    grads: list[Any] = [p.grad for p in plain if p.grad is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    ctx.comm.all_reduce(flat, group=group, label=GRAD_LABEL)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel()
