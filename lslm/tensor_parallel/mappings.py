"""The communication of tensor parallelism as autograd functions that come in conjugate pairs.

Megatron-LM (Shoeybi et al. 2019, Section 3, Figure 3) names two operators around an
MLP split column-then-row: ``f`` is the identity forward and an all-reduce backward;
``g`` is an all-reduce forward and the identity backward. Each is the other's
transpose, and every mapping here is paired the same way (forward op / backward op):

==========================================  ==========================  ============================
function                                    forward                     backward
==========================================  ==========================  ============================
:func:`copy_to_tensor_parallel_region` f    identity                    all-reduce
:func:`reduce_from_tensor_parallel_region` g all-reduce                 identity
:func:`scatter_to_tensor_parallel_region`   keep my slice (last dim)    all-gather (last dim)
:func:`gather_from_tensor_parallel_region`  all-gather (last dim)       keep my slice
:func:`scatter_to_sequence_parallel_region` keep my slice (sequence)    all-gather (sequence)
:func:`gather_from_sequence_parallel_region` all-gather (sequence)      reduce-scatter (sequence)
:func:`reduce_scatter_to_sequence_parallel_region` reduce-scatter (seq)  all-gather (sequence)
==========================================  ==========================  ============================

The sequence-parallel pair (Korthikanti et al. 2022, Section 4.2.2, Figure 5: ``g`` and
``ḡ``) replaces one all-reduce by a reduce-scatter plus an all-gather of the same total
volume, so that the LayerNorm and dropout regions between them hold ``1/t`` of the
sequence. "Sequence" is ``dim=0`` by default (:data:`SEQUENCE_DIM`): under sequence
parallelism lslm's GPT runs sequence-first, ``(T, B, C)``, as Megatron does, so each
rank's slice of the sequence is one contiguous block and neither collective copies
anything to lay it out. A batch-first ``(B, T, C)`` model (the Hugging Face plans) passes
``dim=1`` and pays one rearrangement per collective (:func:`all_gather_along`).

Every call goes through ``pctx.comm`` on ``pctx.tp_group``; the ledger label is the
caller's ``label`` plus ``" fwd"`` or ``" bwd"``, so a test can count a layer's forward
and backward traffic separately. On a tensor-parallel group of one rank every mapping
is the identity (slices are the whole tensor) and nothing is recorded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from lslm.runtime.context import ParallelContext

__all__ = [
    "all_gather_along", "copy_to_tensor_parallel_region", "fwd_label", "bwd_label",
    "gather_from_sequence_parallel_region", "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region", "reduce_scatter_along", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_parallel_region", "split_along",
]

#: The sequence dimension of sequence-parallel activations: 0, for the sequence-first ``(T, B, C)`` layout in which
#: the gathers and reduce-scatters along it copy nothing (lslm's GPT switches to it under sequence parallelism).
SEQUENCE_DIM = 0


def fwd_label(label: str) -> str:
    """The ledger label of a mapping's forward communication."""
    return f"{label} fwd"


def bwd_label(label: str) -> str:
    """The ledger label of a mapping's backward communication."""
    return f"{label} bwd"


# -- the collectives, along any dimension ------------------------------------------------------------------
def all_reduce(x: torch.Tensor, pctx: ParallelContext, label: str) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group (a new contiguous tensor; ``x`` is not modified)."""
    out = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place and needs contiguity
    pctx.comm.all_reduce(out, group=pctx.tp_group, label=label)
    return out


def split_along(x: torch.Tensor, pctx: ParallelContext, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (``tp_size`` equal slices; ValueError if not divisible)."""
    t = pctx.tp_size
    if x.shape[dim] % t:
        raise ValueError(f"dimension {dim} of a tensor of shape {tuple(x.shape)} has size {x.shape[dim]}, "
                         f"which does not split into tp={t} equal parts")
    return x.chunk(t, dim=dim)[pctx.tp_rank].contiguous()


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


