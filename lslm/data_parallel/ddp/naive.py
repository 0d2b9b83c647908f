"""Naive DDP: after backward, one blocking all-reduce per gradient."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed import ReduceOp

from lslm.data_parallel.ddp.base import GRAD_LABEL, DDPBase


class NaiveDDP(DDPBase):
    """Data parallelism the obvious way: ``finish_grad_sync`` all-reduces each ``.grad`` (SUM), then divides.

    **Algorithm.** Every rank computes gradients on its own micro-batch; after
    ``loss.backward()`` has finished, each parameter's gradient is all-reduced on its
    own, in ``parameters()`` order, and divided by the number of ranks ``n``. Every rank
    then holds the gradient of the mean loss over the global batch and takes the same
    optimizer step, so the replicas stay identical.

    **Cost (alpha-beta model).** With ``P`` gradient tensors of ``Ψ`` bytes in all, a
    ring all-reduce sends ``2(n-1)/n · Ψ`` bytes per rank, in ``P`` separate calls:
    time ``≈ P · 2(n-1) · α + 2(n-1)/n · Ψ · β``. The ``P · α`` latency term is what
    hurts - small tensors (biases, LayerNorms) cost a full round of latency each - and
    nothing overlaps with backward: communication starts only when compute has ended.
    Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
    Training" (VLDB), §3.2, measure exactly this and motivate buckets with it.

    **Memory.** No buffer of its own: the all-reduce runs in place on ``.grad`` (a
    non-contiguous gradient gets a temporary contiguous copy, freed at once), so
    ``memory_owners()`` reports nothing.
    """

    variant = "naive"

    def __init__(self, module: nn.Module, ctx: Any, *, broadcast_params: bool = True,
                 find_unused_parameters: bool = False, record_timeline: bool = False) -> None:
        super().__init__(module, ctx, broadcast_params=broadcast_params,
                         find_unused_parameters=find_unused_parameters, record_timeline=record_timeline)

    def _sync_grads(self) -> None:
        _, nobody = self._check_missing()
        for i, p in enumerate(self.params):
            g = p.grad
            buf = g if g.is_contiguous() else g.contiguous()  # collectives need contiguous memory
            nbytes = buf.numel() * buf.element_size()
            self._record("bucket_ready", i, nbytes)
            self.comm.all_reduce(buf, ReduceOp.SUM, group=self.group, label=GRAD_LABEL)
            buf.div_(self.world_size)
            if buf is not g:
                g.copy_(buf)
            self._record("allreduce_done", i, nbytes)
        self._clear_unused(nobody)
