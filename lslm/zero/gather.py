"""ZeRO-3's unsharded parameters: gather a unit just before it is used, free it for real right after.

One flat buffer per bucket (a unit, or the root) holds the unit's whole parameters while it is
gathered; each parameter's ``.data`` is a view of it, and an empty tensor otherwise.

**Why freeing needs more than dropping a reference.** Autograd saves, for backward, tensors that
alias the gathered buffer: ``nn.Linear`` runs ``addmm`` and saves ``weight.t()``, a *view* of the
buffer's storage, not the parameter. Pointing the parameter at an empty tensor after the unit's
forward frees nothing: the saved view keeps the whole storage alive until the unit's backward, and
the backward's re-gather then allocates a second copy. So a release here shrinks the buffer's
*storage* to zero bytes (``untyped_storage().resize_(0)``): every view of it, saved ones included,
now refers to an empty storage and the memory goes back to the allocator. The backward's re-gather
grows that same storage back (``resize_``) and all-gathers into it, so the saved views see the
gathered values again by the time autograd unpacks them. This is how PyTorch's FSDP2 frees
(``free_storage`` / ``alloc_storage`` in ``torch/distributed/fsdp/_fully_shard``); DeepSpeed instead
replaces ``F.linear`` with an autograd function that saves the parameter rather than a view of its
data (``deepspeed/runtime/zero/linear.py``), which needs every layer type to cooperate. Resizing
storage needs nothing from the model.

**Version counters.** Writing into the buffer (the all-gather) bumps the buffer's version counter,
not the parameters': ``param.data = view`` keeps the parameter's own counter, and ``weight.t()``
shares the parameter's. So autograd's check that a saved tensor was not modified in place still
passes. (A ``no_grad`` ``copy_`` into the parameter itself would bump its counter and make backward
refuse: write through the buffer, never through the parameter.)

**A forward inside backward** (activation recomputation) gathers the unit again but must not free
it after: the recomputed saved tensors are about to be used. The post-forward hook therefore frees
only outside backward.

The bytes: :attr:`UnitGather.peak_gathered_bytes` counts the buffers whose storage is allocated
(gathered, or on their way), the most at once; a tracker from
:func:`lslm.metrics.allocations.track_live_bytes` is told of each re-growth and free, since a
storage resize is not an aten op its dispatch mode could see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lslm.metrics.allocations import note_storage_resize
from lslm.runtime.context import ParallelContext

__all__ = ["GATHER_LABEL", "UnitGather", "free_storage", "grow_storage"]

GATHER_LABEL = "zero params all-gather"


def free_storage(t: torch.Tensor) -> None:
    """Return ``t``'s storage to the allocator, keeping the storage object (and so every view of it)."""
    storage = t.untyped_storage()
    if storage.nbytes():
        note_storage_resize(storage, t.device.type, 0)
        storage.resize_(0)


def grow_storage(t: torch.Tensor) -> None:
    """Re-allocate the storage :func:`free_storage` emptied, to the bytes ``t`` spans (contents undefined)."""
    storage = t.untyped_storage()
    want = (t.storage_offset() + t.numel()) * t.element_size()
    if storage.nbytes() != want:
        storage.resize_(want)
        note_storage_resize(storage, t.device.type, want)


