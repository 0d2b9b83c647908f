"""ZeRO's gradient reduction: reduce-scatter into this rank's slices, across replicas, and the global norm.

Rajbhandari et al. 2020, §5.1-5.2. Stage 1 reduce-scatters the whole gradient buffer at the step, in place:
each bucket's output is this rank's slice of that very bucket (:func:`reduce_scatter_buffer`). Stages 2-3
reduce-scatter *during* backward (:class:`BackwardReduceScatter`): as soon as every gradient of a bucket
exists they are copied into a bucket-sized staging buffer and freed, and the reduce-scatter writes into the
slice; at most ``max_inflight`` buckets are on their way at once, so staging memory stays bounded, and buckets
go in index order on every rank, so the collectives pair up. HSDP then sums each slice across the
``dp_replicate`` group (:func:`all_reduce_replicas`). Clipping needs the norm of the whole gradient while each
rank holds a slice: squared norms add over the group (:func:`clip_slices`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.clip import counts_in_norm
from lslm.zero.gather import UnitGather
from lslm.zero.layout import Piece

__all__ = ["NORM_LABEL", "REDUCE_SCATTER_LABEL", "REPLICATE_LABEL", "BackwardReduceScatter", "all_reduce_replicas",
           "clip_slices", "reduce_scatter_buffer"]

REDUCE_SCATTER_LABEL = "zero grads reduce-scatter"
NORM_LABEL = "zero grad norm"
#: HSDP: the all-reduce of each rank's gradient slices across the dp_replicate group.
REPLICATE_LABEL = "zero grads replicate all-reduce"

#: A bucket: its start and end in the flat layout, the indices of its parameters, its padding.
Bucket = tuple[int, int, list[int], int]


def reduce_scatter_buffer(ctx: ParallelContext, group: Any, data: torch.Tensor, buckets: Sequence[Bucket],
                          slices: Sequence[torch.Tensor]) -> None:
    """Stage 1: reduce-scatter every bucket of the whole gradient buffer ``data`` into this rank's ``slices``."""
    comm = ctx.comm
    # In place: the output is this rank's slice of the very bucket that is the input.
    works = [comm.reduce_scatter_tensor(out, data[a:z], group=group, async_op=True, label=REDUCE_SCATTER_LABEL)
             for out, (a, z, _, _) in zip(slices, buckets)]
    for w in works:
        w.wait()


def all_reduce_replicas(ctx: ParallelContext, replicate_group: Any, slices: Sequence[torch.Tensor]) -> None:
    """HSDP: sum the shard groups' sums across replicas, one all-reduce per slice."""
    comm = ctx.comm
    works = [comm.all_reduce(s, group=replicate_group, async_op=True, label=REPLICATE_LABEL) for s in slices]
    for w in works:
        w.wait()


