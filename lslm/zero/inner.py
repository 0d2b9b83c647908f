"""The inner optimizer of ZeRO: the client's optimizer over this rank's pieces, wherever its states live.

The client builds a torch optimizer over the whole model; :func:`inner_optimizer` builds the same class, with
the same hyper-parameters and groups, over this rank's pieces (its fp32 masters), so a group's rule (no weight
decay on biases) still follows the parameter. Its gradients are views of this rank's gradient slice, or, with
ZeRO-Offload (Ren et al. 2021), fp32 copies brought down to host buffers (:func:`attach_master_grads`); with
ZeRO-Infinity's disk offload (Rajbhandari et al. 2021) the states live in files (:func:`disk_states`) and the
step walks them chunk by chunk (:func:`step_chunk`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lslm.zero.disk import DiskStates, elementwise_state_keys
from lslm.zero.layout import Piece
from lslm.zero.offload import HostCopies

__all__ = ["attach_master_grads", "disk_states", "inner_optimizer", "step_chunk"]


def inner_optimizer(client: torch.optim.Optimizer, masters: Sequence[torch.Tensor], pieces: Sequence[Piece],
                    index: dict[int, int]) -> tuple[torch.optim.Optimizer | None, dict[str, Any]]:
    """``client``'s class, hyper-parameters and groups over ``masters`` (one per piece; ``index`` maps the id of
    each of the client's parameters to its number); ``None`` if this rank owns no piece. Also the defaults
    passed to the constructor."""
    groups = []
    for g in client.param_groups:
        members = {index[id(p)] for p in g["params"]}
        own = [m for m, pc in zip(masters, pieces) if pc.param in members]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": own})
    groups = [g for g in groups if g["params"]]
    # The groups carry every setting; the constructor gets the defaults it accepts (some are derived keys).
    accepted = inspect.signature(type(client).__init__).parameters
    defaults = {k: v for k, v in client.defaults.items() if k in accepted}
    return (type(client)(groups, **defaults) if groups else None), defaults


def disk_states(folder: Path, client_type: type, inner: torch.optim.Optimizer | None, defaults: dict[str, Any],
                masters: list[torch.Tensor], chunk_bytes: int, values: Sequence[torch.Tensor] | None,
                pin: bool) -> DiskStates:
    """The files under ``folder`` that hold ``masters`` (written from ``values``) and ``inner``'s elementwise
    states, streamed through host memory in chunks of ``chunk_bytes``."""
    keys: dict[int, list[tuple[str, torch.dtype]]] = {}
    for g in inner.param_groups if inner is not None else []:
        settings = {k: v for k, v in g.items() if k != "params"}
        found = elementwise_state_keys(client_type, settings, defaults)
        keys.update({id(m): found for m in g["params"]})
    return DiskStates(folder, masters, chunk_bytes, keys=[keys.get(id(m), []) for m in masters],
                      values=values, pin=pin)


def attach_master_grads(masters: Sequence[torch.Tensor], piece_grads: Sequence[torch.Tensor], *,
                        disk: DiskStates | None, host_copies: HostCopies | None,
                        host_grads: Sequence[torch.Tensor], grads_fp32: bool) -> tuple[list[torch.Tensor], int | None]:
    """Give each master its gradient for the step; return the gradients the clip scales and the bytes brought
    down to the host (``None`` without offload). ``host_copies``: CPU offload's copies into ``host_grads``."""
    if disk is not None:  # gradients go down chunk by chunk, into the disk buffers (step_chunk)
        return [], 4 * sum(g.numel() for g in piece_grads)
    if host_copies is not None:  # gradients down: this rank's slice only, fp32, into the host buffers
        for m, g, host in zip(masters, piece_grads, host_grads):
            host_copies.copy(host, g)  # asynchronous from a GPU: the host waits below, once
            m.grad = host
        host_copies.issued()
        host_copies.wait()  # every slice has landed before the clip or the host step reads it
        return list(host_grads), sum(h.numel() * 4 for h in host_grads)
    for m, g in zip(masters, piece_grads):
        m.grad = g if grads_fp32 else g.float()
    return [m.grad for m in masters], None


def step_chunk(chunk: Sequence[int], masters: Sequence[torch.Tensor], piece_grads: Sequence[torch.Tensor],
               owned: Sequence[torch.Tensor], inner: torch.optim.Optimizer | None,
               clip_coef: torch.Tensor | None) -> None:
    """Disk offload: step the pieces of one chunk (the only masters with a gradient now), send their weights up."""
    for i in chunk:  # the slot's gradient buffer: this piece's fp32 gradient (down from the device), clipped
        grad = masters[i].grad
        grad.copy_(piece_grads[i])
        if clip_coef is not None:
            grad.mul_(clip_coef.to(grad.device))
    if inner is not None:
        inner.step()
    with torch.no_grad():
        for i in chunk:
            owned[i].copy_(masters[i])
            masters[i].grad = None
