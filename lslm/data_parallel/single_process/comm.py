"""The four autograd-aware copies behind single-process DataParallel.

Forward                                   Backward (what autograd runs in reverse)
--------------------------------------    -----------------------------------------
``Scatter``   batch -> one chunk/replica  gather the input-gradient chunks back
``Broadcast`` params -> every replica     reduce-add the replicas' gradients to the source
``Gather``    outputs -> output device    scatter the output gradient to the replicas

These mirror ``torch/nn/parallel/_functions.py`` (PyTorch's ``Scatter``,
``Broadcast``/``ReduceAddCoalesced`` and ``Gather``), written out one tensor at a
time, without coalescing or side streams, and with every copy recorded in a
:class:`~lslm.data_parallel.single_process.ledger.TransferLedger`. Each is an
``torch.autograd.Function`` so that the chain rule crosses the device
boundaries by itself: a copy's gradient is the copy back, and a broadcast's
gradient is a sum.

Copies use ``Tensor.to(device, copy=True)``: on the CPU demo source and target
are both ``cpu`` and a plain ``.to`` would silently return the same tensor, so
the algorithm would not be real.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from lslm.data_parallel.single_process.ledger import Place, TransferLedger

__all__ = ["Broadcast", "Gather", "Scatter", "chunk_sizes", "move"]


def chunk_sizes(total: int, parts: int) -> list[int]:
    """Split ``total`` rows over ``parts`` replicas: the first ``total % parts`` get one more.

    Unlike ``Tensor.chunk`` (which nn.DataParallel uses, and which can return fewer
    chunks than devices, e.g. 5 rows over 4 devices -> 2, 2, 1), every replica gets work.
    """
    if parts < 1:
        raise ValueError(f"need at least one replica, got {parts}")
    if total < parts:
        raise ValueError(f"batch of {total} rows cannot be split over {parts} devices: every replica needs "
                         f"at least one row; use a batch of >= {parts} rows or fewer devices")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def move(t: torch.Tensor, device: torch.device, *, src: Place, dst: Place, op: str, label: str,
         ledger: TransferLedger | None) -> torch.Tensor:
    """``t`` at place ``dst``: the tensor itself when it is already there, else a real copy (recorded).

    ``op`` and ``label`` name the copy in the ledger's vocabulary (see
    :mod:`~lslm.data_parallel.single_process.ledger`): e.g. ``("scatter", "forward")``.
    """
    if src == dst:
        return t
    issue = time.perf_counter()
    out = t.to(device=device, copy=True)
    if ledger is not None:
        ledger.record_copy(op, label, src, dst, t, issue_s=issue,
                           finished=t.device.type == "cpu" and out.device.type == "cpu")
    return out


@dataclass(frozen=True)
class Route:
    """Where the replicas live, and the place a tensor comes from or goes to.

    ``devices[i]`` is replica ``i``'s device; ``home`` is the place of the single
    tensor (the batch for Scatter, the output for Gather, the parameters for
    Broadcast) and ``home_device`` its device.
    """

    devices: tuple[torch.device, ...]
    home: Place
    home_device: torch.device
    ledger: TransferLedger | None = None


class Scatter(Function):
    """Forward: cut ``x`` along dim 0 into ``sizes`` and copy chunk ``i`` to replica ``i``.

    Backward: concatenate the chunks' gradients on ``x``'s device (a gather).
    """

    @staticmethod
    def forward(fn, route: Route, sizes: Sequence[int],  # type: ignore[override]
                x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fn.route, fn.sizes = route, list(sizes)
        chunks = torch.split(x, list(sizes), dim=0)
        # The chunk destined for x's own place stays a view: no copy, nothing recorded.
        return tuple(move(c, route.devices[i], src=route.home, dst=i, op="scatter", label="forward",
                          ledger=route.ledger) for i, c in enumerate(chunks))

    @staticmethod
    @once_differentiable
    def backward(fn, *grads: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        route = fn.route
        parts = [move(g, route.home_device, src=i, dst=route.home, op="gather", label="backward",
                      ledger=route.ledger) for i, g in enumerate(grads)]
        return None, None, torch.cat(parts, dim=0)


class Gather(Function):
    """Forward: concatenate the replicas' outputs along dim 0 into a new tensor on the output device.

    Every chunk, the local replica's included, is copied into the fresh output
    buffer and recorded: the output device ends up holding all of it. 0-dim
    outputs (one loss per replica) become a vector of length n, as in nn.DataParallel.

    Backward: split the output gradient and send chunk ``i`` back to replica ``i``.
    """

    @staticmethod
    def forward(fn, route: Route, *outputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        fn.route = route
        fn.scalar = all(o.dim() == 0 for o in outputs)
        outs = [o.reshape(1) if fn.scalar else o for o in outputs]
        tail = outs[0].shape[1:]
        if any(o.shape[1:] != tail or o.dtype != outs[0].dtype for o in outs):
            raise ValueError("gather: replica outputs must agree in dtype and in every dimension but the first, "
                             f"got {[(tuple(o.shape), o.dtype) for o in outs]}")
        fn.sizes = [o.shape[0] for o in outs]
        result = torch.empty((sum(fn.sizes), *tail), dtype=outs[0].dtype, device=route.home_device)
        offset = 0
        for i, o in enumerate(outs):
            issue = time.perf_counter()
            result.narrow(0, offset, o.shape[0]).copy_(o)
            offset += o.shape[0]
            if route.ledger is not None:
                route.ledger.record_copy("gather", "forward", i, route.home, o, issue_s=issue,
                                         finished=o.device.type == "cpu" and result.device.type == "cpu")
        return result

    @staticmethod
    @once_differentiable
    def backward(fn, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        route = fn.route
        grads = []
        for i, g in enumerate(torch.split(grad, fn.sizes, dim=0)):
            g = move(g, route.devices[i], src=route.home, dst=i, op="scatter", label="backward",
                     ledger=route.ledger)
            grads.append(g.reshape(()) if fn.scalar else g)
        return (None, *grads)


class Broadcast(Function):
    """Forward: one copy of every tensor in ``params`` per replica (replica ``home`` gets the tensors themselves).

    Returns ``n * len(params)`` tensors, replica by replica. Because they are
    outputs of this Function, not leaves, the replicas' gradients flow back here.

    Backward (the "ReduceAdd" of nn.DataParallel): for each parameter, copy the
    other replicas' gradients to the source device and add them to the local
    one, in replica order 0, 1, ..., n-1. The result is the parameter's ``.grad``.
    """

    @staticmethod
    def forward(fn, route: Route, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        fn.route, fn.num = route, len(params)
        outputs: list[torch.Tensor] = []
        for i, device in enumerate(route.devices):
            outputs.extend(move(p, device, src=route.home, dst=i, op="broadcast", label="forward",
                                ledger=route.ledger) for p in params)
        # Copies of frozen parameters must not ask for gradients.
        frozen = [outputs[i * len(params) + k] for i in range(len(route.devices))
                  for k, p in enumerate(params) if not fn.needs_input_grad[1 + k]]
        fn.mark_non_differentiable(*frozen)
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(fn, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        route, num = fn.route, fn.num
        reduced: list[torch.Tensor | None] = []
        for k in range(num):
            if not fn.needs_input_grad[1 + k]:
                reduced.append(None)
                continue
            total: torch.Tensor | None = None
            for i in range(len(route.devices)):
                g = move(grads[i * num + k], route.home_device, src=i, dst=route.home, op="reduce",
                         label="backward", ledger=route.ledger)
                total = g if total is None else total + g
            reduced.append(total)
        return (None, *reduced)
