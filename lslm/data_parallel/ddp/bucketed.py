"""Bucketed DDP with overlap (torch DDP's design): all-reduce each bucket as soon as backward fills it."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from lslm.data_parallel.ddp.base import GRAD_LABEL, BucketPlanDDP
from lslm.data_parallel.grad_buffer import GradBuffer, buffers_of, has_main_grad


class BucketedDDP(BucketPlanDDP):
    """Gradient bucketing with communication overlapped with backward.

    **Algorithm.** Gradients are grouped into buckets of at most ``bucket_cap_mb`` MiB
    in *reverse* ``parameters()`` order (the order backward produces them; a gradient
    larger than the cap travels alone), each bucket with its own flat buffer. A
    ``register_post_accumulate_grad_hook`` on every parameter - the hook receives the
    *parameter*, whose ``.grad`` is final for this backward - copies the gradient into
    its slot of the bucket buffer and counts it. When a bucket's count is complete,
    an ``async_op=True`` all-reduce (SUM) of its buffer starts at once, while autograd
    goes on computing earlier layers' gradients. Buckets are launched strictly in
    index order (a bucket that fills early waits for the ones before it), so every
    rank issues the same collectives in the same order even if gradients arrive in
    a different order. ``finish_grad_sync`` waits for the buckets in order, divides
    each buffer by ``n`` and copies it back into ``.grad``.

    **Two homes for the gradients.** On a plain model we *copy* gradients into the buckets
    (and back) rather than making ``.grad`` a view into the bucket buffer (torch's
    ``gradient_as_bucket_view=True``): simple and safe with ``zero_grad(set_to_none=True)``,
    at the price of 2 memory copies of Ψ and one extra Ψ of buffers (registered as
    ``comm_buffers``: ``memory_owners()``). On a model whose gradients already live in
    gradient buffers (``main_grad``: :func:`lslm.data_parallel.grad_sync.attach_grad_buffers`
    with ``bucket_cap_mb``, Megatron's layout) the buckets *are* the buffers' buckets: the
    buffer's hook folds each ``.grad`` into ``main_grad`` and tells this wrapper, a full
    bucket's slice of the buffer is all-reduced in place, and ``finish_grad_sync`` only waits
    and divides. No copies, no second Ψ, and the reduction runs in the buffer's dtype (fp32
    by default, so half-precision gradients are summed over ranks in fp32). ``grad_bytes`` is
    then the buffers' bytes.

    **Cost (alpha-beta model).** Same bytes as naive and fused, ``2(n-1)/n · Ψ`` per
    rank with a ring, in ``B`` calls; but all buckets except the last overlap with
    backward, so the *exposed* communication is roughly the last bucket's
    ``2(n-1)·α + 2(n-1)/n · Ψ_last · β`` when backward is slower than the network.
    Small buckets overlap better but pay more ``α``: the cap trades the two.
    Li et al. 2020, "PyTorch Distributed" (VLDB), §3.2 (gradient bucketing) and
    §3.2.3 (overlapping computation with communication).

    Within ``no_sync()`` the hooks return at once. A hook firing twice for one
    parameter in one synchronising backward (reentrant checkpointing, or a second
    backward before ``finish_grad_sync``) raises ``RuntimeError``: the bucket may
    already be on the wire. With ``record_timeline=True``, ``timeline`` gets
    ``{"event": "bucket_ready", "bucket", "bytes", "t", "step"}`` when a bucket is full
    and ``{"event": "allreduce_done", ..., "t_start"}`` when its all-reduce completes
    (a callback on the work's future; ``t_start`` is when it was launched). Times are
    marks (:func:`lslm.runtime.completion.mark`): on gloo the future's callback runs on
    gloo's thread when the operation ends; on NCCL it runs once the collective is enqueued,
    with the current stream ordered after it, so the CUDA event recorded there fires when
    the all-reduce has really completed.
    """

    variant = "bucketed"
    reduces_grad_buffers = True

    def __init__(self, module: nn.Module, ctx: Any, *, bucket_cap_mb: float = 25.0, broadcast_params: bool = True,
                 find_unused_parameters: bool = False, record_timeline: bool = False) -> None:
        super().__init__(module, ctx, bucket_cap_mb=bucket_cap_mb, broadcast_params=broadcast_params,
                         find_unused_parameters=find_unused_parameters, record_timeline=record_timeline)
        self._bucket_buffers: list[torch.Tensor] = []
        self._where: dict[int, tuple[int, int]] = {}  # param index -> (bucket, offset in its buffer)
        self._lock = threading.Lock()  # hooks may run on autograd's device thread
        self.grad_buffers = buffers_of(self.params)
        if self.grad_buffers:
            self._adopt_grad_buffers()
            self._reset_state()
            index = {id(p): i for i, p in enumerate(self.params)}
            self._handles = [buf.add_listener(self._listener(buf, index)) for buf in self.grad_buffers]
            return
        for b, idx in enumerate(self._plan):
            offset = 0
            for i in idx:
                self._where[i] = (b, offset)
                offset += self.params[i].numel()
            p0 = self.params[idx[0]]
            buf = torch.zeros(offset, dtype=p0.dtype, device=p0.device)
            self._bucket_buffers.append(self.memory_registry.register("comm_buffers", buf, f"bucket {b}"))
        self._reset_state()
        handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]
        self._handles = [h.remove for h in handles]

    def _adopt_grad_buffers(self) -> None:
        """Buckets = the gradient buffers' buckets, in buffer order; each bucket's slice is all-reduced in place."""
        mine = {id(p) for p in self.params}
        experts = [buf for buf in self.grad_buffers if buf.kind == "ep"]
        if experts:
            raise ValueError("an 'ep' gradient buffer holds an expert-parallel MoE's experts, which differ across the "
                             "dp ranks and must not be averaged over them: reduce with "
                             "lslm.expert_parallel.reduce_expert_parallel_grads instead of DDP")
        plain = [n for n, p in zip(self.param_names, self.params) if not has_main_grad(p)]
        if plain:
            raise ValueError(f"{plain[0]!r} has no gradient buffer while other parameters do: attach buffers to "
                             "the whole model (attach_grad_buffers) or to none of it")
        for buf in self.grad_buffers:
            if any(id(q) not in mine for q in buf.params):
                raise ValueError("a gradient buffer also holds parameters outside the wrapped model")
        index = {id(p): i for i, p in enumerate(self.params)}
        self._plan = []
        for buf in self.grad_buffers:
            for bucket in buf.buckets:
                self._plan.append([index[id(buf.params[j])] for j in bucket.params])
                self._bucket_buffers.append(buf.bucket_view(bucket.index))  # the gradients themselves, not a copy
        self._bucket_of = {i: b for b, idx in enumerate(self._plan) for i in idx}  # param index -> bucket
        self.grad_bytes = sum(buf.nbytes for buf in self.grad_buffers)

    def _listener(self, buf: GradBuffer, index: dict[int, int]) -> Any:
        def on_accumulate(j: int) -> None:  # the buffer folded parameter j's new gradient into main_grad
            if self._sync_this_backward:
                self._grad_ready(index[id(buf.params[j])], None)
        return on_accumulate

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapper then no longer synchronises anything)."""
        for remove in self._handles:
            remove()
        self._handles = []

    # -- state of one synchronising backward -------------------------------------------
    def _reset_state(self) -> None:
        self._ready = [False] * len(self.params)
        self._missing = [len(idx) for idx in self._plan]
        self._works: list[Any] = [None] * len(self._plan)
        self._next = 0  # the next bucket to launch

    def _dirty(self) -> bool:
        return any(self._ready)

    def _before_forward(self) -> None:
        if self._sync_this_backward and self._dirty():
            raise RuntimeError("BucketedDDP: a synchronising backward ran but finish_grad_sync() was not called "
                               "before this forward: call ddp.finish_grad_sync() after each backward (or wrap "
                               "accumulation micro-batches in ddp.no_sync())")

    # -- the hook ------------------------------------------------------------------------
    def _make_hook(self, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:  # receives the parameter, not the gradient
            if self._sync_this_backward:
                self._grad_ready(i, param)
        return hook

    def _grad_ready(self, i: int, param: torch.Tensor | None) -> None:
        with self._lock:
            if self._ready[i]:
                raise RuntimeError(f"BucketedDDP: parameter {self.param_names[i]!r} received a gradient twice in one "
                                   "synchronising backward (reentrant checkpointing, or a second backward before "
                                   "finish_grad_sync()); its bucket may already be on the wire")
            if param is not None:  # the copying mode; with a gradient buffer the gradient is in place already
                b, offset = self._where[i]
                self._bucket_buffers[b][offset:offset + param.numel()].view_as(param).copy_(param.grad)
            else:
                b = self._bucket_of[i]
            self._ready[i] = True
            self._missing[b] -= 1
            if self._missing[b] == 0:
                self._record("bucket_ready", b, self._nbytes(b))
                self._launch_in_order()

    def _nbytes(self, b: int) -> int:
        return self._bucket_buffers[b].numel() * self._bucket_buffers[b].element_size()

    def _launch_in_order(self) -> None:
        while self._next < len(self._plan) and self._missing[self._next] == 0:
            b = self._next
            t_start = self._mark()
            work = self.comm.all_reduce(self._bucket_buffers[b], ReduceOp.SUM, group=self.group, async_op=True,
                                        label=GRAD_LABEL)
            if self.record_timeline:  # the callback runs when the all-reduce completes; we wait for it too
                work = work.get_future().then(
                    lambda fut, b=b, t0=t_start: self._record("allreduce_done", b, self._nbytes(b), t_start=t0))
            self._works[b] = work  # a Work, or a Future: both have wait()
            self._next += 1

    # -- the end of backward ---------------------------------------------------------------
    def _sync_grads(self) -> None:
        with self._lock:
            unready = [i for i, r in enumerate(self._ready) if not r]
            nobody: list[int] = []
            if unready:
                if not self.find_unused_parameters:
                    for work in self._works[:self._next]:  # finish what every rank launched, then fail
                        work.wait()
                    self._reset_state()
                    raise self._unused_error(unready, "in this synchronising backward (no gradient hook fired)")
                for i in unready:  # zero (or what no_sync() micro-batches accumulated) counts as this rank's share
                    p = self.params[i]
                    if self.grad_buffers:  # main_grad holds it already (zero, or the no_sync() sum)
                        b = self._bucket_of[i]
                    else:
                        b, offset = self._where[i]
                        view = self._bucket_buffers[b][offset:offset + p.numel()].view_as(p)
                        if p.grad is not None:
                            view.copy_(p.grad)
                        else:
                            view.zero_()
                    self._ready[i] = True
                    self._missing[b] -= 1
                    if self._missing[b] == 0:
                        self._record("bucket_ready", b, self._nbytes(b))
                self._launch_in_order()
            if self.find_unused_parameters and not self.grad_buffers:  # after the buckets, same order everywhere
                nobody = self._globally_unused([p.grad is not None for p in self.params])
            works, self._works = self._works, [None] * len(self._plan)
            self._reset_state()
        for b, idx in enumerate(self._plan):
            works[b].wait()
            buf = self._bucket_buffers[b]
            buf.div_(self.world_size)
            if self.grad_buffers:
                continue  # the bucket is the gradients: nothing to copy back
            for i in idx:
                p = self.params[i]
                _, offset = self._where[i]
                src = buf[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = src.clone()
                else:
                    p.grad.copy_(src)
        self._clear_unused(nobody)