class UnitGather:
    """Stage 3's gathers, frees and prefetches over a flat layout of buckets (the units, then the root).

    ``params``/``offsets``/``shapes``: the parameters in layout order; ``buckets``: ``(start, end, indices,
    padding)`` per bucket; ``shard``: this rank's slices of every bucket, back to back, with bucket ``b``'s at
    ``shard_base[b]`` (``shard_len[b]`` elements); ``empty``: what a released parameter's ``.data`` is.
    """

    def __init__(self, params: Sequence[nn.Parameter], offsets: Sequence[int], shapes: Sequence[torch.Size],
                 buckets: Sequence[tuple[int, int, list[int], int]], shard: torch.Tensor,
                 shard_base: Sequence[int], shard_len: Sequence[int], ctx: ParallelContext, group: Any,
                 empty: torch.Tensor) -> None:
        self.params, self.offsets, self.shapes, self.buckets = params, offsets, shapes, buckets
        self.shard, self.shard_base, self.shard_len = shard, shard_base, shard_len
        self.ctx, self.group, self.empty = ctx, group, empty
        #: bucket -> its full buffer, allocated on the first gather and kept (its storage emptied) after.
        self.buffers: dict[int, torch.Tensor] = {}
        self.gathered: dict[int, torch.Tensor] = {}  # bucket -> its full parameters, while gathered
        self.gathering: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (work, buffer) on its way
        #: The most buckets whose full parameters existed at once (gathered or on their way).
        self.max_buckets_gathered = 0
        #: The most bytes those buckets held at once. Running maxima; set them to 0 to measure from a given point.
        self.peak_gathered_bytes = 0

    def prefetch(self, b: int) -> None:
        """Start bucket ``b``'s all-gather into its (re-grown) buffer, unless it is gathered or on its way."""
        if b in self.gathered or b in self.gathering:
            return
        a, z, _, _ = self.buckets[b]
        full = self.buffers.get(b)
        if full is None:
            full = self.buffers[b] = torch.empty(z - a, dtype=self.shard.dtype, device=self.shard.device)
        else:
            grow_storage(full)
        part = self.shard[self.shard_base[b]:self.shard_base[b] + self.shard_len[b]]
        work = self.ctx.comm.all_gather_into_tensor(full, part, group=self.group, async_op=True, label=GATHER_LABEL)
        self.gathering[b] = (work, full)
        self.max_buckets_gathered = max(self.max_buckets_gathered, len(self.gathered) + len(self.gathering))
        whole = sum(t.nbytes for t in self.gathered.values()) + sum(t.nbytes for _, t in self.gathering.values())
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, whole)

    def ensure(self, b: int) -> None:
        """Bucket ``b``'s parameters hold their full values (gathered now, or a prefetch waited for)."""
        if b in self.gathered:
            return
        self.prefetch(b)
        work, full = self.gathering.pop(b)
        work.wait()
        a = self.buckets[b][0]
        for i in self.buckets[b][2]:
            self.params[i].data = full[self.offsets[i] - a:][:self.shapes[i].numel()].view(self.shapes[i])
        self.gathered[b] = full

    def release(self, b: int) -> None:
        """Free bucket ``b``'s full parameters: each parameter an empty tensor, the buffer's storage zero bytes
        (so the views autograd saved of it hold nothing either)."""
        full = self.gathered.pop(b, None)
        if full is None:
            return
        for i in self.buckets[b][2]:
            self.params[i].data = self.empty
        free_storage(full)

    def release_all(self) -> None:
        """Free every gathered bucket (the root, and any unit a backward never reached)."""
        for b in list(self.gathered):
            self.release(b)

    def storage_bytes(self, units_only: bool = False) -> int:
        """Bytes the full buffers' storages hold now (0 between steps); ``units_only`` leaves out the root (the
        last bucket), which stays gathered for a whole step."""
        root = len(self.buckets) - 1
        return sum(t.untyped_storage().nbytes() for b, t in self.buffers.items() if not (units_only and b == root))

    # -- the hooks on each unit ----------------------------------------------------------------------------------
    def pre_forward_hook(self, b: int, following: Sequence[int]) -> Callable[..., None]:
        """Gather unit ``b`` before its forward and start the gathers of ``following``, the next units of the
        forward (the look-ahead: one unit by default, none with ``prefetch=0``)."""
        def hook(_module: nn.Module, _args: Any) -> None:
            self.ensure(b)
            for f in following:
                self.prefetch(f)  # its gather overlaps this unit's forward
        return hook

    def post_forward_hook(self, b: int, preceding: Sequence[int], reshard: bool) -> Callable[..., None]:
        """After unit ``b``'s forward: arm its re-gather for backward (which starts the gathers of ``preceding``,
        the next units of the backward), and (``reshard``) free it now."""
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                def pre_backward(grad: torch.Tensor) -> None:
                    # The gradient of this unit's output exists: its backward is next, the units before it after.
                    self.ensure(b)
                    for q in preceding:
                        self.prefetch(q)
                output.register_hook(pre_backward)
            # A forward run by backward (recomputation) keeps the unit: its saved tensors are used right away.
            if reshard and torch._C._current_graph_task_id() == -1:
                self.release(b)
        return hook
