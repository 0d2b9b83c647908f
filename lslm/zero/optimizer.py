"""ZeRO stages 1-3: optimizer states, fp32 masters, gradients (2) and parameters (3) partitioned over dp ranks.

Rajbhandari et al. 2020, §5.1 (P_os, stage 1), §5.2 (P_os+g, stage 2) and §5.3 (P_os+g+p,
stage 3). The optimizer's part of the model states (Adam's two moments, and in fp16/bf16 the
fp32 master weights: ZeRO's ``K = 12`` bytes per parameter) exists only for this rank's slice
of the padded, bucketed flat layout (:mod:`lslm.zero.layout`); stage 2 also keeps only that
slice of the gradients, stage 3 only that slice of the parameters. Model-state bytes per
rank, with ``Ψ`` parameters over ``N`` ranks, in fp16/bf16 with the gradient in the
parameters' dtype as the paper counts it (padding aside): stage 1 ``2Ψ + 2Ψ + 12Ψ/N``,
stage 2 ``2Ψ + (2 + 12)Ψ/N``, stage 3 ``(2 + 2 + 12)Ψ/N``; in fp32 the masters are the
parameters themselves. The step, in the order Megatron-LM's distributed optimizer runs it:

1. **reduce-scatter** each bucket over the dp group: rank ``r``'s slice ends up holding the
   sum over ranks, divided by ``N`` (and by the loss scale in fp16) to give the mean. Stage 1
   does it at the step, in place on the whole gradient buffer. Stage 2 does it *during*
   backward: as soon as every gradient of a bucket exists, they are copied into a bucket-sized
   staging buffer and freed, and the reduce-scatter writes into the slice (at most
   ``max_inflight`` buckets on their way at once, so staging memory stays bounded); buckets
   go in index order on every rank, so the collectives pair up. Half an all-reduce's bytes.
2. fp16: the overflow vote over the slices (each rank sees only its slice, so it is an
   all-reduce of one flag); the global norm for clipping: squared norms of the slices summed
   over the group.
3. the inner optimizer steps only this rank's pieces (its master weights: views of the
   parameters in fp32, fp32 copies in fp16/bf16; their ``.grad`` are views of the slice).
4. fp16/bf16: the masters are rounded into the parameters' slice; then **all-gather** each
   bucket of the parameter buffer in place, so every rank has every updated weight. The other
   half of the all-reduce's bytes: per step ``2Ψ`` elements cross each rank's link, as in DDP.

The parameters live in one flat buffer with that layout (same offsets, same padded
buckets), so both collectives run on bucket views with no copy in or out.

**Stage 3.** A bucket is a *unit* (by default each of ``model.blocks``; the parameters
outside every unit, the embeddings and the head, form the root). Between steps each
parameter is an empty tensor and a rank holds only its slices. A unit's bucket is
all-gathered just before its forward (the next unit's gather is started at the same time:
one unit of look-ahead) and freed after it, for real: the views of it that autograd saved for backward
would keep the whole storage alive, so the storage itself shrinks to zero bytes and grows back for the
backward's re-gather (:mod:`lslm.zero.gather` says why and how); the gradient of the unit's output triggers its
gather again before its backward (and starts the previous unit's); once the unit's
gradients are in a staging buffer it is freed and reduce-scattered as at stage 2. The root
stays gathered for the whole step. Per step each block moves twice in all-gathers and once in
the reduce-scatter: the paper's ``3Ψ`` for the blocks; the root is gathered once, so the
whole model moves ``3Ψ - Ψ_root``. ``reshard_after_forward=False`` keeps each unit
gathered from its forward to its backward (FSDP2's option of that name): ``2Ψ``, and the
memory of every unit at once. No all-gather after the step: the next forward gathers.

**HSDP** (a grid with ``dp_shard < dp``, :mod:`lslm.runtime.grid`; torchtitan's and FSDP2's hybrid
sharding): every stage shards over the ``dp_shard`` group only (``N = dp_shard`` above: memory follows
``dp_shard``, not ``dp``), the reduce-scatters and all-gathers stay inside it, and at the step each
rank's gradient slices, summed over its shard group, are all-reduced over the ``dp_replicate`` group
(:data:`REPLICATE_LABEL`), one call per bucket slice, then divided by the whole ``dp``. So the traffic
that crosses replicas is ``2(R-1)/R`` of the slice, ``1/dp_shard`` of what DDP's all-reduce of the whole
buffer moves; the replicas then step identical slices. Stage 2 and 3 reduce-scatter every micro-batch
(inside the shard group) but all-reduce across replicas once per step, on the accumulated slice.
"""


