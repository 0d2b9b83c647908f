"""``apply_context_parallel(model, ctx, plan)``: lslm's GPT with its sequence split over the ``cp`` ranks.

From outside the model, as for tensor parallelism: every rank builds the same GPT from one
seed, then this function

* swaps each block's attention core for ring attention or Ulysses
  (:class:`ContextParallelAttention` keeps ``c_attn``/``c_proj``, so parameter names and
  ``state_dict`` keys are unchanged);
* makes the position embedding look up this rank's *global* positions (GPT's forward asks
  for ``arange(T_local)``; :class:`CPPositionEmbedding` maps local index ``i`` to the position
  of the rank's ``i``-th token in the layout);

and everything else (embeddings, LayerNorms, MLPs, the head) is per token, so it runs on the
local slice unchanged. The training step then needs two more pieces, both here:

* :func:`shard_batch` gives each rank its slice of the token ids and targets (``zigzag`` or
  ``contiguous``; lengths the layout cannot split are refused);
* :func:`context_parallel_loss`: the *global* mean cross-entropy, as a local sum divided by the
  token count of the whole ``dp × cp`` batch (one all-reduce of one number), so that summing the
  ranks' gradients gives the serial gradient even when ``-100`` targets make ranks' counts differ;
* :func:`reduce_context_parallel_grads`: one flat all-reduce (SUM) of the gradients over
  ``ctx.group("dp", "cp")``: every parameter saw only this rank's tokens.

Checked in tests/test_context_parallel.py: a few training steps at cp = 2 and at dp = 2 × cp = 2
equal the serial run (losses and parameters).
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
from lslm.models.gpt import GPT, CausalSelfAttention
from lslm.runtime.context import ParallelContext

__all__ = ["CPInfo", "CPPlan", "CPPositionEmbedding", "ContextParallelAttention", "GRAD_LABEL", "LOSS_LABEL",
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
    """What :func:`apply_context_parallel` did, kept on ``model.context_parallel``."""

    cp: int
    cp_rank: int
    plan: CPPlan


def check_context_parallel(seq_len: int, cp: int, n_head: int, plan: CPPlan) -> None:
    """Refuse, before any process starts, a sequence length or head count ``plan`` cannot split over ``cp``."""
    check_sequence(seq_len, cp, plan.layout)
    if plan.method == "ulysses":
        check_heads(n_head, cp)


class ContextParallelAttention(nn.Module):
    """:class:`~lslm.models.gpt.CausalSelfAttention` on this rank's tokens, its core swapped for ring or Ulysses.

    Holds the original's ``c_attn``, ``c_proj`` and ``resid_dropout`` (same parameter objects, same names).
    """

    def __init__(self, attn: CausalSelfAttention, group: CPGroup, plan: CPPlan) -> None:
        super().__init__()
        self.head_dim = attn.head_dim
        self.c_attn, self.c_proj, self.resid_dropout = attn.c_attn, attn.c_proj, attn.resid_dropout
        self.group, self.plan = group, plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T_local, C) -> (B, T_local, C)``: causal attention over the whole (distributed) sequence."""
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        B, T, width = q.shape
        n_head = width // self.head_dim
        q, k, v = (t.view(B, T, n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = _CORES[self.plan.method](q, k, v, self.group, causal=True, layout=self.plan.layout)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, width)))


class CPPositionEmbedding(nn.Module):
    """The position embedding (same ``weight``) looked up at this rank's global positions.

    GPT's forward passes ``arange(T_local)``; local index ``i`` is mapped to the position of the
    rank's ``i``-th token (zig-zag: two separate ranges), from ``T = T_local · cp``.
    """

    def __init__(self, wpe: nn.Embedding, cp: int, cp_rank: int, layout: str) -> None:
        super().__init__()
        self.weight = wpe.weight
        self.cp, self.cp_rank, self.layout = cp, cp_rank, layout

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        """Embeddings of the global positions of local indices ``pos``."""
        seq_len = pos.numel() * self.cp
        if seq_len > self.weight.shape[0]:
            raise ValueError(f"the whole sequence ({pos.numel()} per rank x cp = {self.cp} = {seq_len}) exceeds "
                             f"block_size = {self.weight.shape[0]}")
        positions = local_positions(seq_len, self.cp, self.cp_rank, self.layout, device=pos.device)
        return F.embedding(positions[pos], self.weight)


