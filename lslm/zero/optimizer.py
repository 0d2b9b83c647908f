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

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lslm.data_parallel.buckets import cap_bytes, flat_layout
from lslm.data_parallel.grad_buffer import GradBuffer, has_main_grad
from lslm.data_parallel.grad_sync import attach_grad_buffers, grad_kind
from lslm.models.deferred_init import is_meta, serial_leaves
from lslm.precision.scaler import DynamicLossScaler
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.clip import counts_in_norm
from lslm.tensor_parallel.grads import sum_over_tp
from lslm.zero.disk import DiskStates, check_writable, elementwise_state_keys
from lslm.zero.gather import GATHER_LABEL, UnitGather
from lslm.zero.layout import ShardLayout, shard_layout, unit_layout
from lslm.zero.offload import HostCopies, on_host

__all__ = ["GATHER_LABEL", "NORM_LABEL", "OFFLOADS", "REDUCE_SCATTER_LABEL", "REPLICATE_LABEL", "STAGES",
           "ZeroOptimizer"]

REDUCE_SCATTER_LABEL = "zero grads reduce-scatter"
NORM_LABEL = "zero grad norm"
#: HSDP: the all-reduce of each rank's gradient slices across the dp_replicate group.
REPLICATE_LABEL = "zero grads replicate all-reduce"

