"""Activation recomputation, full or selective, applied to a GPT from outside (Korthikanti et al. 2022, §5).

``apply_recompute(model, mode, ctx)`` with ``mode``:

* ``"full"``: each of ``model.blocks`` keeps only its input for backward and runs its forward
  again in backward (Chen et al. 2016; Korthikanti et al. 2022, §5: ``2sbh`` bytes per layer
  in their 2-byte accounting, ``sbh/t`` elements with sequence parallelism), for one extra
  forward per block;
* ``"selective"``: only each block's attention core (``CausalSelfAttention.core_attention``:
  ``q k^T``, softmax, attention dropout, ``@ v``) is recomputed. It removes the ``5as^2b``
  term of Korthikanti's Table 2 (the only ``s^2`` tensors) at the cost of the core's flops
  (``4 s^2 b h / t`` of matmuls, plus softmax and dropout);
* ``"none"``: nothing (so a recipe can pass its option through).

Models stay plain: the blocks' ``forward`` and the attention modules' ``core_attention`` are
replaced on the instances, so a pipeline stage cut from the GPT (:class:`~lslm.pipeline.GPTStage`
shares its modules) recomputes too.

**The replay runs as the forward ran** (:mod:`lslm.runtime.replay`, shared with ZeRO-R's partitioned
checkpoints and the pipeline's ``remat``): under the forward's autocast (device type, dtype, enabled, cache),
or its matmuls run in fp32 and the gradient is not that of the function evaluated (bf16, course GPT, full:
up to 0.7 % off before; 7.5-9.6x the step time on an H200, ``bench/results/gpu/``); and from the forward's
random streams. ``torch.utils.checkpoint`` replays only the default generators; under tensor parallelism
the attention dropout draws from the tracker's per-rank stream, so its recomputation would draw other masks
and the gradients would be wrong. :func:`recompute` (Megatron's ``CheckpointFunction``) saves and restores
both. Parameters' gradients are accumulated by the recomputation's own backward (their hooks, gradient
buffers included, fire there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import Function

from lslm.runtime.replay import capture_forward_state, replaying
from lslm.tensor_parallel.random import RNGStatesTracker

__all__ = ["RECOMPUTE_MODES", "apply_recompute", "recompute"]

RECOMPUTE_MODES = ("none", "selective", "full")


class _CheckpointFunction(Function):
    @staticmethod
    def forward(fn: Any, run: Callable[..., torch.Tensor], tracker: RNGStatesTracker | None,
                *inputs: torch.Tensor) -> torch.Tensor:
        fn.run, fn.tracker = run, tracker
        fn.state = capture_forward_state(inputs[0].device, tracker)  # autocast and random streams, for the replay
        with torch.no_grad():
            out = run(*inputs)
        fn.save_for_backward(*inputs)  # all that autograd keeps of the region: its inputs
        return out

    @staticmethod
    def backward(fn: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in fn.saved_tensors]
        with replaying(fn.state, fn.tracker):  # the forward's autocast and random draws, replayed
            out = fn.run(*inputs)
        torch.autograd.backward(out, grad)
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))


def recompute(run: Callable[..., torch.Tensor], *inputs: torch.Tensor,
              tracker: RNGStatesTracker | None = None) -> torch.Tensor:
    """``run(*inputs)``, keeping only ``inputs`` for backward and running ``run`` again there.

    The replay runs under the forward's autocast, from the CPU (and CUDA) generators and every stream of
    ``tracker`` as they were in the forward, so it computes the forward's activations, dropout masks
    included. Without gradients, or when no input requires one, it is just ``run(*inputs)`` (the region's
    parameters would get no gradient through a recomputation whose inputs do not require one).
    """
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in inputs):
        return run(*inputs)
    return _CheckpointFunction.apply(run, tracker, *inputs)


def _recomputed(inner: Callable[..., torch.Tensor], tracker: RNGStatesTracker | None) -> Callable[..., torch.Tensor]:
    @functools.wraps(inner)
    def forward(*inputs: torch.Tensor) -> torch.Tensor:
        return recompute(inner, *inputs, tracker=tracker)
    return forward


def apply_recompute(model: nn.Module, mode: str, ctx: Any = None) -> nn.Module:
    """Recompute ``model``'s blocks (``"full"``) or their attention cores (``"selective"``) in backward; return it.

    ``ctx`` (a :class:`~lslm.runtime.ParallelContext`) gives the tensor-parallel random streams
    (``ctx.rng``) to replay; a tensor-parallel model needs it. Apply it after
    :func:`~lslm.tensor_parallel.apply.apply_tensor_parallel` (which sets ``ctx.rng`` up) and
    before cutting pipeline stages or wrapping for data parallelism. Applying twice raises.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `blocks` (an nn.ModuleList) to recompute")
    info = getattr(model, "tensor_parallel", None)
    if info is not None and info.tp > 1 and ctx is None:
        raise ValueError("a tensor-parallel model draws attention dropout from ctx.rng's streams: pass ctx= so that "
                         "the recomputation replays them")
    if any(getattr(b, "recompute_mode", "none") != "none" for b in blocks):
        raise ValueError("apply_recompute was already applied to this model")
    if mode == "none":
        return model
    tracker = getattr(ctx, "rng", None) if ctx is not None else None
    for block in blocks:
        if mode == "full":
            block.forward = _recomputed(block.forward, tracker)
        else:
            attn = getattr(block, "attn", None)
            if attn is None or not callable(getattr(attn, "core_attention", None)):
                raise ValueError(f"{type(block).__name__} has no attn.core_attention to recompute selectively")
            attn.core_attention = _recomputed(attn.core_attention, tracker)
        block.recompute_mode = mode
    return model
