"""The deadlock lesson: a ring of blocking sends hangs; ordering the sends (or not blocking) fixes it.

Every rank wants to pass a tensor to its right neighbour. If every rank calls a
blocking ``send`` first and ``recv`` second, every rank sits in ``send`` waiting
for a neighbour that is itself sitting in ``send``: a cycle of waits. One might
expect small messages to slip through a socket buffer; on gloo they do not - its
TCP transport only writes a message once the receiver has posted the matching
receive (a rendezvous), so the ring deadlocks even for a single element. Measured
with torch 2.13 on CPU: 1, 256 and 262,144 float32 elements (4 B to 1 MiB) all
hang until the process group's timeout.

Two fixes, both in :func:`ordered_ring`:

* ``mode="even_odd"``: even ranks send then receive, odd ranks receive then send.
  Every sender's right neighbour is receiving first (or is a chain away from one),
  so the cycle is broken - this works for odd n too.
* ``mode="isend"``: post the receive and the send without blocking, as one
  ``batch_isend_irecv``, then wait for both (what :func:`~lslm.collectives.p2p.exchange`
  does for every collective; on NCCL the batch is what keeps a 2-rank ring from
  deadlocking, see :func:`~lslm.collectives.p2p.post_pairs`).

The launch targets that run them, :func:`lslm.demos.collectives_demo.blocking_ring` and
:func:`~lslm.demos.collectives_demo.ordered_ring` (``lslm.launch("lslm.demos.collectives_demo:blocking_ring",
nproc=2, numel=1, timeout_s=3)``), return a JSON-ready dict per rank instead of raising, so a notebook can show
the timeout as a result.
"""

from __future__ import annotations

from typing import Any

import torch

from lslm.collectives.p2p import exchange, group_view
from lslm.runtime.ledger import Comm


def blocking_ring_exchange(comm: Comm, numel: int, group: Any = None,
                           device: torch.device | str | None = None) -> torch.Tensor:
    """Every rank: blocking send to the right, then blocking receive from the left. Deadlocks on gloo.

    The tensors live on ``device`` (default: ``comm.default_device(group)``).
    """
    gv = group_view(group)
    r = gv.rank
    dev = torch.device(device) if device is not None else comm.default_device(group)
    out, inp = torch.full((numel,), float(gv.glob(r)), device=dev), torch.empty(numel, device=dev)
    comm.send(out, gv.glob(r + 1), group=group, label="blocking_ring")
    comm.recv(inp, gv.glob(r - 1), group=group, label="blocking_ring")  # never reached: the send above waits forever
    return inp


def ordered_ring_exchange(comm: Comm, numel: int, group: Any = None, mode: str = "even_odd",
                          device: torch.device | str | None = None) -> torch.Tensor:
    """Pass a tensor (this rank's global rank, repeated) to the right without deadlock; return the left's tensor.

    ``mode="even_odd"``: even ranks send first, odd ranks receive first (blocking
    calls). ``mode="isend"``: post receive and send together (one
    ``batch_isend_irecv``), then wait for both. Tensors live on ``device`` (default:
    ``comm.default_device(group)``).
    """
    if mode not in ("even_odd", "isend"):
        raise ValueError(f"mode must be 'even_odd' or 'isend', got {mode!r}")
    gv = group_view(group)
    r = gv.rank
    dev = torch.device(device) if device is not None else comm.default_device(group)
    out, inp = torch.full((numel,), float(gv.glob(r)), device=dev), torch.empty(numel, device=dev)
    right, left = gv.glob(r + 1), gv.glob(r - 1)
    if mode == "isend":
        exchange(comm, gv, out, r + 1, inp, r - 1, "ordered_ring")
    elif r % 2 == 0:
        comm.send(out, right, group=group, label="ordered_ring")
        comm.recv(inp, left, group=group, label="ordered_ring")
    else:
        comm.recv(inp, left, group=group, label="ordered_ring")
        comm.send(out, right, group=group, label="ordered_ring")
    return inp
