"""A model's parameters grouped into gradient buffers by the reduction they need, and those reductions.

A parameter's gradient needs, after backward:

* ``"dp"``: the mean over the data-parallel group (every parameter of a replica);
* ``"sp"``: first the sum over the tensor-parallel group, because under sequence
  parallelism a replicated parameter (LayerNorm, row-parallel bias) saw only this rank's
  slice of the sequence (Korthikanti et al. 2022, §4.2.2), then the dp mean;
* ``"kv-heads"``: a key/value head replicated on ``t / n_kv`` TP ranks (grouped-query
  attention with fewer heads than ranks) needs the sum over exactly the ranks sharing it,
  then the dp mean. Its buffer gives every parameter ``n_kv`` slots and each rank writes its
  head's slot, so one all-reduce over the whole TP group sums each head's slot over its
  sharers (the other ranks add zeros there);
* ``"ep"``: an expert of an expert-parallel MoE, held by one rank of the ep (= dp) group
  (:mod:`lslm.expert_parallel`): its gradient arrives already summed over every rank's tokens
  (the all-to-all's backward brings it), so it needs no collective, only the division by ep.
  Averaging it over dp like the others would add up *different* experts' gradients (each
  rank's buffer holds its own experts), hence a buffer of its own.

:func:`attach_grad_buffers` builds one :class:`~lslm.data_parallel.grad_buffer.GradBuffer`
per (kind, device, dtype) present and attaches them (``main_grad`` on every parameter).
:func:`reduce_buffers` runs one all-reduce per bucket, in place; nothing is concatenated or
copied back. The TP syncs and the dp average of :mod:`lslm.tensor_parallel` and the pipeline
executor call it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from lslm.data_parallel.buckets import cap_bytes
from lslm.data_parallel.grad_buffer import GradBuffer, buffers_of, has_main_grad
from lslm.runtime.context import ParallelContext

__all__ = ["GRAD_DTYPES", "KINDS", "attach_grad_buffers", "detach_grad_buffers", "finish_reductions", "grad_kind",
           "reduce_buffers", "resolve_grad_dtype", "split_by_holder", "zero_grad_buffers"]

KINDS = ("dp", "sp", "kv-heads", "ep")
#: ``--grad-reduce-dtype`` choices: fp32 buffers (Megatron's default for bf16), or the parameters' own dtype.
GRAD_DTYPES = ("fp32", "param")


def resolve_grad_dtype(choice: str, param_dtype: torch.dtype) -> torch.dtype:
    """The buffer dtype for a ``--grad-reduce-dtype`` choice (:data:`GRAD_DTYPES`) and the model's dtype."""
    if choice not in GRAD_DTYPES:
        raise ValueError(f"unknown gradient reduction dtype {choice!r}; expected one of {GRAD_DTYPES}")
    return torch.float32 if choice == "fp32" else param_dtype


def grad_kind(param: torch.Tensor) -> str:
    """Which reduction ``param``'s gradient needs (:data:`KINDS`), from the marks tensor and expert parallelism set."""
    if getattr(param, "replicated_heads", None):
        return "kv-heads"
    if getattr(param, "expert_parallel", False):
        return "ep"
    if getattr(param, "sequence_parallel", False):
        return "sp"
    return "dp"


