"""Zero-bubble's split backward: the input gradient now (``I``), the weight gradients later (``W``).

A linear layer ``y = x W^T + b`` has three gradients. The next stage back waits only for
``dL/dx = dL/dy W``; the weight gradients ``dL/dW = dL/dy^T x`` and ``dL/db = sum dL/dy``
are needed only by the optimizer, at the end of the step. Zero-bubble pipelining
(Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 2) therefore splits a
stage's backward into ``I`` (compute and send the input gradient at once) and ``W``
(compute the weight gradients later, in what would otherwise be a pipeline bubble).

How it is done here, without touching the model's code: :func:`split_linears` swaps each
``nn.Linear`` of a stage for a :class:`SplitLinear` that shares its parameters (same
objects, same names: it *is* an ``nn.Linear``). Its autograd function, in backward,

* always returns the input gradient;
* inside ``store.deferring(mb)`` (an ``I``): returns no weight gradient and puts
  ``(layer, x, dL/dy)`` into the stage's :class:`WeightGradStore` under ``mb``;
  ``store.flush(mb)`` (the ``W``) computes ``dL/dW`` and ``dL/db`` from them and
  accumulates into ``.grad`` (into ``main_grad`` when a gradient buffer holds it);
* otherwise (a full ``B``): returns the weight gradients at once, computed by the
  *same* two matmul/sum ops, so ``I`` then ``W`` gives exactly ``B``'s gradients.

**Under autocast** the layer computes as ``F.linear`` does there: the input, weight and bias are cast to
autocast's dtype (bf16 / fp16) and those half copies are what the backward uses, so ``I``, ``W`` and a full
``B`` run their matmuls in the dtype the forward used, and the half weight gradients are widened to the
parameter's dtype when accumulated (what autograd's cast-back does for ``nn.Linear``). The backward does not
re-enter autocast: its op lists would change more than the matmuls (on CUDA ``sum`` is computed in fp32
there, where ``nn.Linear``'s bias gradient is summed in the half dtype), so the casts are done here, once.

Parameters of other layers (LayerNorm, embeddings) get their gradients during ``I``:
they are cheap, and the zero-bubble paper too defers only the matmul weight gradients.
The store holds each layer's input and output gradient between ``I`` and ``W``: that is
the memory zero-bubble trades for the bubble (what ``W`` needs outlives ``I``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lslm.data_parallel.grad_buffer import has_main_grad

__all__ = ["SplitLinear", "WeightGradStore", "split_linears", "unsplit_linears", "weight_grads"]


def weight_grads(x: torch.Tensor, grad_out: torch.Tensor, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dL/dW, dL/db)`` of a linear layer from its input ``x`` (..., in) and output gradient (..., out)."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
    return gw, (g2.sum(0) if has_bias else None)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs a linear layer on ``x`` in (None: autocast is off on ``x``'s device, or ``x`` is not
    a tensor autocast casts: integer or fp64)."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind) or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(kind)


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    g = g.to(p.dtype)  # a half gradient of an fp32 parameter (autocast): widened, as autograd's cast-back does
    # With a gradient buffer the gradient goes where autograd's would: into main_grad, past .grad.
    if has_main_grad(p):
        p.grad_buffer.accumulate(p, g)
        return
    # What autograd's AccumulateGrad does for a dense gradient: adopt the first, add the rest.
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


class WeightGradStore:
    """One stage's deferred weight-gradient work, per micro-batch (``I`` fills it, ``W`` empties it).

    ``deferring(mb)`` is active only around an ``I``'s ``torch.autograd.backward``; it is
    a plain attribute, not thread-local, because on CUDA autograd runs the backward on
    its own device thread while the caller waits.
    """

    def __init__(self) -> None:
        self.active_mb: int | None = None
        self._pending: dict[int, list[tuple[SplitLinear, torch.Tensor, torch.Tensor]]] = {}
        self._done: set[int] = set()

    @contextmanager
    def deferring(self, mb: int) -> Iterator[None]:
        """Inside: split linears defer their weight gradients under micro-batch ``mb`` (an ``I``)."""
        if mb in self._pending or mb in self._done:
            raise RuntimeError(f"I of micro-batch {mb} ran twice in this step (its weight gradients are "
                               f"{'still pending' if mb in self._pending else 'already computed'})")
        assert self.active_mb is None, "nested I"
        self._pending[mb] = []
        self.active_mb = mb
        try:
            yield
        finally:
            self.active_mb = None

    def defer(self, layer: SplitLinear, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        """Keep what ``layer``'s weight gradient needs, for the active micro-batch's ``W``."""
        assert self.active_mb is not None
        self._pending[self.active_mb].append((layer, x, grad_out))

    def flush(self, mb: int) -> None:
        """The ``W`` of micro-batch ``mb``: compute the deferred weight gradients, accumulate into ``.grad``."""
        if mb not in self._pending:
            raise RuntimeError(f"W of micro-batch {mb} without its I" + (" (W ran twice)" if mb in self._done else ""))
        for layer, x, grad_out in self._pending.pop(mb):
            # Outside autograd's backward grad mode is on and ``x`` (an activation) requires grad: without no_grad
            # the matmul would record a graph that saves ``grad_out``, and ``.grad`` would hold that graph (every
            # micro-batch's output gradients alive until the gradients are dropped, megabytes per stage).
            with torch.no_grad():
                gw, gb = weight_grads(x, grad_out, layer.bias is not None)
            if layer.weight.requires_grad:
                _accumulate(layer.weight, gw)
            if gb is not None and layer.bias is not None and layer.bias.requires_grad:
                _accumulate(layer.bias, gb)
        self._done.add(mb)

    def pending(self) -> list[int]:
        """Micro-batches whose ``I`` ran and whose ``W`` has not."""
        return sorted(self._pending)

    def tensors(self, mb: int) -> list[torch.Tensor]:
        """The tensors held for micro-batch ``mb``'s ``W`` (for memory accounting)."""
        return [t for _, x, g in self._pending.get(mb, []) for t in (x, g)]

    def reset(self) -> None:
        """Start a new step; raises if some ``W`` never ran (its weight gradients would be lost)."""
        if self._pending:
            raise RuntimeError(f"micro-batches {self.pending()} ran I but never W: their weight gradients are missing")
        self._done.clear()


