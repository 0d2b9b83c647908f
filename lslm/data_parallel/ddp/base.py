"""What every DDP variant shares: the wrapper, the start-up broadcast, no_sync, unused parameters.

Usage, identical for every variant (``make_ddp`` builds any of them)::

    ddp = make_ddp(model, ctx, variant="bucketed")   # rank 0's weights copied to every rank
    loss = ddp(x, y)[1]                               # forward: the wrapped model's
    loss.backward()
    ddp.finish_grad_sync()                            # every .grad is now the mean over ranks
    optimizer.step()

**Gradient accumulation.** Run the forward *and* backward of every micro-batch but
the last inside ``with ddp.no_sync():``; gradients then only accumulate locally in
``.grad``, and the last micro-batch's backward + ``finish_grad_sync()`` averages the
sum once. As in torch's DDP, the decision is taken at the forward: a backward
synchronises iff its forward ran through ``ddp(...)`` outside ``no_sync()``, and
``finish_grad_sync()`` after a ``no_sync()`` forward does nothing.

**Parameters without a gradient.** Every rank must all-reduce the same tensors in
the same order, so a parameter that took no part in the loss cannot be skipped
silently. By default ``finish_grad_sync()`` raises ``RuntimeError`` naming them. With
``find_unused_parameters=True`` a missing gradient counts as zero on that rank, so
the ranks still agree; one extra all-reduce of a used-flag per parameter (label
``"ddp-unused"``, 4 bytes each) then tells which parameters *no* rank used, and
those keep ``.grad = None`` as in torch's DDP (so the optimizer skips them).

**Start-up.** With ``broadcast_params=True`` rank 0's parameters and buffers are
broadcast to every rank of the dp group (one flat broadcast per dtype, label
``"ddp-broadcast"``). Buffers are *not* re-broadcast at every forward (torch's
``broadcast_buffers=True`` does that; it matters for BatchNorm statistics). With
``broadcast_params=False`` the replicas are checked instead (a 64-bit hash per
tensor, all-gathered) and ``ValueError`` names the first tensor that differs.

**Memory.** Each wrapper registers the buffers it keeps in ``memory_registry`` (a
:class:`~lslm.metrics.owners.MemoryRegistry`, one per wrapper) and reports them through
``memory_owners()``, so ``lslm.metrics.memory_by_owner(ddp, optimizer)`` counts them as
``comm_buffers`` next to the model states: bucketed keeps one flat buffer per bucket
(together the size of all gradients, ≈ 1 Ψ), fused one buffer per dtype as large as
its largest bucket, naive nothing (see each class).

Communication goes through ``ctx.comm`` (the ledger) on ``ctx.dp_group``; gradient
all-reduces carry the label ``"ddp-grad"`` and add up to exactly ``grad_bytes`` per
synchronised step. We use SUM then divide by the group size, not ``ReduceOp.AVG``:
it works on every backend and torch version (older gloo releases reject AVG).
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from lslm.data_parallel.buckets import cap_bytes, plan_buckets
from lslm.data_parallel.ddp.checks import first_mismatch
from lslm.data_parallel.grad_buffer import has_main_grad
from lslm.metrics.owners import MemoryRegistry
from lslm.runtime.completion import mark, resolve

GRAD_LABEL = "ddp-grad"
BROADCAST_LABEL = "ddp-broadcast"
UNUSED_LABEL = "ddp-unused"


def group_src(group: Any) -> int:
    """Global rank of rank 0 of ``group`` (the source of the start-up broadcast)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def flat_broadcast(tensors: list[torch.Tensor], comm: Any, src: int, group: Any, label: str) -> None:
    """Broadcast ``tensors`` from ``src`` in one flat message per (dtype, device), copying results in place."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        kinds[(t.dtype, t.device)].append(t)
    with torch.no_grad():
        for ts in kinds.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            comm.broadcast(flat, src, group=group, label=label)
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class DDPBase(nn.Module):
    """The common wrapper; subclasses implement :meth:`_sync_grads` (and may use the hooks below).

    Attributes: ``module`` (the wrapped model), ``grad_bytes`` (bytes of the gradients
    synchronised per step: every parameter with ``requires_grad``, shared ones once),
    ``world_size`` (dp group size), ``timeline`` (bucket events when
    ``record_timeline=True``), ``buckets`` (parameter names per all-reduce message),
    ``memory_registry`` (the buffers this wrapper keeps, by memory category).
    """

    variant = "base"
    #: Whether the variant reduces gradient buffers (``main_grad``) in place; the others refuse such a model.
    reduces_grad_buffers = False

    def __init__(self, module: nn.Module, ctx: Any, *, broadcast_params: bool = True,
                 find_unused_parameters: bool = False, record_timeline: bool = False) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DDP wraps an nn.Module, got {type(module).__name__}")
        wrong = [n for n, p in module.named_parameters() if p.device.type != ctx.device.type]
        if wrong:
            raise ValueError(f"parameter {wrong[0]!r} is on {module.get_parameter(wrong[0]).device} but this rank "
                             f"runs on {ctx.device}: call model.to(ctx.device) before wrapping it")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: create ctx with lslm.runtime.init_distributed()")
        buffered = [n for n, p in module.named_parameters() if has_main_grad(p)]
        if buffered and not self.reduces_grad_buffers:
            raise ValueError(f"{type(self).__name__} all-reduces .grad, but {buffered[0]!r} ({len(buffered)} "
                             "parameters in all) keeps its gradient in a gradient buffer (main_grad; .grad is None "
                             "after backward), so it would reduce nothing: use variant='bucketed', which reduces the "
                             "buffer, or build the optimizer with main_grad=False")
        self.module = module
        self.ctx = ctx
        self.comm = ctx.comm
        self.group = ctx.dp_group
        self.world_size = dist.get_world_size(self.group)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.record_timeline = bool(record_timeline)
        self._timeline: list[dict[str, Any]] = []
        self._timeline_lock = threading.Lock()
        self.memory_registry = MemoryRegistry()  # subclasses register their communication buffers here
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # shared tensors once
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.grad_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self._device = self.params[0].device if self.params else ctx.device
        self._require_sync = True  # False inside no_sync()
        self._sync_this_backward = True  # decided at each forward (grad enabled)
        self._synced_since_forward = False
        self._step = 0  # number of synchronised steps so far (timeline key)
        state = [p for p in module.parameters()] + [b for b in module.buffers()]
        if broadcast_params:
            flat_broadcast(state, self.comm, group_src(self.group), self.group, BROADCAST_LABEL)
        else:
            named_state = list(module.named_parameters()) + list(module.named_buffers())
            device = state[0].device if state else "cpu"
            bad = first_mismatch(named_state, self.comm, self.group, device)
            if bad is not None:
                raise ValueError(f"{bad[0]!r} differs across ranks (dp ranks {bad[1]} differ from dp rank 0) and "
                                 "broadcast_params=False: build the model from the same seed on every rank, or "
                                 "pass broadcast_params=True to copy rank 0's values")

    # -- the user-facing API -------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model; with grad enabled, decide whether the coming backward synchronises."""
        if torch.is_grad_enabled():
            self._before_forward()
            self._sync_this_backward = self._require_sync
            self._synced_since_forward = False
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this context forwards (and their backwards) only accumulate gradients locally."""
        old, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = old

    def finish_grad_sync(self) -> None:
        """Make every ``.grad`` the mean over the dp group (call once after each synchronising backward)."""
        if not self._sync_this_backward:
            return  # the last forward ran inside no_sync(): keep accumulating locally
        if self._synced_since_forward:
            raise RuntimeError("finish_grad_sync() was called again without a forward through the DDP wrapper "
                               "since the last sync: run the forward as ddp(x) (not ddp.module(x)) and call "
                               "finish_grad_sync() once per synchronising backward")
        self._sync_grads()
        self._synced_since_forward = True
        self._step += 1

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names of each all-reduce message, in the order they are sent."""
        return [[n] for n in self.param_names]

    def memory_owners(self) -> dict[str, list[torch.Tensor]]:
        """What this wrapper keeps alive, ``{category: [tensors]}`` (the model's own tensors excluded).

        Read by :func:`lslm.metrics.memory_by_owner`; the wrapped model's parameters and
        gradients come from the model itself (pass the wrapper as the model, or as an owner).
        """
        return self.memory_registry.memory_owners()

    @property
    def timeline(self) -> list[dict[str, Any]]:
        """The recorded bucket events, times as ``perf_counter`` seconds (None: a CUDA event not yet reached).

        Times are marks (:func:`lslm.runtime.completion.mark`): the host clock on the CPU, CUDA
        events on the current stream on GPUs, so a GPU timeline shows when the work happened,
        not when the host enqueued it.
        """
        with self._timeline_lock:
            rows = list(self._timeline)
        return [{k: resolve(v) for k, v in row.items()} for row in rows]

    def reset_timeline(self) -> None:
        """Forget the recorded events."""
        with self._timeline_lock:
            self._timeline.clear()

    # -- for subclasses ------------------------------------------------------------
    def _sync_grads(self) -> None:
        raise NotImplementedError

    def _before_forward(self) -> None:
        """Called at each forward with grad enabled, before the sync decision (a check point)."""

    def _record(self, event: str, bucket: int, nbytes: int, **extra: Any) -> None:
        if self.record_timeline:
            row = {"event": event, "bucket": bucket, "bytes": nbytes, "t": mark(self._device), "step": self._step,
                   **extra}
            with self._timeline_lock:
                self._timeline.append(row)

    def _mark(self) -> Any:
        """A time mark for a timeline field (see :attr:`timeline`), or None when no timeline is recorded."""
        return mark(self._device) if self.record_timeline else None

    def _unused_error(self, indices: list[int], where: str) -> RuntimeError:
        names = [self.param_names[i] for i in indices]
        shown = ", ".join(repr(n) for n in names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        return RuntimeError(
            f"{type(self).__name__}: {len(names)} parameter(s) got no gradient {where}: {shown}. Every rank must "
            "all-reduce every gradient, so DDP cannot skip them silently. Make them take part in the loss, set "
            "requires_grad=False on them before wrapping the model, or pass find_unused_parameters=True (a "
            "missing gradient then counts as zero, and a parameter no rank used keeps .grad=None).")

    def _globally_unused(self, used: list[bool]) -> list[int]:
        """All-reduce this rank's used flags; return the indices of parameters no rank used."""
        device = self.params[0].device if self.params else torch.device("cpu")
        flags = torch.tensor([1 if u else 0 for u in used], dtype=torch.int32, device=device)
        if flags.numel():
            self.comm.all_reduce(flags, ReduceOp.SUM, group=self.group, label=UNUSED_LABEL)
        return [i for i, f in enumerate(flags.tolist()) if f == 0]

    def _check_missing(self) -> tuple[list[int], list[int]]:
        """For variants that sync after backward: (params without .grad, those no rank used).

        Raises the unused-parameter error unless ``find_unused_parameters``; otherwise
        gives the missing ones a zero ``.grad`` so the all-reduce sees the same tensors
        everywhere (the caller sets the globally unused back to None afterwards).
        """
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if not self.find_unused_parameters:
            if missing:
                raise self._unused_error(missing, "before finish_grad_sync()")
            return [], []
        nobody = self._globally_unused([p.grad is not None for p in self.params])
        for i in missing:
            self.params[i].grad = torch.zeros_like(self.params[i])
        return missing, nobody

    def _clear_unused(self, nobody: list[int]) -> None:
        for i in nobody:
            self.params[i].grad = None

    def extra_repr(self) -> str:
        return (f"variant={self.variant!r}, world_size={self.world_size}, grad_bytes={self.grad_bytes}, "
                f"find_unused_parameters={self.find_unused_parameters}")


class BucketPlanDDP(DDPBase):
    """A :class:`DDPBase` whose gradients travel in buckets planned once, at construction.

    The plan (:func:`~lslm.data_parallel.buckets.plan_buckets`: reverse
    ``parameters()`` order, at most ``bucket_cap_mb`` MiB each, one dtype and device
    per bucket) is a list of parameter-index lists, ``self._plan``; the cap is
    validated before the constructor communicates, so a bad value fails on every rank
    alike instead of leaving peers waiting in the broadcast.
    """

    def __init__(self, module: nn.Module, ctx: Any, *, bucket_cap_mb: float = 25.0, broadcast_params: bool = True,
                 find_unused_parameters: bool = False, record_timeline: bool = False) -> None:
        cap = cap_bytes(bucket_cap_mb)
        super().__init__(module, ctx, broadcast_params=broadcast_params,
                         find_unused_parameters=find_unused_parameters, record_timeline=record_timeline)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self._plan = plan_buckets([p.numel() * p.element_size() for p in self.params], cap,
                                  [(p.dtype, p.device) for p in self.params])

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names of each bucket, in the order they are all-reduced (bucket 0: the last layers)."""
        return [[self.param_names[i] for i in idx] for idx in self._plan]