def _unique_params(model: nn.Module | Iterable[torch.Tensor]) -> list[tuple[str, nn.Parameter]]:
    named = model.named_parameters() if isinstance(model, nn.Module) else ((f"param {i}", p)
                                                                          for i, p in enumerate(model))
    seen: set[int] = set()
    out = []
    for n, p in named:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def attach_grad_buffers(model: nn.Module | Iterable[torch.Tensor], ctx: ParallelContext | None = None, *,
                        dtype: torch.dtype = torch.float32, bucket_cap_mb: float | None = None,
                        pad_to: int = 1, one_kind: str | None = None) -> list[GradBuffer]:
    """Give every trainable parameter of ``model`` a ``main_grad`` in a buffer of its kind; return the buffers.

    Call it after tensor parallelism marked the parameters (``apply_tensor_parallel``) and
    before the optimizer is built (:func:`lslm.precision.prepare_precision` then uses these
    buffers). ``ctx`` is needed only for replicated key/value heads (which slot is this
    rank's). ``dtype``: the gradient (and reduction) dtype. ``bucket_cap_mb``: ``None`` for one
    bucket per buffer. ``pad_to``: see :class:`GradBuffer`. ``one_kind``: one buffer of that kind
    for every parameter whatever its marks (ZeRO's single flat layout); a sequence-parallel
    parameter's tp sum then runs on its ``main_grad`` view (:mod:`lslm.tensor_parallel.grads`).
    Replicated key/value heads (their slots) and experts (no dp average) refuse it.
    """
    named = _unique_params(model)
    if not named:
        raise ValueError("no parameter requires grad: nothing to hold gradients for")
    cap = None if bucket_cap_mb is None else cap_bytes(bucket_cap_mb)
    groups: dict[tuple[str, torch.device], list[tuple[str, nn.Parameter]]] = {}
    if one_kind is not None:
        if one_kind not in ("dp", "sp"):
            raise ValueError(f"one_kind must be 'dp' or 'sp', got {one_kind!r}")
        heads = [n for n, p in named if grad_kind(p) == "kv-heads"]
        if heads:
            raise ValueError(f"{heads[0]!r} is a replicated key/value head, which needs a slot per head in a buffer "
                             "of its own: one_kind cannot hold it")
        experts = [n for n, p in named if grad_kind(p) == "ep"]
        if experts:
            raise ValueError(f"{experts[0]!r} is an expert of an expert-parallel MoE, whose gradient is not averaged "
                             "over dp like the others: one_kind cannot hold it")
    for n, p in named:
        groups.setdefault((one_kind or grad_kind(p), p.device), []).append((n, p))
    buffers = []
    for (kind, _), members in groups.items():
        slots: dict[int, tuple[int, int]] = {}
        if kind == "kv-heads":
            if ctx is None:
                raise ValueError("replicated key/value heads need ctx (which head slot is this rank's)")
            for i, (_, p) in enumerate(members):
                heads, t = p.replicated_heads
                slots[i] = (heads, ctx.tp_rank * heads // t)
        buf = GradBuffer([p for _, p in members], dtype=dtype, bucket_cap_bytes=cap, pad_to=pad_to, slots=slots,
                         kind=kind, names=[n for n, _ in members])
        buffers.append(buf.attach())
    return buffers


def detach_grad_buffers(model: nn.Module | Iterable[torch.Tensor]) -> int:
    """Detach every buffer holding ``model``'s gradients; return how many."""
    buffers = buffers_of(p for _, p in _unique_params(model))
    for buf in buffers:
        buf.detach()
    return len(buffers)


def zero_grad_buffers(params: Iterable[torch.Tensor]) -> None:
    """Zero the buffers holding ``params``' gradients (one fill per buffer) and drop any stray ``.grad``."""
    params = list(params)
    for buf in buffers_of(params):
        buf.zero_()
    for p in params:
        p.grad = None


def reduce_buffers(buffers: Iterable[GradBuffer], ctx: ParallelContext, group: Any, *, label: str,
                   divide_by: int = 1, async_op: bool = False) -> list[tuple[Any, torch.Tensor]]:
    """One SUM all-reduce per bucket of every buffer over ``group``, in place; then divide by ``divide_by``.

    An ``"ep"`` buffer (an expert-parallel MoE's experts) is refused: its experts differ from one
    ep rank to the next, and their rule is a division (:func:`lslm.expert_parallel.reduce_expert_parallel_grads`).

    Synchronous: returns ``[]`` once done. ``async_op=True``: returns ``(work, bucket view)`` pairs;
    the caller waits each work and divides (:func:`finish_reductions`).
    """
    buffers = list(buffers)
    experts = [buf for buf in buffers if buf.kind == "ep"]
    if experts:
        raise ValueError("an 'ep' gradient buffer holds an expert-parallel MoE's experts, different on each ep rank: "
                         "lslm.expert_parallel.reduce_expert_parallel_grads divides it by ep; it is not all-reduced")
    pending = []
    for buf in buffers:
        for b in range(len(buf.buckets)):
            view = buf.bucket_view(b)
            work = ctx.comm.all_reduce(view, ReduceOp.SUM, group=group, async_op=async_op, label=label)
            if async_op:
                pending.append((work, view))
            elif divide_by != 1:
                view.div_(divide_by)
    return pending


def finish_reductions(pending: Iterable[tuple[Any, torch.Tensor]], divide_by: int = 1) -> None:
    """Wait for :func:`reduce_buffers`' asynchronous works and divide each bucket by ``divide_by``."""
    for work, view in pending:
        work.wait()
        if divide_by != 1:
            view.div_(divide_by)


def split_by_holder(params: Iterable[torch.Tensor]) -> tuple[list[GradBuffer], list[torch.Tensor]]:
    """``(buffers holding some of params' gradients, params whose gradient is a plain .grad)``.

    Raises ``ValueError`` when a buffer holds parameters not among ``params``: reducing the
    whole buffer would then touch gradients the caller did not ask for.
    """
    params = list(params)
    buffered = [p for p in params if has_main_grad(p)]
    plain = [p for p in params if not has_main_grad(p)]
    buffers = buffers_of(buffered)
    ids = {id(p) for p in buffered}
    for buf in buffers:
        outside = [buf.names[i] for i, q in enumerate(buf.params) if id(q) not in ids]
        if outside:
            raise ValueError(f"a {buf.kind!r} gradient buffer also holds {outside[0]!r} ({len(outside)} in all), "
                             "which this reduction was not given: attach buffers per group of parameters reduced "
                             "together (attach_grad_buffers on each pipeline stage, after apply_tensor_parallel)")
    return buffers, plain
