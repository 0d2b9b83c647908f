"""ZeRO stages 1 and 2: optimizer states, fp32 masters and (stage 2) gradients partitioned over the dp ranks.

Rajbhandari et al. 2020, §5.1 (P_os, stage 1) and §5.2 (P_os+g, stage 2). Every rank keeps the
whole model, but the optimizer's part of the model states (Adam's two moments, and in
fp16/bf16 the fp32 master weights: ZeRO's ``K = 12`` bytes per parameter) only for its own
slice of the padded, bucketed flat layout (:mod:`lslm.zero.layout`); stage 2 also keeps only
that slice of the gradients. Model-state bytes per rank, with ``Ψ`` parameters over ``N``
ranks, in fp16/bf16 with the gradient in the parameters' dtype as the paper counts it
(padding aside): stage 1 ``2Ψ + 2Ψ + 12Ψ/N``, stage 2 ``2Ψ + (2 + 12)Ψ/N``; in fp32 the
masters are the parameters themselves (``4Ψ + 4Ψ + 8Ψ/N`` and ``4Ψ + 12Ψ/N``). The step, in
the order Megatron-LM's distributed optimizer runs it:

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
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lslm.data_parallel.buckets import cap_bytes, flat_layout
from lslm.data_parallel.grad_buffer import GradBuffer, has_main_grad
from lslm.data_parallel.grad_sync import attach_grad_buffers
from lslm.precision.scaler import DynamicLossScaler
from lslm.runtime.context import ParallelContext
from lslm.zero.layout import ShardLayout, shard_layout

__all__ = ["GATHER_LABEL", "NORM_LABEL", "REDUCE_SCATTER_LABEL", "ZeroOptimizer"]

REDUCE_SCATTER_LABEL = "zero grads reduce-scatter"
GATHER_LABEL = "zero params all-gather"
NORM_LABEL = "zero grad norm"

STAGES = (1, 2)


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
    ``stage``: 1 (the whole gradient buffer, reduce-scattered at the step) or 2 (only this
    rank's gradient slices, reduce-scattered bucket by bucket during backward, at most
    ``max_inflight`` at once).

    Interface of :class:`~lslm.precision.master.MixedPrecisionOptimizer`: ``zero_grad()``,
    ``scale_loss(loss)``, ``backward(loss)``, ``step(max_grad_norm) -> bool`` (False when an
    fp16 overflow skipped it), ``loss_scale``, ``param_groups``/``state`` (the inner
    optimizer's, over this rank's pieces), ``memory_owners()``. The gradients of every
    replica must be produced before ``step()``: it reduces them itself (no DDP wrapper).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, *,
                 stage: int = 1, dtype: torch.dtype = torch.float32, scaler: DynamicLossScaler | None = None,
                 grad_dtype: torch.dtype = torch.float32, bucket_cap_mb: float | None = 25.0,
                 max_inflight: int = 2) -> None:
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage {stage!r} is not implemented here; choose one of {STAGES}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        if ctx.tp_size > 1 or ctx.pp_size > 1:
            raise ValueError(f"ZeroOptimizer partitions over data parallelism only (tp={ctx.tp_size}, "
                             f"pp={ctx.pp_size}): use a grid with tp = pp = 1")
        if scaler is not None and dtype != torch.float16:
            raise ValueError("a loss scaler is for fp16 training; bf16 and fp32 need none")
        if optimizer.state:
            raise ValueError("the optimizer already has state: build ZeroOptimizer before the first step")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no parameter that requires grad: nothing to optimise")
        in_groups = [p for g in optimizer.param_groups for p in g["params"]]
        if {id(p) for p in in_groups} != {id(p) for p in params} or len(in_groups) != len(params):
            raise ValueError("optimizer must be built over exactly the model's trainable parameters, each once")
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("build ZeroOptimizer on the fp32 model: it keeps fp32 masters before casting to dtype")
        if any(has_main_grad(p) for p in params):
            raise ValueError("the model already has gradient buffers: ZeroOptimizer attaches its own, padded to the "
                             "data-parallel size")
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1 (buckets reduced at once), got {max_inflight!r}")
        self.model, self.ctx, self.stage, self.dtype, self.scaler = model, ctx, stage, dtype, scaler
        self.max_inflight = max_inflight
        if scaler is not None and scaler.comm is None:
            # Each rank checks only its slice: the overflow vote must span the group.
            scaler.comm, scaler.group = ctx.comm, ctx.group("dp")
        self.group = ctx.group("dp")
        self.world, self.rank = ctx.dp_size, ctx.dp_rank
        self.params = params
        self.grad_dtype = grad_dtype
        self.grad_buffer: GradBuffer | None = None
        if stage == 1:  # the whole gradient buffer on every rank (Megatron's distributed optimizer)
            buffers = attach_grad_buffers(params, ctx, dtype=grad_dtype, bucket_cap_mb=bucket_cap_mb,
                                          pad_to=self.world)
            assert len(buffers) == 1 and buffers[0].kind == "dp"
            gb = self.grad_buffer = buffers[0]
            self.params = list(gb.params)
            self.offsets, self.numel = list(gb.offsets), gb.numel
            self.buckets = [(b.start, b.end, list(b.params), b.padding) for b in gb.buckets]
        else:  # stage 2: the same layout, but only this rank's slices are ever allocated
            cap = cap_bytes(bucket_cap_mb) if bucket_cap_mb is not None else None
            self.offsets, self.buckets, self.numel = flat_layout([p.numel() for p in params], grad_dtype.itemsize,
                                                                 cap, self.world)
        device = params[0].device
        self.layout: ShardLayout = shard_layout([(a, z, idx) for a, z, idx, _ in self.buckets], self.offsets,
                                                [p.numel() for p in self.params], self.rank, self.world)
        index = self._index = {id(p): i for i, p in enumerate(self.params)}
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
        # Masters: fp32 copies of this rank's pieces, taken before the cast (exact); fp32 needs none (see below).
        half = dtype != torch.float32
        if half:
            masters = [self.params[pc.param].detach().reshape(-1)[pc.start:pc.stop].clone()
                       for pc in self.layout.pieces]
            model.to(dtype)
        # One flat parameter buffer with the gradient buffer's layout; the parameters become views of it.
        self.param_data = torch.zeros(self.numel, dtype=dtype, device=device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                view = self.param_data[self.offsets[i]:self.offsets[i] + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
        if not half:  # the fp32 parameters' own slice is what the optimizer updates: no copy at all
            masters = [self.param_data[pc.offset:pc.offset + pc.numel] for pc in self.layout.pieces]
        self.masters = masters
        self._grads_fp32 = grad_dtype == torch.float32
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
        # Stage 2: gradients leave autograd bucket by bucket during backward (see _on_grad).
        self._hooks: list[Any] = []
        if stage == 2:
            self._bucket_of = {i: b for b, (_, _, idx, _) in enumerate(self.buckets) for i in idx}
            self._ready = [0] * len(self.buckets)
            self._next = 0  # buckets are reduced in index order on every rank, so the collectives pair up
            self._inflight: list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = []
            self._fresh = True  # the slices are zero: the first backward reduce-scatters straight into them
            self._callback_queued = False
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

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
        """What ``lslm.metrics.memory_by_owner`` cannot find from the model: stage 2's gradient slices (stage 1's
        whole buffer is every parameter's ``main_grad``); masters and states come from ``param_groups``/``state``."""
        if self.stage == 1:
            return {}
        return {"gradients" if self.grad_dtype == self.dtype else "main_grads": [self.shard_grad]}

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
        staging = torch.zeros(end - start, dtype=self.grad_dtype, device=self.param_data.device)
        for i in idx:
            p = self.params[i]
            if p.grad is not None:  # an unused parameter contributes zeros
                staging[self.offsets[i] - start:self.offsets[i] - start + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        target = self._slices[b]
        out = target if self._fresh else torch.empty_like(target)
        work = self.ctx.comm.reduce_scatter_tensor(out, staging, group=self.group, async_op=True,
                                                   label=REDUCE_SCATTER_LABEL)
        self._inflight.append((work, staging, out, target))

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
        scale = self.world * (self.scaler.scale if self.scaler is not None else 1.0)
        for s in self._slices:
            s.mul_(1.0 / scale)  # the mean over ranks, unscaled (1/scale exact for a power of two)
        return self._slices

    def _attach_master_grads(self) -> None:
        for m, g in zip(self.masters, self._piece_grads):
            m.grad = g if self._grads_fp32 else g.float()

    def _clip(self, slices: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        # Each element of the model is in exactly one rank's slice: squared norms add over the group.
        # The padding is zero (never written: reduce-scatter of zeros), so it adds nothing.
        sq = torch.zeros(1, dtype=torch.float32, device=self.param_data.device)
        for s in slices:
            sq += s.float().pow(2).sum()
        self.ctx.comm.all_reduce(sq, group=self.group, label=NORM_LABEL)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for m in self.masters:
            if m.grad is not None:
                m.grad.mul_(coef)
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
        stepped = True
        if self.scaler is not None:
            stepped = not self.scaler.has_overflow(slices)
        if stepped:
            self._attach_master_grads()
            if max_grad_norm is not None and max_grad_norm > 0:
                self.last_grad_norm = float(self._clip(slices, max_grad_norm))
            if self.optimizer is not None:
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
        if self.dtype != torch.float32:
            for m, pc in zip(self.masters, self.layout.pieces):
                self.param_data[pc.offset:pc.offset + pc.numel].copy_(m)  # rounds to the model's dtype
        works = [comm.all_gather_into_tensor(self.param_data[a:z], self.param_data[lo:hi], group=self.group,
                                             async_op=True, label=GATHER_LABEL)
                 for (a, z, _, _), (lo, hi) in zip(self.buckets, self.layout.shards)]
        for w in works:
            w.wait()

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
        return (f"ZeroOptimizer(stage={self.stage}, rank={self.rank}/{self.world}, dtype={self.dtype}, "
                f"owns {pieces.param_numel:,} of {sum(p.numel() for p in self.params):,} parameters in "
                f"{len(pieces.pieces)} pieces, buckets={len(self.buckets)}, "
                f"inner={type(self.optimizer).__name__ if self.optimizer is not None else None})")

