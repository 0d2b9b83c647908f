"""PyTorch's own DistributedDataParallel behind the lslm DDP API, for side-by-side comparisons."""

from __future__ import annotations

import contextlib
import inspect
import re
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel

from lslm.data_parallel.buckets import cap_bytes
from lslm.data_parallel.ddp.base import GRAD_LABEL, DDPBase


class TorchDDP(DDPBase):
    """``torch.nn.parallel.DistributedDataParallel`` adapted to the API of the from-scratch variants.

    **Algorithm** (torch's C++ ``Reducer``): the bucketed-with-overlap design of
    :class:`~lslm.data_parallel.ddp.bucketed.BucketedDDP` - autograd hooks launching
    async bucket all-reduces, gradients divided by ``n``. Bucketing differs in
    detail: in torch 2.13 the first iteration puts every gradient in *one* bucket
    (unless ``find_unused_parameters``), then the buckets are re-planned, capped by
    ``bucket_cap_mb``, from the order in which gradients actually arrived. The synchronisation
    happens *inside* ``loss.backward()``, so :meth:`finish_grad_sync` is a no-op
    (kept so one training loop fits every variant). Same comm volume as ours:
    ``2(n-1)/n · Ψ`` bytes per rank with a ring. Li et al. 2020, "PyTorch
    Distributed" (VLDB), §3.2-3.3.

    Start-up: the broadcast from rank 0 (or, with ``broadcast_params=False``, the
    check) is ours, through the ledger; torch's own ``init_sync`` is switched off.
    ``no_sync()`` is torch's (wrap the forward too). The reducer's all-reduces go to
    the process group directly, invisible to the ledger, unless
    :meth:`use_ledger_comm_hook` replaces them with ledger calls (a DDP comm hook);
    ``record_timeline=True`` installs that hook, since torch keeps no timeline.
    ``.module`` is the wrapped model; ``.ddp`` is the torch object.

    **Memory.** The reducer's bucket buffers live inside torch's C++ ``Reducer`` and
    are not reachable as tensors, so ``memory_owners()`` reports nothing and
    :func:`lslm.metrics.memory_by_owner` does not see them. :meth:`reducer_bucket_bytes`
    reads their sizes from torch's own DDP logging data instead: one flat buffer per
    bucket, together the size of all gradients (≈ 1 Ψ, like
    :class:`~lslm.data_parallel.ddp.bucketed.BucketedDDP`) with torch's default
    ``gradient_as_bucket_view=False``; with ``True`` the gradients are views into them and
    the buckets cost nothing beyond the gradients.
    """

    variant = "torch"

    def __init__(self, module: nn.Module, ctx: Any, *, bucket_cap_mb: float = 25.0, broadcast_params: bool = True,
                 find_unused_parameters: bool = False, record_timeline: bool = False) -> None:
        cap_bytes(bucket_cap_mb)  # validate before any communication
        super().__init__(module, ctx, broadcast_params=broadcast_params,
                         find_unused_parameters=find_unused_parameters, record_timeline=record_timeline)
        self.bucket_cap_mb = float(bucket_cap_mb)
        device_ids = None
        if ctx.device.type == "cuda":
            device_ids = [ctx.device.index if ctx.device.index is not None else ctx.local_rank]
        extra = {"init_sync": False} if "init_sync" in inspect.signature(DistributedDataParallel).parameters else {}
        ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=self.group,
                                      bucket_cap_mb=self.bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                                      **extra)  # init_sync (torch >= 2.4): we broadcast already
        self.__dict__["ddp"] = ddp  # not a registered submodule: state_dict keys stay "module.*"
        self._bucket_names: dict[int, list[str]] = {}
        self._ledger_hook = False
        if record_timeline:
            self.use_ledger_comm_hook()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Torch's DDP forward (it prepares the reducer for the coming backward)."""
        return self.ddp(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Torch's ``no_sync()``: forwards inside it (and their backwards) do not all-reduce."""
        return self.ddp.no_sync()

    def finish_grad_sync(self) -> None:
        """No-op: torch's reducer has already averaged the gradients inside ``backward()``."""
        self._step += 1

    def reducer_bucket_bytes(self) -> list[int] | None:
        """Bytes of each of the reducer's bucket buffers (torch's numbers), or None if torch does not say.

        Read from ``DistributedDataParallel._get_ddp_logging_data()`` (a private API,
        hence the None fallback): ``"rebuilt_bucket_sizes"`` once torch has re-planned
        the buckets and logged it (a few iterations in), else ``"bucket_sizes"`` (the
        initial plan). Either way they add up to the gradients' bytes.
        """
        try:
            data = self.ddp._get_ddp_logging_data()
        except (AttributeError, RuntimeError):
            return None
        sizes = data.get("rebuilt_bucket_sizes", data.get("bucket_sizes"))
        if sizes is None:
            return None
        return [int(s) for s in re.findall(r"\d+", str(sizes))]

    @property
    def buckets(self) -> list[list[str]]:
        """With the ledger hook: parameter names of each bucket as last seen by the hook; else ``[]``."""
        return [self._bucket_names[k] for k in sorted(self._bucket_names)]

    def use_ledger_comm_hook(self) -> None:
        """Route the reducer's bucket all-reduces through ``ctx.comm`` (label ``"ddp-grad"``): SUM, then divide.

        Call before the first forward. The ledger then counts torch's bytes as it
        counts ours (exactly ``grad_bytes`` per synchronised step).
        """
        if self._ledger_hook:
            return
        names = {id(p): n for n, p in zip(self.param_names, self.params)}
        comm, group, n = self.comm, self.group, self.world_size

        # No annotations: torch checks them against its own classes, and this module's are strings.
        def hook(_state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer()
            b, nbytes = bucket.index(), buf.numel() * buf.element_size()
            self._bucket_names[b] = [names.get(id(p), "?") for p in bucket.parameters()]
            self._record("bucket_ready", b, nbytes)
            t_start = self._mark()
            work = comm.all_reduce(buf, ReduceOp.SUM, group=group, async_op=True, label=GRAD_LABEL)

            def done(fut: torch.futures.Future) -> torch.Tensor:
                out = fut.value()[0].div_(n)
                self._record("allreduce_done", b, nbytes, t_start=t_start)
                return out
            return work.get_future().then(done)

        self.ddp.register_comm_hook(None, hook)
        self._ledger_hook = True