def clip_slices(ctx: ParallelContext, group: Any, slices: Sequence[torch.Tensor], pieces: Sequence[Piece],
                piece_grads: Sequence[torch.Tensor], params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor],
                max_norm: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale ``grads`` (what the step reads) by the clipping coefficient of the global norm over every rank's
    slice; return ``(norm, coefficient)`` (``norm`` a one-element tensor)."""
    # Each element of the model is in exactly one rank's slice: squared norms add over the group.
    # The padding is zero (never written: reduce-scatter of zeros), so it adds nothing.
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    if ctx.tp_size * ctx.pp_size == 1:
        for s in slices:
            sq += s.float().pow(2).sum()
        ctx.comm.all_reduce(sq, group=group, label=NORM_LABEL)
    else:
        # With tensor and pipeline parallelism the model is also split over tp x pp: this rank's pieces of
        # sharded parameters count, replicated ones on tp rank 0 only, a pipeline's tied copy on one end
        # (lslm.tensor_parallel.clip.counts_in_norm); one all-reduce over dp x tp x pp completes the sum.
        for pc, g in zip(pieces, piece_grads):
            if counts_in_norm(params[pc.param], ctx):
                sq += g.float().pow(2).sum()
        ctx.comm.all_reduce(sq, group=ctx.group("dp", "tp", "pp"), label=NORM_LABEL)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total, coef


class BackwardReduceScatter:
    """Stages 2-3: each bucket's gradients reduce-scattered into this rank's slice as soon as backward made them.

    :meth:`on_grad` is every parameter's post-accumulate-grad hook. ``params`` and ``buckets`` share the
    optimizer's layout; ``slices[b]`` is this rank's slice of bucket ``b``. With ``gather`` (stage 3) a unit is
    freed once its gradients are staged (its backward is over), and everything still gathered when backward ends.
    """

    def __init__(self, ctx: ParallelContext, group: Any, params: Sequence[nn.Parameter], offsets: Sequence[int],
                 buckets: Sequence[Bucket], slices: Sequence[torch.Tensor], *, grad_dtype: torch.dtype,
                 device: torch.device, max_inflight: int, gather: UnitGather | None) -> None:
        self.ctx, self.group, self.params, self.offsets = ctx, group, params, offsets
        self.buckets, self.slices, self.grad_dtype, self.device = buckets, slices, grad_dtype, device
        self.max_inflight, self.gather = max_inflight, gather
        self.root = len(buckets) - 1  # stage 3: the parameters outside every unit, gathered for a whole step
        self.index = {id(p): i for i, p in enumerate(params)}
        self.bucket_of = {i: b for b, (_, _, idx, _) in enumerate(buckets) for i in idx}
        self.ready = [0] * len(buckets)
        self.next = 0  # buckets are reduced in index order on every rank, so the collectives pair up
        self.inflight: list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.fresh = True  # the slices are zero: the first backward reduce-scatters straight into them
        self.callback_queued = False
        #: The most bytes that staging buffers held at once; a running maximum (set it to 0 to measure from a point).
        self.peak_staging_bytes = 0

    def on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: count ``param``'s gradient in, launch every bucket now complete, in order."""
        if param.grad is None:
            return
        if not self.callback_queued:  # once per backward: whatever is left goes when autograd is done
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
        b = self.bucket_of[self.index[id(param)]]
        self.ready[b] += 1
        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next][2]):
            self.launch(self.next)
            self.next += 1

    def launch(self, b: int) -> None:
        """Copy bucket ``b``'s gradients into a staging buffer (freeing them), reduce-scatter it into the slice."""
        while len(self.inflight) >= self.max_inflight:  # bounded staging memory: wait for the oldest bucket
            self.settle(self.inflight.pop(0))
        start, end, idx, _ = self.buckets[b]
        staging = torch.zeros(end - start, dtype=self.grad_dtype, device=self.device)
        for i in idx:
            p = self.params[i]
            if p.grad is not None:  # an unused parameter contributes zeros
                staging[self.offsets[i] - start:self.offsets[i] - start + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        if self.gather is not None and b != self.root:
            self.gather.release(b)  # its gradients are in the staging buffer: the unit's backward is over
        target = self.slices[b]
        out = target if self.fresh else torch.empty_like(target)
        work = self.ctx.comm.reduce_scatter_tensor(out, staging, group=self.group, async_op=True,
                                                   label=REDUCE_SCATTER_LABEL)
        self.inflight.append((work, staging, out, target))
        # The staging buffer, and a separate output where a later micro-batch adds into the slice.
        staged = sum(st.nbytes + (o.nbytes if o is not tg else 0) for _, st, o, tg in self.inflight)
        self.peak_staging_bytes = max(self.peak_staging_bytes, staged)

    @staticmethod
    def settle(entry: tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Wait for one bucket's reduce-scatter; a later micro-batch's sum is added into the slice."""
        work, _staging, out, target = entry
        work.wait()
        if out is not target:  # a later micro-batch: add its sum to what the slice holds
            target.add_(out)

    def end_of_backward(self) -> None:
        """Autograd's final callback: launch the buckets left, then :meth:`finish`."""
        # Buckets with a parameter that got no gradient this backward go now, in order, on every rank alike.
        while self.next < len(self.buckets):
            self.launch(self.next)
            self.next += 1
        self.finish()

    def finish(self) -> None:
        """Wait for every bucket on its way (its sum is then in the slice) and get ready for the next backward."""
        while self.inflight:
            self.settle(self.inflight.pop(0))
        if self.gather is not None and self.next:
            self.gather.release_all()  # the root, and any unit a backward never reached
        if self.next:  # a backward happened: its sums are in the slices
            self.fresh = False
        self.ready = [0] * len(self.buckets)
        self.next = 0
        self.callback_queued = False