from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lslm.data_parallel.buckets import cap_bytes, flat_layout
from lslm.data_parallel.grad_buffer import GradBuffer
from lslm.data_parallel.grad_sync import attach_grad_buffers, grad_kind
from lslm.precision.scaler import DynamicLossScaler
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.grads import sum_over_tp
from lslm.zero.checks import OFFLOADS, STAGES, check_arguments
from lslm.zero.disk import DiskStates
from lslm.zero.gather import GATHER_LABEL, UnitGather
from lslm.zero.hooks import attach_grad_hooks, attach_unit_hooks
from lslm.zero.inner import attach_master_grads, disk_states, inner_optimizer, step_chunk
from lslm.zero.layout import ShardLayout, shard_layout, unit_layout
from lslm.zero.offload import HostCopies, on_host
from lslm.zero.placement import owned_values, replace_meta_params, stage3_units
from lslm.zero.reduce import (
    NORM_LABEL,
    REDUCE_SCATTER_LABEL,
    REPLICATE_LABEL,
    BackwardReduceScatter,
    all_reduce_replicas,
    clip_slices,
    reduce_scatter_buffer,
)
from lslm.zero.state import full_state_dict, load_shard_state_dict, shard_state_dict

__all__ = ["GATHER_LABEL", "NORM_LABEL", "OFFLOADS", "REDUCE_SCATTER_LABEL", "REPLICATE_LABEL", "STAGES",
           "ZeroOptimizer"]