class _SplitLinearFn(torch.autograd.Function):
    """``F.linear`` whose backward defers the weight gradients while the layer's store is deferring."""

    @staticmethod
    def forward(fn: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: SplitLinear) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is not None:  # autocast's casts, made here so the backward keeps (and uses) the half copies
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        fn.save_for_backward(x, weight)
        fn.layer = layer
        return F.linear(x, weight, bias)  # half inputs: autocast leaves them as they are

    @staticmethod
    def backward(fn: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        # x and weight are in the dtype the forward's matmul ran in, and so is grad_out (the output's gradient):
        # every matmul below runs in that dtype; autograd widens the returned gradients to the inputs' dtypes.
        x, weight = fn.saved_tensors
        layer: SplitLinear = fn.layer
        grad_x = grad_out.matmul(weight) if fn.needs_input_grad[0] else None
        if not (fn.needs_input_grad[1] or fn.needs_input_grad[2]):
            return grad_x, None, None, None
        store = layer.store
        if store is not None and store.active_mb is not None:
            store.defer(layer, x, grad_out)
            return grad_x, None, None, None
        gw, gb = weight_grads(x, grad_out, layer.bias is not None)
        return grad_x, gw if fn.needs_input_grad[1] else None, gb if fn.needs_input_grad[2] else None, None


class SplitLinear(nn.Linear):
    """An ``nn.Linear`` (sharing an existing one's parameters) whose weight gradients can be deferred."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore | None) -> None:
        nn.Module.__init__(self)  # no fresh parameters: adopt the original's below
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.store = store
        self.original = [linear]  # a list, so the original is not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b``, with the split backward."""
        return _SplitLinearFn.apply(x, self.weight, self.bias, self)


def split_linears(module: nn.Module, store: WeightGradStore) -> list[str]:
    """Replace every ``nn.Linear`` inside ``module`` by a :class:`SplitLinear` on ``store``; return their names.

    The parameters are the same objects, and the state dict keys do not change. The swap
    happens on the parent modules, so where they are shared (a
    :class:`~lslm.pipeline.partition.GPTStage` shares the GPT's blocks) the GPT uses the
    split layers too - with the store idle they give ordinary gradients.
    :func:`unsplit_linears` undoes it.
    """
    names = []
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, child_name, SplitLinear(child, store))
                names.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return names


def unsplit_linears(module: nn.Module) -> int:
    """Put back the original ``nn.Linear`` of every :class:`SplitLinear` inside ``module``; return how many."""
    count = 0
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, SplitLinear):
                setattr(parent, child_name, child.original[0])
                count += 1
    return count
