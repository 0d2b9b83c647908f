"""The column-parallel matmul with its communication inside the backward, where it can overlap.

One autograd function, three modes (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``):

* **plain** (no sequence parallelism, no overlap): the input passes through ``f``
  (:func:`~lslm.tensor_parallel.mappings.copy_to_tensor_parallel_region`) first, so the input
  gradient is all-reduced by ``f``'s backward, after this matmul's backward has finished.
* **async all-reduce**: this function all-reduces the input gradient itself, *asynchronously*,
  and computes the weight gradient while the all-reduce is in flight; it waits before
  returning. The input gradient is needed by the layer below, the weight gradient by nobody
  until the optimizer: computing the one while communicating the other hides the
  communication (Megatron-LM's ``--async-tensor-model-parallel-allreduce``).
* **sequence parallel**: the input arrives split along the sequence (``sequence_dim``: 0, the
  sequence-first layout in which neither collective copies anything; 1 for a batch-first
  model). Forward all-gathers it; backward reduce-scatters the input gradient
  (asynchronously, overlapped with the weight gradient the same way). With ``regather``
  only the slice is saved for backward and the full input is all-gathered again there
  (Korthikanti et al. 2022, Section 4.2.2): activation memory ``1/t`` for one more
  all-gather per layer.

``overlap_log``, if a list, receives per backward the times at which the weight-gradient
matmul started and ended (marks: the host clock on the CPU, CUDA events on GPUs, see
:func:`lslm.runtime.completion.mark`), next to the ledger record of the collective it
overlapped, so the overlap is measured against the collective's completion time (which
the ledger stamps for that collective because the log asks: ``ledger.timed()``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function

from lslm.runtime.completion import mark
from lslm.runtime.context import ParallelContext
from lslm.runtime.replay import capture_forward_state
from lslm.tensor_parallel.mappings import (
    SEQUENCE_DIM,
    all_gather_along,
    bwd_label,
    copy_to_tensor_parallel_region,
    fwd_label,
    reduce_scatter_along,
)

__all__ = ["linear_with_tp_communication"]


class _LinearWithTPCommunication(Function):
    @staticmethod
    def forward(fn: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pctx: ParallelContext,
                label: str, sequence_parallel: bool, regather: bool, async_allreduce: bool,
                overlap_log: list[dict[str, Any]] | None, seq_dim: int) -> torch.Tensor:
        fn.pctx, fn.label, fn.sp, fn.regather, fn.seq_dim = pctx, label, sequence_parallel, regather, seq_dim
        fn.async_allreduce, fn.overlap_log, fn.has_bias = async_allreduce, overlap_log, bias is not None
        # Under autocast the forward's matmul ran in half precision on half copies; the backward's matmuls must
        # too (as torch.amp.custom_bwd arranges), or they would mix a half gradient with fp32 saved tensors.
        fn.state = capture_forward_state(x.device, rng=False)
        if sequence_parallel:
            total = all_gather_along(x, pctx, seq_dim, fwd_label(label))[0]
            fn.save_for_backward(x if regather else total, weight)
        else:
            total = x
            fn.save_for_backward(x, weight)
        out = total.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(fn: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        with fn.state.autocast():
            return _LinearWithTPCommunication._backward(fn, grad_out)

    @staticmethod
    def _backward(fn: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        saved, weight = fn.saved_tensors
        pctx, ledger = fn.pctx, fn.pctx.comm.ledger
        if fn.sp and fn.regather:
            total = all_gather_along(saved, pctx, fn.seq_dim, bwd_label(f"{fn.label} regather"))[0]
        else:
            total = saved
        grad_input = grad_out.matmul(weight)
        work, comm_index = None, len(ledger.records)
        # A logged overlap is measured against the collective's completion time: ask the ledger for it.
        with ledger.timed(fn.overlap_log is not None):
            if fn.sp:
                grad_input, work = reduce_scatter_along(grad_input, pctx, fn.seq_dim, bwd_label(fn.label),
                                                        async_op=True)
            elif fn.async_allreduce:
                grad_input = grad_input.contiguous()
                work = pctx.comm.all_reduce(grad_input, group=pctx.tp_group, async_op=True,
                                            label=bwd_label(fn.label))
        logging = work is not None and fn.overlap_log is not None
        # Marks, not host clocks: on CUDA the host gets here when it has *enqueued* the work before (see
        # lslm.runtime.completion.mark); the comm start is where the current stream lets the collective run.
        start = mark(grad_out.device) if logging else None
        # The weight gradient runs while the collective above is in flight.
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = flat_grad.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_bias = flat_grad.sum(dim=0) if fn.has_bias else None
        end = mark(grad_out.device) if logging else None
        if work is not None:
            work.wait()
            if logging:
                fn.overlap_log.append({"record": ledger.records[comm_index] if comm_index < len(ledger.records)
                                       else None, "comm_start_s": start, "wgrad_start_s": start,
                                       "wgrad_end_s": end})
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def linear_with_tp_communication(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 pctx: ParallelContext, *, label: str, sequence_parallel: bool = False,
                                 regather: bool = True, async_allreduce: bool = False,
                                 overlap_log: list[dict[str, Any]] | None = None,
                                 sequence_dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """``x @ weight.T + bias`` for a column-parallel shard, with the tensor-parallel communication of its input.

    See the module doc for the three modes (``sequence_dim``: where the sequence is, for the
    sequence-parallel one). On a group of one rank it is a plain linear layer.
    """
    if pctx.tp_size == 1:
        return F.linear(x, weight, bias)
    if not sequence_parallel and not async_allreduce:
        return F.linear(copy_to_tensor_parallel_region(x, pctx, label), weight, bias)
    return _LinearWithTPCommunication.apply(x, weight, bias, pctx, label, sequence_parallel, regather,
                                            async_allreduce, overlap_log, sequence_dim)
