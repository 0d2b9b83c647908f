"""ZeRO-R's partitioned activation checkpoints: each tensor-parallel rank keeps 1/t of a block's input.

Rajbhandari et al. 2020, §6.1 (P_a). With activation checkpointing a block keeps only its
input for backward and recomputes the rest. Under tensor parallelism (without sequence
parallelism) that input is *replicated*: every rank of the TP group holds the same ``(B, T, C)``
tensor. P_a keeps only this rank's ``1/t`` slice of it (the flattened tensor cut into ``t``
equal pieces, the last padded) and all-gathers the whole input again just before the block's
recomputation in backward: ``t`` times less checkpoint memory for one all-gather per block per
step. ``offload=True`` (P_a+cpu) keeps the slice in host memory (page-locked on a GPU) instead.

Applied from outside, like every technique here: :func:`apply_partitioned_checkpoints`
``(model, ctx)`` wraps each of ``model.blocks``. The recomputation runs under the forward's autocast and
replays its random streams (the default generator, the device's on a GPU, and the tensor-parallel tracker's
streams; :mod:`lslm.runtime.replay`), so it computes the forward's activations and dropout masks and the
gradients equal those without checkpointing. Parameters' gradients are accumulated by the recomputation's
own backward (their hooks, gradient buffers included, fire there). DeepSpeed's own
``partition_activations`` needs a Megatron-style model-parallel unit; this one takes lslm's
:class:`ParallelContext`.

Constant-size buffers (ZeRO-R's C_B) are the gradient buckets of :mod:`lslm.zero` and
:mod:`lslm.data_parallel.grad_buffer`: fixed byte caps, whatever the model size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import Function

from lslm.runtime.context import ParallelContext
from lslm.runtime.replay import capture_forward_state, replaying
from lslm.tensor_parallel.random import RNGStatesTracker

__all__ = ["GATHER_LABEL", "apply_partitioned_checkpoints", "checkpoint_partitioned"]

GATHER_LABEL = "zero-r checkpoint gather"


def _tracker(pctx: ParallelContext) -> RNGStatesTracker | None:
    return getattr(pctx, "rng", None)


class _PartitionedCheckpoint(Function):
    @staticmethod
    def forward(fn: Any, run: Callable[[torch.Tensor], torch.Tensor], pctx: ParallelContext, offload: bool,
                x: torch.Tensor) -> torch.Tensor:
        fn.run, fn.pctx, fn.device, fn.shape, fn.dtype = run, pctx, x.device, x.shape, x.dtype
        fn.state = capture_forward_state(x.device, _tracker(pctx))  # autocast and random streams, for the replay
        with torch.no_grad():
            out = run(x)
        t = pctx.tp_size
        flat = x.detach().reshape(-1)
        per = -(-flat.numel() // t)
        piece = torch.zeros(per, dtype=x.dtype, device=x.device)
        mine = flat[pctx.tp_rank * per:(pctx.tp_rank + 1) * per]
        piece[:mine.numel()].copy_(mine)
        if offload:
            piece = piece.to("cpu")
            piece = piece.pin_memory() if x.device.type == "cuda" else piece
        fn.save_for_backward(piece)  # what autograd keeps of this block: 1/t of its input
        return out

    @staticmethod
    def backward(fn: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (piece,) = fn.saved_tensors
        piece = piece.to(fn.device)
        pctx = fn.pctx
        full = torch.empty(piece.numel() * pctx.tp_size, dtype=piece.dtype, device=fn.device)
        pctx.comm.all_gather_into_tensor(full, piece, group=pctx.tp_group, label=GATHER_LABEL)
        numel = 1
        for d in fn.shape:
            numel *= d
        x = full[:numel].view(fn.shape).detach().requires_grad_(True)
        with replaying(fn.state, _tracker(pctx)):  # the forward's autocast and random draws, replayed
            out = fn.run(x)
        torch.autograd.backward(out, grad)
        return None, None, None, x.grad


def checkpoint_partitioned(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, pctx: ParallelContext,
                           *, offload: bool = False) -> torch.Tensor:
    """``run(x)``, keeping for backward only this TP rank's ``1/t`` of ``x`` (host memory with ``offload``).

    ``x`` must be the same on every rank of ``pctx``'s TP group (a replicated activation: the
    residual stream without sequence parallelism); each rank's slice is all-gathered back in backward.
    """
    if not torch.is_grad_enabled() or not x.requires_grad:
        return run(x)
    return _PartitionedCheckpoint.apply(run, pctx, offload, x)


def apply_partitioned_checkpoints(model: nn.Module, ctx: ParallelContext, *, offload: bool = False) -> nn.Module:
    """Make each of ``model.blocks`` a partitioned activation checkpoint (ZeRO-R P_a); return ``model``.

    Raises ``ValueError`` under sequence parallelism (the block input is then already a slice
    of the sequence, not replicated: there is nothing more to partition) or without ``blocks``.
    """
    info = getattr(model, "tensor_parallel", None)
    if info is not None and info.sequence_parallel:
        raise ValueError("with sequence parallelism a block's input is already split over the TP ranks; partitioned "
                         "checkpoints are for the replicated input of plain tensor parallelism")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `blocks` to checkpoint")
    for block in blocks:
        inner = block.forward

        def forward(x: torch.Tensor, inner: Callable[[torch.Tensor], torch.Tensor] = inner) -> torch.Tensor:
            return checkpoint_partitioned(inner, x, ctx, offload=offload)

        block.forward = forward
    return model
