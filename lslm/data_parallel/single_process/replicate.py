"""``replicate``: one copy of a module per device, whose parameters are differentiable copies of the originals.

What nn.DataParallel does on *every* forward (``torch/nn/parallel/replicate.py``):

1. broadcast all parameters from the source device to every device, through the
   autograd Function :class:`~lslm.data_parallel.single_process.comm.Broadcast`, so that a
   replica's parameter is a non-leaf tensor whose gradient flows back to the
   original and is summed there;
2. copy buffers (running statistics, masks) without autograd;
3. build, per device, a shallow copy of every submodule whose parameter slots
   hold that device's copies, wired into the same tree.

Replica 0 reuses the originals (views, no copy), so the bytes broadcast per call
are ``(n - 1) x`` the parameter bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lslm.data_parallel.single_process.comm import Broadcast, Route, move
from lslm.data_parallel.single_process.ledger import TransferLedger

__all__ = ["replicate"]


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new object of the module's class sharing its attributes, with empty parameter/buffer/child slots."""
    replica = module.__class__.__new__(module.__class__)
    replica.__dict__ = module.__dict__.copy()
    # Emptied, not shared: the replica's tensors are not Parameters, and replica.parameters()
    # must not list the originals (an optimizer built from a replica would update nothing real).
    replica._parameters = {}
    replica._buffers = replica._buffers.copy()
    replica._modules = replica._modules.copy()
    return replica


def replicate(module: nn.Module, devices: Sequence[torch.device], *,
              ledger: TransferLedger | None = None, detach: bool = False) -> list[nn.Module]:
    """Return ``len(devices)`` replicas of ``module``, replica ``i`` on ``devices[i]``.

    ``module`` must live on ``devices[0]``. Parameters of the replicas are outputs of
    :class:`~lslm.data_parallel.single_process.comm.Broadcast` (``detach=False``), so calling
    ``backward`` through any replica accumulates the summed gradient into the
    original parameters' ``.grad``. With ``detach=True`` they are plain copies (for
    inference). Buffers are copied without gradient. Copies are recorded in ``ledger``
    as ``broadcast`` with label ``forward`` (parameters) or ``buffers``.

    Like nn.DataParallel's replicas, these share the original modules' Python
    attributes (``training``, hooks, config); state a replica writes to its own
    buffers in forward (e.g. BatchNorm statistics) is lost unless on replica 0.
    """
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise ValueError("replicate: need at least one device")
    params = list(module.parameters())
    for p in [*params, *module.buffers()]:
        if p.device != devices[0]:
            raise ValueError(f"replicate: the module must live on devices[0]={devices[0]}, found a tensor on "
                             f"{p.device}; call module.to({str(devices[0])!r}) first")
    route = Route(tuple(devices), 0, devices[0], ledger)
    n, num = len(devices), len(params)
    if detach or not params:
        with torch.no_grad():
            flat = [move(p, d, src=0, dst=i, op="broadcast", label="forward", ledger=ledger).detach()
                    for i, d in enumerate(devices) for p in params]
    else:
        flat = list(Broadcast.apply(route, *params))
    copies = {id(p): [flat[i * num + k] for i in range(n)] for k, p in enumerate(params)}

    modules = list(module.modules())
    replicas = [[_shallow_copy(m) for m in modules] for _ in range(n)]
    index = {id(m): j for j, m in enumerate(modules)}
    for j, m in enumerate(modules):
        for i in range(n):
            r = replicas[i][j]
            for name, child in m._modules.items():
                r._modules[name] = None if child is None else replicas[i][index[id(child)]]
            for name, p in m._parameters.items():
                # A plain attribute, found before nn.Module.__getattr__ looks in _parameters.
                object.__setattr__(r, name, None if p is None else copies[id(p)][i])
            for name, b in m._buffers.items():
                if b is not None:
                    with torch.no_grad():
                        r._buffers[name] = move(b, devices[i], src=0, dst=i, op="broadcast", label="buffers",
                                                ledger=ledger)
    return [replicas[i][0] for i in range(n)]