class ZeroOptimizer:
    """A torch optimizer's step, ZeRO stage 1 or 2: each data-parallel rank updates only its slice of the model.

    ``model``: an fp32 model (the same weights on every rank). ``optimizer``: a torch optimizer
    built over ``model``'s trainable parameters, with no state yet: its class, hyper-parameters
    and groups are kept, and each parameter is replaced by this rank's pieces of it (so a
    group's rule, e.g. no weight decay on biases, still follows the parameter). ``dtype``:
    ``torch.float32`` or a half dtype to which the model is cast (fp32 masters are kept for
    this rank's slice). ``scaler``: a :class:`DynamicLossScaler` (fp16) or ``None``; one
    without a ``comm`` votes over the dp group (each rank sees only its slice).
    ``grad_dtype``: the gradient buffer's dtype (fp32 by default; the parameters' dtype
    halves its bytes and sums in 16 bits). ``bucket_cap_mb``: bucket size (``None``: one).
    ``stage``: 1 (the whole gradient buffer, reduce-scattered at the step), 2 (only this
    rank's gradient slices, reduce-scattered bucket by bucket during backward, at most
    ``max_inflight`` at once) or 3 (parameters too: ``units``, the modules gathered as a
    whole, default ``model.blocks``; ``reshard_after_forward``; ``prefetch``: how many units
    ahead a unit's forward or backward starts gathering, 1 by default, 0 for none, when a step
    must hold only the root and the unit computing). At stage 3 the parameters are empty
    between steps: :meth:`full_state_dict` gathers them. ``offload="cpu"``
    (ZeRO-Offload, Ren et al. 2021): fp32 masters, optimizer states and the step live on the
    host; each step brings this rank's gradient slice down (fp32) and sends the updated weights
    up (in the model's dtype), counted in :attr:`offload_bytes`. On a CPU-only machine host and
    device are one memory: the same code runs and the copies are real, but no bus is crossed,
    so what it measures is the copies' cost and the bytes, not a PCIe transfer.
    ``offload="disk"`` (ZeRO-Infinity's NVMe offload, Rajbhandari et al. 2021): the masters and
    optimizer states live in files under ``offload_dir`` and stream through host memory
    during the step in chunks of ``disk_chunk_mb`` (:mod:`lslm.zero.disk`).

    With tensor and pipeline parallelism (``ctx`` with tp or pp > 1; stage 1, or stage 2 without
    pipeline stages) it shards this rank's own parameters (its tp shards of its stages) over dp,
    and the clipping norm spans dp x tp x pp, each replicated parameter and a pipeline's tied copy
    counted once (:func:`lslm.tensor_parallel.clip.counts_in_norm`). Sequence-parallel parameters
    share the one buffer: sum their gradients over tp before :meth:`step` (:mod:`lslm.three_d`).

    Interface of :class:`~lslm.precision.master.MixedPrecisionOptimizer`: ``zero_grad()``,
    ``scale_loss(loss)``, ``backward(loss)``, ``step(max_grad_norm) -> bool`` (False when an
    fp16 overflow skipped it), ``loss_scale``, ``param_groups``/``state`` (the inner
    optimizer's, over this rank's pieces), ``memory_owners()``. The gradients of every
    replica must be produced before ``step()``: it reduces them itself (no DDP wrapper).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, *,
                 stage: int = 1, dtype: torch.dtype = torch.float32, scaler: DynamicLossScaler | None = None,
                 grad_dtype: torch.dtype = torch.float32, bucket_cap_mb: float | None = 25.0,
                 max_inflight: int = 2, units: list[nn.Module] | None = None,
                 reshard_after_forward: bool = True, prefetch: int = 1, offload: str | None = None,
                 offload_dir: str | Path | None = None, disk_chunk_mb: float = 16.0,
                 init_seed: int | None = None) -> None:
        params, meta = check_arguments(model, optimizer, ctx, stage=stage, dtype=dtype, scaler=scaler,
                                       max_inflight=max_inflight, prefetch=prefetch, offload=offload,
                                       offload_dir=offload_dir, init_seed=init_seed)
        self.model, self.ctx, self.stage, self.dtype, self.scaler = model, ctx, stage, dtype, scaler
        self.max_inflight = max_inflight
        #: Stage 3's gathers and frees (:mod:`lslm.zero.gather`); ``None`` below stage 3.
        self.gather: UnitGather | None = None
        if scaler is not None and scaler.comm is None:
            # Each rank checks only its slice: the overflow vote must span the group.
            scaler.comm, scaler.group = ctx.comm, ctx.group("dp")
        # HSDP: shard over the dp_shard group only; the replicas of a slice are all-reduced at the step.
        hsdp = ctx.grid.hsdp
        self.group = ctx.group("dp_shard") if hsdp else ctx.group("dp")
        self.world, self.rank = (ctx.dp_shard_size, ctx.dp_shard_rank) if hsdp else (ctx.dp_size, ctx.dp_rank)
        #: HSDP: the dp_replicate group and its size (``None`` and 1 without HSDP).
        self.replicate_group = ctx.group("dp_replicate") if hsdp else None
        self.replicas = ctx.dp_replicate_size if hsdp else 1
        self.params = params
        self.grad_dtype = grad_dtype
        self.grad_buffer: GradBuffer | None = None
        if stage == 1:  # the whole gradient buffer on every rank (Megatron's distributed optimizer)
            # One layout for every parameter: a sequence-parallel one's tp sum runs on its view before the step.
            buffers = attach_grad_buffers(params, ctx, dtype=grad_dtype, bucket_cap_mb=bucket_cap_mb,
                                          pad_to=self.world, one_kind="dp")
            assert len(buffers) == 1 and buffers[0].kind == "dp"
            gb = self.grad_buffer = buffers[0]
            self.params = list(gb.params)
            self.offsets, self.numel = list(gb.offsets), gb.numel
            self.buckets = [(b.start, b.end, list(b.params), b.padding) for b in gb.buckets]
        elif stage == 2:  # the same layout, but only this rank's slices are ever allocated
            cap = cap_bytes(bucket_cap_mb) if bucket_cap_mb is not None else None
            self.offsets, self.buckets, self.numel = flat_layout([p.numel() for p in params], grad_dtype.itemsize,
                                                                 cap, self.world)
        else:  # stage 3: one bucket per unit (gathered as a whole), the last unit of the forward first
            self.unit_modules, groups = stage3_units(model, params, units)
            self.offsets, self.buckets, self.numel = unit_layout(groups, [p.numel() for p in params], self.world)
        device = self.device = ctx.device if meta else params[0].device
        self.layout: ShardLayout = shard_layout([(a, z, idx) for a, z, idx, _ in self.buckets], self.offsets,
                                                [p.numel() for p in self.params], self.rank, self.world)
        index = {id(p): i for i, p in enumerate(self.params)}  # the client optimizer's parameters
        #: Each parameter's shape (at stage 3 the parameters themselves are empty between steps).
        self.shapes = [p.shape for p in self.params]
        # This rank's gradient slices: views of the whole buffer (stage 1), or one tensor of them all (stage 2).
        if stage == 1:
            self._slices = [gb.data[lo:hi] for lo, hi in self.layout.shards]
        else:
            self.shard_grad = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
            self._slices, base = [], 0
            for lo, hi in self.layout.shards:
                self._slices.append(self.shard_grad[base:base + hi - lo])
                base += hi - lo
        self._piece_grads = [self._slices[pc.bucket][pc.offset - self.layout.shards[pc.bucket][0]:][:pc.numel]
                             for pc in self.layout.pieces]
        # Stage 2 under SP: the pieces of sequence-parallel parameters, summed over tp at each step (fixed views).
        self._sp_piece_grads = ([g for pc, g in zip(self.layout.pieces, self._piece_grads)
                                 if grad_kind(self.params[pc.param]) == "sp"]
                                if stage == 2 and ctx.tp_size > 1 else [])
        # Masters: fp32 copies of this rank's pieces, taken before the cast (exact); fp32 needs none (see below).
        half = dtype != torch.float32
        self.offload = offload
        self.host = torch.device("cpu")
        #: Bytes the last step moved between device and host with ``offload="cpu"`` (gradients down, weights up).
        self.offload_bytes = {"to_host": 0, "to_device": 0}
        # This rank's pieces of the fp32 weights: views of the parameters, or replayed from the serial build
        # (lslm.models.deferred_init) when the model is on the meta device: the whole model never exists here.
        values = owned_values(model, self.params, self.layout, init_seed) if meta else [
            self.params[pc.param].detach().reshape(-1)[pc.start:pc.stop] for pc in self.layout.pieces]
        # Disk offload: the masters' values go straight from here to the files (lslm.zero.disk); the masters
        # themselves stay empty, so the whole slice of fp32 states never sits in memory at once.
        disk_values = values if offload == "disk" else None
        if offload == "disk":
            masters = [torch.empty(0, dtype=torch.float32, device=self.host) for _ in values]
        elif half or offload:
            masters = [self._on_host(v.clone()) for v in values]
        if half:
            model.to(dtype)
        self._shard_base = [0]
        for lo, hi in self.layout.shards:
            self._shard_base.append(self._shard_base[-1] + hi - lo)
        if stage < 3:
            # One flat parameter buffer with the gradient buffer's layout; the parameters become views of it.
            self.param_data = torch.zeros(self.numel, dtype=dtype, device=device)
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    view = self.param_data[self.offsets[i]:self.offsets[i] + p.numel()]
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view(p.shape)
            owned = [self.param_data[pc.offset:pc.offset + pc.numel] for pc in self.layout.pieces]
        else:
            # Only this rank's slices persist; every parameter is an empty tensor until its unit is gathered.
            self.param_shard = torch.zeros(self.layout.numel, dtype=dtype, device=device)
            owned = [self.param_shard[self._in_shard(pc.bucket, pc.offset):][:pc.numel] for pc in self.layout.pieces]
            with torch.no_grad():
                for view, value in zip(owned, values):
                    view.copy_(value)
            del values
            self._empty = torch.empty(0, dtype=dtype, device=device)
            if meta:  # a meta tensor's data cannot be swapped for a real one: new parameters take their places
                replace_meta_params(model, self.params, self._empty)
            for p in self.params:
                p.data = self._empty
            self.gather = UnitGather(self.params, self.offsets, self.shapes, self.buckets, self.param_shard,
                                     self._shard_base, [hi - lo for lo, hi in self.layout.shards], ctx, self.group,
                                     self._empty)
        if not half and not offload:  # the fp32 parameters' own slice is what the optimizer updates: no copy at all
            masters = owned
        # ZeRO-Offload: the gradient slices come down into these host buffers for the step on the host.
        # (Disk offload brings them down chunk by chunk into its own buffers instead: no full-size copy.)
        self._host_grads = [self._on_host(torch.empty(pc.numel, dtype=torch.float32, device=self.host))
                            for pc in self.layout.pieces] if offload == "cpu" else []
        self.host_copies = HostCopies(self.device)  # and the host steps only once they have landed
        self._clip_coef: torch.Tensor | None = None
        self._owned = owned
        self.masters = masters
        self._grads_fp32 = grad_dtype == torch.float32
        self._grad_list: list[torch.Tensor] = []
        # The inner optimizer: same class, hyper-parameters and groups, over this rank's pieces (lslm.zero.inner).
        self.optimizer: torch.optim.Optimizer | None
        self.optimizer, defaults = inner_optimizer(optimizer, masters, self.layout.pieces, index)
        #: ZeRO-Infinity-style: masters and states in files under offload_dir (one folder per rank), or None.
        self.disk: DiskStates | None = None
        if offload == "disk":
            replica = f"replica{ctx.dp_replicate_rank:05d}-" if self.replicas > 1 else ""
            self.disk = disk_states(Path(offload_dir) / f"{replica}rank{self.rank:05d}-of-{self.world:05d}",
                                    type(optimizer), self.optimizer, defaults, masters, cap_bytes(disk_chunk_mb),
                                    disk_values, pin=self.device.type == "cuda")
        del disk_values
        # Stages 2-3: gradients leave autograd bucket by bucket during backward (lslm.zero.reduce, lslm.zero.hooks).
        #: Stages 2-3: the reduce-scatters during backward and their staging buffers; ``None`` at stage 1.
        self.reducer: BackwardReduceScatter | None = None
        self._hooks: list[Any] = []
        if stage >= 2:
            self.reducer = BackwardReduceScatter(ctx, self.group, self.params, self.offsets, self.buckets,
                                                 self._slices, grad_dtype=grad_dtype, device=device,
                                                 max_inflight=max_inflight, gather=self.gather)
            self._hooks = attach_grad_hooks(self.params, self.reducer)
        if self.gather is not None:
            self.reshard_after_forward = bool(reshard_after_forward)
            self.prefetch = prefetch
            self._root = len(self.buckets) - 1  # the parameters outside every unit: gathered for a whole step
            self._hooks += attach_unit_hooks(model, self.unit_modules, self.gather, self._root,
                                             self.reshard_after_forward, prefetch)

    def _on_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the offloaded states live (:func:`lslm.zero.offload.on_host`), or ``t`` without offload."""
        return on_host(t, self.device) if self.offload else t

    def _in_shard(self, b: int, offset: int) -> int:
        """Where element ``offset`` of the flat layout (inside this rank's slice of bucket ``b``) sits in the shard."""
        return self._shard_base[b] + offset - self.layout.shards[b][0]

    # -- the transient buffers' counters (kept by lslm.zero.gather and lslm.zero.reduce) ---------------------
    @property
    def max_buckets_gathered(self) -> int:
        """Stage 3: the most buckets whose full parameters existed at once (gathered or on their way); 0 below."""
        return self.gather.max_buckets_gathered if self.gather is not None else 0

    @max_buckets_gathered.setter
    def max_buckets_gathered(self, value: int) -> None:
        if self.gather is not None:
            self.gather.max_buckets_gathered = value

    @property
    def peak_gathered_bytes(self) -> int:
        """Stage 3: the most bytes full (gathered or on their way) parameter buckets held at once; a running
        maximum (set it to 0 to measure from a given point); 0 below stage 3."""
        return self.gather.peak_gathered_bytes if self.gather is not None else 0

    @peak_gathered_bytes.setter
    def peak_gathered_bytes(self, value: int) -> None:
        if self.gather is not None:
            self.gather.peak_gathered_bytes = value

    @property
    def peak_staging_bytes(self) -> int:
        """Stages 2-3: the most bytes that reduce-scatter staging buffers held at once; with
        :attr:`peak_gathered_bytes`, the transient buffers beside the model states. A running maximum (set it to 0
        to measure from a given point); 0 at stage 1."""
        return self.reducer.peak_staging_bytes if self.reducer is not None else 0

    @peak_staging_bytes.setter
    def peak_staging_bytes(self, value: int) -> None:
        if self.reducer is not None:
            self.reducer.peak_staging_bytes = value

    # -- the optimizer-facing attributes ----------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups over this rank's pieces (set ``lr`` here); empty if it owns none."""
        return self.optimizer.param_groups if self.optimizer is not None else []

    @property
    def state(self) -> Any:
        """The inner optimizer's state: moments of this rank's pieces only."""
        return self.optimizer.state if self.optimizer is not None else {}

    @property
    def loss_scale(self) -> float:
        """The scaler's current scale (1.0 without a scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def memory_owners(self) -> dict[str, list[torch.Tensor]]:
        """What ``lslm.metrics.memory_by_owner`` cannot find from the model: the gradient slices of stages 2-3
        (stage 1's whole buffer is every parameter's ``main_grad``), stage 3's parameter slices and gathered units,
        offload's host gradient buffers; masters and states come from ``param_groups``/``state``."""
        owned: dict[str, list[torch.Tensor]] = {}
        if self.stage > 1:
            owned["gradients" if self.grad_dtype == self.dtype else "main_grads"] = [self.shard_grad]
        if self._host_grads:  # offload: the fp32 copy of this rank's gradient slice the host steps with
            owned.setdefault("main_grads", []).extend(self._host_grads)
        if self.gather is not None:  # the parameters' persistent storage is this slice; gathered units are transient
            owned["parameters"] = [self.param_shard, *self.gather.gathered.values()]
        if self.disk is not None:  # the chunk buffers the states stream through: all they ever occupy in memory
            owned["optimizer_states"] = list(self.disk.slots)
        return owned

    # -- backward -----------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale, or the loss itself without a scaler."""
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the scaled loss; once per micro-batch (gradients accumulate in the buffer)."""
        self.scale_loss(loss).backward()

    def zero_grad(self) -> None:
        """Zero the gradients: the whole buffer (stage 1) or this rank's slices (stage 2), one fill."""
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        else:
            assert self.reducer is not None
            self.reducer.finish()  # nothing may still be on its way into the slices
            self.shard_grad.zero_()
            self.reducer.fresh = True
        for p in self.params:
            p.grad = None

    # -- the step -------------------------------------------------------------------------------------
    def _reduce_scatter(self) -> list[torch.Tensor]:
        """This rank's gradient slices, holding the mean over ranks (unscaled): stage 1 reduce-scatters the
        buffer now, stages 2-3 wait for what backward already sent."""
        if self.grad_buffer is not None:
            reduce_scatter_buffer(self.ctx, self.group, self.grad_buffer.data, self.buckets, self._slices)
        else:
            assert self.reducer is not None
            self.reducer.finish()
            if self._sp_piece_grads:
                # Stage 2 under tensor parallelism: a sequence-parallel parameter's gradient is partial on each tp
                # rank (each saw T/t positions; Korthikanti et al. 2022 §4.2.2), and only this rank's slices are
                # left to sum. The tp ranks of one dp coordinate share the layout (same shapes, same order): summing
                # the same pieces over tp sums the same elements, and the sum commutes with the dp reduce-scatter.
                sum_over_tp(self._sp_piece_grads, self.ctx)
        if self.replicate_group is not None:  # HSDP: sum the shard groups' sums across replicas, slice by slice
            all_reduce_replicas(self.ctx, self.replicate_group, self._slices)
        scale = self.world * self.replicas * (self.scaler.scale if self.scaler is not None else 1.0)
        for s in self._slices:
            s.mul_(1.0 / scale)  # the mean over ranks, unscaled (1/scale exact for a power of two)
        return self._slices

    def step(self, max_grad_norm: float | None = None, *, clip: Callable[..., Any] | None = None) -> bool:
        """Reduce-scatter, (vote,) clip, step this rank's pieces, all-gather the parameters; False if skipped.

        ``max_grad_norm`` clips by the global norm over every rank's slice (one all-reduce of a
        number). ``clip`` is accepted for interface compatibility with the other optimizers and
        must be ``None`` (the norm here is over slices, which only this optimizer knows).
        """
        if clip is not None:
            raise ValueError("ZeroOptimizer computes the global norm over its slices itself; pass max_grad_norm only")
        slices = self._reduce_scatter()
        self._clip_coef = None
        stepped = True
        if self.scaler is not None:
            stepped = not self.scaler.has_overflow(slices)
        if stepped:
            self._grad_list, to_host = attach_master_grads(
                self.masters, self._piece_grads, disk=self.disk,
                host_copies=self.host_copies if self.offload == "cpu" else None, host_grads=self._host_grads,
                grads_fp32=self._grads_fp32)
            if to_host is not None:
                self.offload_bytes["to_host"] = to_host
            if max_grad_norm is not None and max_grad_norm > 0:
                total, self._clip_coef = clip_slices(self.ctx, self.group, slices, self.layout.pieces,
                                                     self._piece_grads, self.params, self._grad_list, max_grad_norm,
                                                     self.device)
                self.last_grad_norm = float(total[0])  # disk offload applies the coefficient chunk by chunk
            if self.disk is not None:
                self.disk.walk(self.optimizer.state if self.optimizer is not None else {},
                               lambda chunk: step_chunk(chunk, self.masters, self._piece_grads, self._owned,
                                                        self.optimizer, self._clip_coef))
            elif self.optimizer is not None:
                self.optimizer.step()
            self._publish()
        for m in self.masters:
            m.grad = None  # views of the slice (or fp32 copies of a half one): nothing to keep
        if self.scaler is not None:
            self.scaler.update(not stepped)
        return stepped

    @torch.no_grad()
    def _publish(self) -> None:
        comm = self.ctx.comm
        if self.disk is not None:  # each chunk's weights went up as it was stepped
            self.offload_bytes["to_device"] = sum(v.numel() * v.element_size() for v in self._owned)
        elif self.dtype != torch.float32 or self.offload:
            for m, view in zip(self.masters, self._owned):
                view.copy_(m)  # rounds to the model's dtype (and, offloaded, goes up from the host)
            if self.offload:
                self.offload_bytes["to_device"] = sum(v.numel() * v.element_size() for v in self._owned)
        if self.gather is not None:  # the next forward gathers each unit when it needs it
            self.gather.release_all()
            return
        works = [comm.all_gather_into_tensor(self.param_data[a:z], self.param_data[lo:hi], group=self.group,
                                             async_op=True, label=GATHER_LABEL)
                 for (a, z, _, _), (lo, hi) in zip(self.buckets, self.layout.shards)]
        for w in works:
            w.wait()


    # -- state dicts (lslm.zero.state) ------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter, whole, by name (the model's dtype; clones). Collective at stage 3 (each unit
        is gathered in turn, on every rank); stages 1-2 read the replicated parameters."""
        return full_state_dict(self)

    # -- checkpoints (this rank's shard) -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: inner optimizer state, fp32 masters of its pieces, the scaler, the layout."""
        return shard_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank at the same data-parallel size, then re-gather the model."""
        load_shard_state_dict(self, state)

    def __repr__(self) -> str:
        pieces = self.layout
        hsdp = f", replicas={self.replicas}" if self.replicas > 1 else ""
        return (f"ZeroOptimizer(stage={self.stage}, rank={self.rank}/{self.world}{hsdp}, dtype={self.dtype}, "
                f"owns {pieces.param_numel:,} of {sum(p.numel() for p in self.params):,} parameters in "
                f"{len(pieces.pieces)} pieces, buckets={len(self.buckets)}, "
                f"inner={type(self.optimizer).__name__ if self.optimizer is not None else None})")