def apply_context_parallel(model: GPT, ctx: ParallelContext, plan: CPPlan | None = None) -> GPT:
    """Make lslm's GPT context-parallel over ``ctx.cp_group`` in place (see the module doc); returns it.

    Refused (``ValueError``): a model that is not lslm's GPT, dropout (the ring and Ulysses cores
    draw no attention dropout, and per-rank dropout masks would not match a serial run), the
    sequence-first layout of tensor parallelism's sequence parallelism, and, for Ulysses, a head
    count ``cp`` does not divide.
    """
    plan = plan or CPPlan()
    if not isinstance(model, GPT):
        raise ValueError(f"apply_context_parallel knows lslm's GPT, got {type(model).__name__}")
    if model.config.dropout:
        raise ValueError(f"dropout = {model.config.dropout}: context-parallel attention has no dropout; build the "
                         "GPT with dropout=0.0")
    if model.sequence_first:
        raise ValueError("the model runs sequence-first (tensor parallelism's sequence parallelism); context "
                         "parallelism here expects batch-first hidden states")
    if getattr(model, "context_parallel", None) is not None:
        raise ValueError("apply_context_parallel was already applied to this model")
    if plan.method == "ulysses":
        check_heads(model.config.n_head, ctx.cp_size)
    group = CPGroup.of(ctx)
    for block in model.blocks:
        block.attn = ContextParallelAttention(block.attn, group, plan)
    model.wpe = CPPositionEmbedding(model.wpe, ctx.cp_size, ctx.cp_rank, plan.layout)
    model.context_parallel = CPInfo(cp=ctx.cp_size, cp_rank=ctx.cp_rank, plan=plan)
    return model


def shard_batch(ctx: ParallelContext, layout: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This cp rank's slice of each ``(B, T)`` tensor (token ids, targets) along the sequence."""
    return tuple(shard_sequence(t, 1, ctx.cp_size, ctx.cp_rank, layout) for t in tensors)


def context_parallel_loss(logits: torch.Tensor, targets: torch.Tensor,
                          ctx: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, global_loss)``: this rank's share of the batch's mean cross-entropy, and the mean itself.

    ``loss`` (to call ``backward`` on) is the sum of this rank's token losses divided by the
    number of counted tokens (targets != -100) in the whole ``dp × cp`` batch, so the ``dp × cp``
    gradients *summed* (:func:`reduce_context_parallel_grads`) are the serial mean's gradient.
    ``global_loss`` (detached) is the serial loss, summed over ``dp × cp``. Two all-reduces of one number.
    """
    group = ctx.group("dp", "cp")
    count = (targets != -100).sum().to(torch.float32).reshape(1)
    ctx.comm.all_reduce(count, group=group, label=LOSS_LABEL)
    total = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    loss = total / count.clamp_min(1.0).squeeze(0)
    reported = loss.detach().clone().reshape(1)
    ctx.comm.all_reduce(reported, group=group, label=LOSS_LABEL)
    return loss, reported.squeeze(0)


def reduce_context_parallel_grads(model: nn.Module, ctx: ParallelContext) -> int:
    """Sum every ``.grad`` over ``ctx.group("dp", "cp")`` in one flat all-reduce; returns the elements reduced.

    A sum, not an average: :func:`context_parallel_loss` already divides by the whole batch's
    token count. Gradients kept in buffers (``main_grad``) are refused rather than left unreduced.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if any(hasattr(p, "main_grad") for p in params):
        raise ValueError("this model keeps gradients in main_grad buffers; reduce_context_parallel_grads sums .grad")
    if ctx.dp_size * ctx.cp_size == 1:
        return 0
    grads: list[Any] = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    ctx.comm.all_reduce(flat, group=ctx.group("dp", "cp"), label=GRAD_LABEL)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel()