def all_gather_along(x: torch.Tensor, pctx: ParallelContext, dim: int, label: str,
                     async_op: bool = False) -> tuple[torch.Tensor, Any]:
    """Concatenate every rank's ``x`` along ``dim`` in rank order; returns ``(result, work or None)``.

    ``all_gather_into_tensor`` concatenates whole buffers, rank after rank: it gathers the
    contiguous ``x`` as it is into a ``(t, *x.shape)`` buffer (no copy going in), and one
    rearrangement puts the ranks' pieces side by side along ``dim`` (no copy at all when
    ``dim`` is the leading one, or when every dimension before it has size 1). The result is
    contiguous, so the matmul that reads it copies nothing either. Sequence-first activations
    ``(T, B, C)`` (Megatron's layout, and lslm GPT's under sequence parallelism) make every
    sequence gather the copy-free case; batch-first ones ``(B, T, C)`` gathered along ``dim=1``
    pay one copy of the whole result.
    ``async_op=True`` is for ``dim`` 0 only (a rearrangement would have to wait for the data).
    """
    k = _dim(x, dim)
    src = x.contiguous()  # a no-op for the activations that arrive here
    buf = torch.empty((pctx.tp_size, *src.shape), dtype=x.dtype, device=x.device)
    if async_op and k != 0 and any(n != 1 for n in src.shape[:k]):
        raise ValueError(f"an asynchronous all-gather along dimension {k} would need a copy after the data arrives; "
                         "wait for it (async_op=False) or gather along the leading dimension")
    # Flat views: gloo checks the first dimensions (output = group size x input), not only the element counts.
    work = pctx.comm.all_gather_into_tensor(buf.view(-1), src.view(-1), group=pctx.tp_group, async_op=async_op,
                                            label=label)
    shape = (*src.shape[:k], pctx.tp_size * src.shape[k], *src.shape[k + 1:])
    # (t, ..., n_k, ...) -> (..., t, n_k, ...) -> merge t and n_k: a view when nothing of size > 1 precedes k.
    return buf.movedim(0, k).reshape(shape), work