STAGES = (1, 2, 3)
#: Where the optimizer's states may live: with the parameters (``None``), in host memory (``"cpu"``) or in files
#: streamed through host memory during the step (``"disk"``).
OFFLOADS = (None, "cpu", "disk")


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
    whole, default ``model.blocks``; ``reshard_after_forward``). At stage 3 the parameters
    are empty between steps: :meth:`full_state_dict` gathers them. ``offload="cpu"``
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
                 reshard_after_forward: bool = True, offload: str | None = None,
                 offload_dir: str | Path | None = None, disk_chunk_mb: float = 16.0,
                 init_seed: int | None = None) -> None:
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
            hint = " (stage 0 is plain data parallelism: use lslm.data_parallel's DDP)" if stage == 0 else ""
            raise ValueError(f"ZeRO stage {stage!r} is not implemented here; choose one of {STAGES}{hint}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        if stage == 3 and (ctx.tp_size > 1 or ctx.pp_size > 1):
            raise ValueError(f"ZeRO stage 3 gathers whole units around the model's own forward, which a pipeline "
                             f"stage or a tensor-parallel layer does not run as one (tp={ctx.tp_size}, "
                             f"pp={ctx.pp_size}): use stage 1 (or 2 without pipeline stages) there")
        if stage == 2 and ctx.pp_size > 1:
            raise ValueError(f"ZeRO stage 2 reduce-scatters gradients during backward, but a pipeline rank (pp="
                             f"{ctx.pp_size}) must still sum its tied embedding's gradient with the other end after "
                             f"the last micro-batch: use stage 1 with pipeline parallelism")
        if ctx.grid.hsdp and ctx.tp_size * ctx.pp_size > 1:
            raise ValueError(f"HSDP (dp_shard={ctx.dp_shard_size} < dp={ctx.dp_size}) is implemented for pure data "
                             f"parallelism; with tp={ctx.tp_size}, pp={ctx.pp_size} leave dp_shard = dp")
        if stage == 2 and ctx.tp_size > 1 and any(getattr(p, "replicated_heads", None) for p in model.parameters()):
            raise ValueError("ZeRO stage 2 keeps gradient slices only, and key/value heads replicated over tensor-"
                             "parallel ranks are summed slot by slot on whole gradients: use stage 1, or tp <= the "
                             "number of key/value heads")
        if ctx.cp_size > 1:
            raise ValueError(f"cp={ctx.cp_size}: context-parallel ranks must also sum gradients; ZeroOptimizer "
                             "reduces over dp only")
        if scaler is not None and dtype != torch.float16:
            raise ValueError("a loss scaler is for fp16 training; bf16 and fp32 need none")
        if optimizer.state:
            raise ValueError("the optimizer already has state: build ZeroOptimizer before the first step")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no parameter that requires grad: nothing to optimise")
        if any(grad_kind(p) == "kv-heads" for p in params):
            raise ValueError("replicated key/value heads need a slot per head in a gradient buffer of their own; "
                             "ZeroOptimizer keeps one layout: use tp <= the number of key/value heads")
        if any(grad_kind(p) == "ep" for p in params):
            raise ValueError("an expert-parallel MoE's experts are divided by ep, not averaged over dp, and each dp "
                             "rank holds different experts: ZeroOptimizer shards one dp-averaged layout; train it with "
                             "lslm.expert_parallel.reduce_expert_parallel_grads and a plain optimizer")
        if stage == 3 and any(grad_kind(p) == "sp" for p in params):
            raise ValueError("ZeRO stage 3 gathers whole units, which sequence-parallel layers split over tp: use "
                             "stage 1 or 2 with sequence parallelism")
        in_groups = [p for g in optimizer.param_groups for p in g["params"]]
        if {id(p) for p in in_groups} != {id(p) for p in params} or len(in_groups) != len(params):
            raise ValueError("optimizer must be built over exactly the model's trainable parameters, each once")
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("build ZeroOptimizer on the fp32 model: it keeps fp32 masters before casting to dtype")
        meta = is_meta(model)
        if meta and (stage != 3 or init_seed is None):
            raise ValueError("a model on the meta device needs stage=3 and init_seed=<the seed the serial run builds "
                             "it from>: only stage 3 lets a rank hold its slice alone")
        if not meta and init_seed is not None:
            raise ValueError("init_seed is for a model built on the meta device; this model already holds weights")
        if any(has_main_grad(p) for p in params):
            raise ValueError("the model already has gradient buffers: ZeroOptimizer attaches its own, padded to the "
                             "data-parallel size")
        if offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
        if offload == "disk" and offload_dir is None:
            raise ValueError("offload='disk' needs offload_dir, a writable folder on a local disk for the states")
        if offload == "disk":
            check_writable(offload_dir)  # before anything changes
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1 (buckets reduced at once), got {max_inflight!r}")
        self.model, self.ctx, self.stage, self.dtype, self.scaler = model, ctx, stage, dtype, scaler
        self.max_inflight = max_inflight
        #: Stage 3's gathers and frees (:mod:`lslm.zero.gather`); ``None`` below stage 3.
        self.gather: UnitGather | None = None
        #: The most bytes that reduce-scatter staging buffers held at once (stages 2-3): with
        #: :attr:`peak_gathered_bytes`, the transient buffers beside the model states. A running maximum; set it to 0
        #: to measure from a given point.
        self.peak_staging_bytes = 0
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
            self.unit_modules, groups = _units(model, params, units)
            self.offsets, self.buckets, self.numel = unit_layout(groups, [p.numel() for p in params], self.world)
        device = self.device = ctx.device if meta else params[0].device
        self.layout: ShardLayout = shard_layout([(a, z, idx) for a, z, idx, _ in self.buckets], self.offsets,
                                                [p.numel() for p in self.params], self.rank, self.world)
        index = self._index = {id(p): i for i, p in enumerate(self.params)}
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
        values = _owned_values(model, self.params, self.layout, init_seed) if meta else [
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
                self._replace_meta_params(model)
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
        # The inner optimizer: same class, hyper-parameters and groups, over this rank's pieces.
        groups = []
        for g in optimizer.param_groups:
            members = {index[id(p)] for p in g["params"]}
            pieces = [m for m, pc in zip(masters, self.layout.pieces) if pc.param in members]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": pieces})
        groups = [g for g in groups if g["params"]]
        # The groups carry every setting; the constructor gets the defaults it accepts (some are derived keys).
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        self.optimizer: torch.optim.Optimizer | None = type(optimizer)(groups, **defaults) if groups else None
        #: ZeRO-Infinity-style: masters and states in files under offload_dir (one folder per rank), or None.
        self.disk: DiskStates | None = None
        if offload == "disk":
            keys: dict[int, list[tuple[str, torch.dtype]]] = {}
            for g in self.optimizer.param_groups if self.optimizer is not None else []:
                settings = {k: v for k, v in g.items() if k != "params"}
                found = elementwise_state_keys(type(optimizer), settings, defaults)
                keys.update({id(m): found for m in g["params"]})
            replica = f"replica{ctx.dp_replicate_rank:05d}-" if self.replicas > 1 else ""
            self.disk = DiskStates(Path(offload_dir) / f"{replica}rank{self.rank:05d}-of-{self.world:05d}", masters,
                                   cap_bytes(disk_chunk_mb), keys=[keys.get(id(m), []) for m in masters],
                                   values=disk_values, pin=self.device.type == "cuda")
        del disk_values
        # Stages 2-3: gradients leave autograd bucket by bucket during backward (see _on_grad).
        self._hooks: list[Any] = []
        if stage >= 2:
            self._bucket_of = {i: b for b, (_, _, idx, _) in enumerate(self.buckets) for i in idx}
            self._ready = [0] * len(self.buckets)
            self._next = 0  # buckets are reduced in index order on every rank, so the collectives pair up
            self._inflight: list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = []
            self._fresh = True  # the slices are zero: the first backward reduce-scatters straight into them
            self._callback_queued = False
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        if self.gather is not None:
            gather = self.gather
            self.reshard_after_forward = bool(reshard_after_forward)
            self._root = len(self.buckets) - 1  # the parameters outside every unit: gathered for a whole step
            n = len(self.unit_modules)
            for b, module in enumerate(self.unit_modules):  # bucket b holds the (n-1-b)-th unit of the forward
                following = b - 1 if b > 0 else None  # the next unit of the forward
                preceding = b + 1 if b + 1 < n else None  # the unit before it: the next one backward
                self._hooks.append(module.register_forward_pre_hook(gather.pre_forward_hook(b, following)))
                self._hooks.append(module.register_forward_hook(
                    gather.post_forward_hook(b, preceding, self.reshard_after_forward)))
            self._hooks.append(model.register_forward_pre_hook(lambda _m, _a: gather.ensure(self._root)))

    def _replace_meta_params(self, model: nn.Module) -> None:
        """Put a real (empty) parameter wherever a meta one was held; the order of ``self.params`` is kept."""
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((module, attr))
        for i, old in enumerate(self.params):
            new = nn.Parameter(self._empty, requires_grad=old.requires_grad)
            new.__dict__.update(old.__dict__)
            for module, attr in holders.get(id(old), []):
                module._parameters[attr] = new
            self.params[i] = new
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def _on_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the offloaded states live (:func:`lslm.zero.offload.on_host`), or ``t`` without offload."""
        return on_host(t, self.device) if self.offload else t

    def _in_shard(self, b: int, offset: int) -> int:
        """Where element ``offset`` of the flat layout (inside this rank's slice of bucket ``b``) sits in the shard."""
        return self._shard_base[b] + offset - self.layout.shards[b][0]

    # -- stage 3's counters (kept by lslm.zero.gather) ------------------------------------------------
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
            self._finish_backward()  # nothing may still be on its way into the slices
            self.shard_grad.zero_()
            self._fresh = True
        for p in self.params:
            p.grad = None

    # -- stage 2: reduce-scatter during backward ----------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if not self._callback_queued:  # once per backward: whatever is left goes when autograd is done
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        b = self._bucket_of[self._index[id(param)]]
        self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next][2]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        """Copy bucket ``b``'s gradients into a staging buffer (freeing them), reduce-scatter it into the slice."""
        while len(self._inflight) >= self.max_inflight:  # bounded staging memory: wait for the oldest bucket
            self._settle(self._inflight.pop(0))
        start, end, idx, _ = self.buckets[b]
        staging = torch.zeros(end - start, dtype=self.grad_dtype, device=self.device)
        for i in idx:
            p = self.params[i]
            if p.grad is not None:  # an unused parameter contributes zeros
                staging[self.offsets[i] - start:self.offsets[i] - start + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        if self.gather is not None and b != self._root:
            self.gather.release(b)  # its gradients are in the staging buffer: the unit's backward is over
        target = self._slices[b]
        out = target if self._fresh else torch.empty_like(target)
        work = self.ctx.comm.reduce_scatter_tensor(out, staging, group=self.group, async_op=True,
                                                   label=REDUCE_SCATTER_LABEL)
        self._inflight.append((work, staging, out, target))
        # The staging buffer, and a separate output where a later micro-batch adds into the slice.
        staged = sum(st.nbytes + (o.nbytes if o is not tg else 0) for _, st, o, tg in self._inflight)
        self.peak_staging_bytes = max(self.peak_staging_bytes, staged)

    @staticmethod
    def _settle(entry: tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        work, _staging, out, target = entry
        work.wait()
        if out is not target:  # a later micro-batch: add its sum to what the slice holds
            target.add_(out)

    def _end_of_backward(self) -> None:
        # Buckets with a parameter that got no gradient this backward go now, in order, on every rank alike.
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._finish_backward()

    def _finish_backward(self) -> None:
        while self._inflight:
            self._settle(self._inflight.pop(0))
        if self.gather is not None and self._next:
            self.gather.release_all()  # the root, and any unit a backward never reached
        if self._next:  # a backward happened: its sums are in the slices
            self._fresh = False
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._callback_queued = False

    # -- the step -------------------------------------------------------------------------------------
    def _reduce_scatter(self) -> list[torch.Tensor]:
        """This rank's gradient slices, holding the mean over ranks (unscaled): stage 1 reduce-scatters the
        buffer now, stage 2 waits for what backward already sent."""
        if self.grad_buffer is not None:
            gb, comm = self.grad_buffer, self.ctx.comm
            # In place: the output is this rank's slice of the very bucket that is the input.
            works = [comm.reduce_scatter_tensor(out, gb.data[a:z], group=self.group, async_op=True,
                                                label=REDUCE_SCATTER_LABEL)
                     for out, (a, z, _, _) in zip(self._slices, self.buckets)]
            for w in works:
                w.wait()
        else:
            self._finish_backward()
            if self._sp_piece_grads:
                self._sum_sequence_parallel_pieces()
        if self.replicate_group is not None:  # HSDP: sum the shard groups' sums across replicas, slice by slice
            comm = self.ctx.comm
            works = [comm.all_reduce(s, group=self.replicate_group, async_op=True, label=REPLICATE_LABEL)
                     for s in self._slices]
            for w in works:
                w.wait()
        scale = self.world * self.replicas * (self.scaler.scale if self.scaler is not None else 1.0)
        for s in self._slices:
            s.mul_(1.0 / scale)  # the mean over ranks, unscaled (1/scale exact for a power of two)
        return self._slices

    def _sum_sequence_parallel_pieces(self) -> None:
        # Stage 2 under tensor parallelism: a sequence-parallel parameter's gradient is partial on each tp rank
        # (each saw T/t positions; Korthikanti et al. 2022 §4.2.2), and only this rank's slices are left to sum.
        # The tp ranks of one dp coordinate share the layout (same shapes, same order): summing the same pieces
        # over tp sums the same elements, and the sum commutes with the dp reduce-scatter that made them.
        sum_over_tp(self._sp_piece_grads, self.ctx)

    def _attach_master_grads(self) -> None:
        if self.disk is not None:  # gradients go down chunk by chunk, into the disk buffers (_step_chunk)
            self.offload_bytes["to_host"] = 4 * sum(g.numel() for g in self._piece_grads)
            self._grad_list = []
            return
        if self.offload:  # gradients down: this rank's slice only, fp32, into the host buffers
            for m, g, host in zip(self.masters, self._piece_grads, self._host_grads):
                self.host_copies.copy(host, g)  # asynchronous from a GPU: the host waits below, once
                m.grad = host
            self.host_copies.issued()
            self.host_copies.wait()  # every slice has landed before the clip or the host step reads it
            self.offload_bytes["to_host"] = sum(h.numel() * 4 for h in self._host_grads)
            self._grad_list = list(self._host_grads)
            return
        for m, g in zip(self.masters, self._piece_grads):
            m.grad = g if self._grads_fp32 else g.float()
        self._grad_list = [m.grad for m in self.masters]

    def _clip(self, slices: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        # Each element of the model is in exactly one rank's slice: squared norms add over the group.
        # The padding is zero (never written: reduce-scatter of zeros), so it adds nothing.
        sq = torch.zeros(1, dtype=torch.float32, device=self.device)
        ctx = self.ctx
        if ctx.tp_size * ctx.pp_size == 1:
            for s in slices:
                sq += s.float().pow(2).sum()
            self.ctx.comm.all_reduce(sq, group=self.group, label=NORM_LABEL)
        else:
            # With tensor and pipeline parallelism the model is also split over tp x pp: this rank's pieces of
            # sharded parameters count, replicated ones on tp rank 0 only, a pipeline's tied copy on one end
            # (lslm.tensor_parallel.clip.counts_in_norm); one all-reduce over dp x tp x pp completes the sum.
            for pc, g in zip(self.layout.pieces, self._piece_grads):
                if counts_in_norm(self.params[pc.param], ctx):
                    sq += g.float().pow(2).sum()
            self.ctx.comm.all_reduce(sq, group=ctx.group("dp", "tp", "pp"), label=NORM_LABEL)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in self._grad_list:
            g.mul_(coef.to(g.device))
        self._clip_coef = coef  # disk offload applies it as each chunk's gradients come down
        return total[0]

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
            self._attach_master_grads()
            if max_grad_norm is not None and max_grad_norm > 0:
                self.last_grad_norm = float(self._clip(slices, max_grad_norm))
            if self.disk is not None:
                self.disk.walk(self.optimizer.state if self.optimizer is not None else {}, self._step_chunk)
            elif self.optimizer is not None:
                self.optimizer.step()
            self._publish()
        for m in self.masters:
            m.grad = None  # views of the slice (or fp32 copies of a half one): nothing to keep
        if self.scaler is not None:
            self.scaler.update(not stepped)
        return stepped

    def _step_chunk(self, chunk: list[int]) -> None:
        """Disk offload: step the pieces of one chunk (the only masters with a gradient now), send their weights up."""
        for i in chunk:  # the slot's gradient buffer: this piece's fp32 gradient (down from the device), clipped
            grad = self.masters[i].grad
            grad.copy_(self._piece_grads[i])
            if self._clip_coef is not None:
                grad.mul_(self._clip_coef.to(grad.device))
        if self.optimizer is not None:
            self.optimizer.step()
        with torch.no_grad():
            for i in chunk:
                self._owned[i].copy_(self.masters[i])
                self.masters[i].grad = None

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

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter, whole, by name (the model's dtype; clones). Collective at stage 3 (each unit
        is gathered in turn, on every rank); stages 1-2 read the replicated parameters."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        gather = self.gather
        for b in range(len(self.buckets)):
            gathered_here = gather is not None and b not in gather.gathered
            if gather is not None:
                gather.ensure(b)
            for i in self.buckets[b][2]:
                out[names[id(self.params[i])]] = self.params[i].detach().clone()
            if gather is not None and gathered_here:
                gather.release(b)
        return out

    # -- checkpoints (this rank's shard) -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: inner optimizer state, fp32 masters of its pieces, the scaler, the layout."""
        return {"stage": self.stage, "rank": self.rank, "world": self.world,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "masters": [m.detach().clone() for m in self.masters],
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank at the same data-parallel size, then re-gather the model."""
        if (state["world"], state["rank"]) != (self.world, self.rank):
            raise ValueError(f"this shard was saved by rank {state['rank']} of {state['world']}; this is rank "
                             f"{self.rank} of {self.world} (resharding is not implemented here)")
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"the shard has {len(state['masters'])} pieces, this rank {len(self.masters)}: another "
                             "model or bucket size")
        for m, saved in zip(self.masters, state["masters"]):
            m.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._publish()

    def __repr__(self) -> str:
        pieces = self.layout
        hsdp = f", replicas={self.replicas}" if self.replicas > 1 else ""
        return (f"ZeroOptimizer(stage={self.stage}, rank={self.rank}/{self.world}{hsdp}, dtype={self.dtype}, "
                f"owns {pieces.param_numel:,} of {sum(p.numel() for p in self.params):,} parameters in "
                f"{len(pieces.pieces)} pieces, buckets={len(self.buckets)}, "
                f"inner={type(self.optimizer).__name__ if self.optimizer is not None else None})")


def _units(model: nn.Module, params: list[nn.Parameter],
           units: list[nn.Module] | None) -> tuple[list[nn.Module], list[list[int]]]:
    """ZeRO-3's units in *reverse* forward order and the parameter indices of each bucket (one per unit, then the
    root: every parameter outside the units). Default units: ``model.blocks`` if it has them."""
    if units is None:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"ZeRO stage 3 gathers parameters unit by unit: pass units=[...] (the modules to gather "
                             f"as a whole, in forward order); {type(model).__name__} has no `blocks` to default to")
        units = list(blocks)
    index = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    groups = []
    for u in units:
        idx = [index[id(p)] for p in u.parameters() if id(p) in index]
        if seen & set(idx):
            raise ValueError("a parameter belongs to two units (nested or tied units): give each parameter one unit")
        seen |= set(idx)
        groups.append(idx)
    root = [i for i in range(len(params)) if i not in seen]
    # Backward produces the last unit's gradients first: reverse forward order, the root (embedding: last) at the end.
    return list(units)[::-1], groups[::-1] + [root]


def _owned_values(model: nn.Module, params: list[nn.Parameter], layout: ShardLayout,
                  seed: int) -> list[torch.Tensor]:
    """This rank's pieces of the serial build's fp32 weights for a model on the meta device, one leaf at a time."""
    index = {id(p): i for i, p in enumerate(params)}
    by_param: dict[int, list[int]] = {}
    for k, pc in enumerate(layout.pieces):
        by_param.setdefault(pc.param, []).append(k)
    values: list[torch.Tensor | None] = [None] * len(layout.pieces)
    for name, full in serial_leaves(model, seed):
        leaf = model.get_submodule(name)
        for attr, value in full.named_parameters(recurse=False):
            i = index.get(id(getattr(leaf, attr)))
            for k in by_param.get(i, []) if i is not None else []:
                pc = layout.pieces[k]
                values[k] = value.detach().reshape(-1)[pc.start:pc.stop].clone()
    assert all(v is not None for v in values)
    return values  # type: ignore[return-value]