def reduce_scatter_along(x: torch.Tensor, pctx: ParallelContext, dim: int, label: str,
                         async_op: bool = False) -> tuple[torch.Tensor, Any]:
    """Sum ``x`` over the group and keep this rank's slice along ``dim``; returns ``(result, work or None)``.

    ``reduce_scatter_tensor`` hands rank ``r`` the ``r``-th contiguous block of its input, so
    the input is laid out rank-major along ``dim`` first: one copy (none for the leading
    dimension, or when every dimension before it has size 1); the output is this rank's
    slice, already contiguous, written by the collective itself.
    """
    t = pctx.tp_size
    k = _dim(x, dim)
    if x.shape[k] % t:
        raise ValueError(f"cannot reduce-scatter dimension {k} of size {x.shape[k]} over tp={t} ranks")
    piece = (*x.shape[:k], x.shape[k] // t, *x.shape[k + 1:])
    # (..., t * n, ...) -> (..., t, n, ...) -> (t, ..., n, ...), contiguous: rank r's block is its slice.
    ranked = x.reshape(*x.shape[:k], t, *piece[k:]).movedim(k, 0).contiguous()
    out = torch.empty(piece, dtype=x.dtype, device=x.device)
    work = pctx.comm.reduce_scatter_tensor(out.view(-1), ranked.view(-1), group=pctx.tp_group, async_op=async_op,
                                           label=label)
    return out, work


# -- the autograd functions --------------------------------------------------------------------------------
class _CopyToRegion(Function):
    @staticmethod
    def forward(fn: Any, x: torch.Tensor, pctx: ParallelContext, label: str) -> torch.Tensor:
        fn.pctx, fn.label = pctx, label
        return x.view_as(x)

    @staticmethod
    def backward(fn: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return all_reduce(grad, fn.pctx, bwd_label(fn.label)), None, None


class _ReduceFromRegion(Function):
    @staticmethod
    def forward(fn: Any, x: torch.Tensor, pctx: ParallelContext, label: str) -> torch.Tensor:
        if not x.is_contiguous():
            return all_reduce(x, pctx, fwd_label(label))
        # In place, as Megatron's _reduce: the partial sum is a fresh matmul output that nothing else reads, and
        # mark_dirty tells autograd it changed (it would refuse the backward if something had saved it).
        pctx.comm.all_reduce(x, group=pctx.tp_group, label=fwd_label(label))
        fn.mark_dirty(x)
        return x

    @staticmethod
    def backward(fn: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None


class _ScatterToRegion(Function):
    @staticmethod
    def forward(fn: Any, x: torch.Tensor, pctx: ParallelContext, dim: int, label: str) -> torch.Tensor:
        fn.pctx, fn.dim, fn.label = pctx, dim, label
        return split_along(x, pctx, dim)

    @staticmethod
    def backward(fn: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return all_gather_along(grad, fn.pctx, fn.dim, bwd_label(fn.label))[0], None, None, None


class _GatherFromRegion(Function):
    @staticmethod
    def forward(fn: Any, x: torch.Tensor, pctx: ParallelContext, dim: int, label: str,
                grad_reduce_scatter: bool) -> torch.Tensor:
        fn.pctx, fn.dim, fn.label, fn.rs = pctx, dim, label, grad_reduce_scatter
        return all_gather_along(x, pctx, dim, fwd_label(label))[0]

    @staticmethod
    def backward(fn: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if fn.rs:  # every rank used the whole gathered tensor: sum their gradients, keep my slice
            out = reduce_scatter_along(grad, fn.pctx, fn.dim, bwd_label(fn.label))[0]
        else:  # every rank holds the same gradient of the gathered tensor: my slice is mine
            out = split_along(grad, fn.pctx, fn.dim)
        return out, None, None, None, None


class _ReduceScatterToRegion(Function):
    @staticmethod
    def forward(fn: Any, x: torch.Tensor, pctx: ParallelContext, dim: int, label: str) -> torch.Tensor:
        fn.pctx, fn.dim, fn.label = pctx, dim, label
        return reduce_scatter_along(x, pctx, dim, fwd_label(label))[0]

    @staticmethod
    def backward(fn: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return all_gather_along(grad, fn.pctx, fn.dim, bwd_label(fn.label))[0], None, None, None


def _alone(pctx: ParallelContext) -> bool:
    return pctx.tp_size == 1


def copy_to_tensor_parallel_region(x: torch.Tensor, pctx: ParallelContext, label: str = "tp") -> torch.Tensor:
    """Megatron's ``f``: identity forward; all-reduce of the gradient backward (the input fed every rank's shard)."""
    return x if _alone(pctx) else _CopyToRegion.apply(x, pctx, label)


def reduce_from_tensor_parallel_region(x: torch.Tensor, pctx: ParallelContext, label: str = "tp") -> torch.Tensor:
    """Megatron's ``g``: all-reduce forward (sum the partial outputs, in place); identity backward.

    ``x`` (a contiguous partial result) is summed in place and returned: do not read it afterwards
    expecting this rank's part.
    """
    return x if _alone(pctx) else _ReduceFromRegion.apply(x, pctx, label)


def scatter_to_tensor_parallel_region(x: torch.Tensor, pctx: ParallelContext, label: str = "tp") -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""
    return x if _alone(pctx) else _ScatterToRegion.apply(x, pctx, -1, label)


def gather_from_tensor_parallel_region(x: torch.Tensor, pctx: ParallelContext, label: str = "tp") -> torch.Tensor:
    """All-gather the last dimension forward; keep this rank's slice of the gradient backward."""
    return x if _alone(pctx) else _GatherFromRegion.apply(x, pctx, -1, label, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, pctx: ParallelContext, label: str = "sp",
                                        dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Keep this rank's slice of the sequence forward; all-gather the gradient backward."""
    return x if _alone(pctx) else _ScatterToRegion.apply(x, pctx, dim, label)


def gather_from_sequence_parallel_region(x: torch.Tensor, pctx: ParallelContext, label: str = "sp",
                                         dim: int = SEQUENCE_DIM, grad_reduce_scatter: bool = True) -> torch.Tensor:
    """All-gather the sequence forward (Korthikanti's ``g``); reduce-scatter the gradient backward.

    ``grad_reduce_scatter=False`` keeps only this rank's slice of the gradient instead, for a
    gathered tensor whose gradient is already identical on every rank.
    """
    return x if _alone(pctx) else _GatherFromRegion.apply(x, pctx, dim, label, grad_reduce_scatter)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, pctx: ParallelContext, label: str = "sp",
                                               dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Reduce-scatter along the sequence forward (Korthikanti's ``ḡ``); all-gather the gradient backward."""
    return x if _alone(pctx) else _ReduceScatterToRegion.apply(x, pctx, dim, label)
