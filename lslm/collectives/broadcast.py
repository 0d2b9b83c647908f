"""Broadcast from send/recv: the flat version (root talks to everyone) and the binomial tree.

Cost model used in every docstring of :mod:`lslm.collectives`: sending an N-byte
message costs ``alpha + N beta`` (alpha: per-message latency, beta: seconds per
byte); reducing N bytes costs ``N gamma``. Messages a rank sends one after the
other add up; messages on different links at the same time overlap.
"""

from __future__ import annotations

from typing import Any

import torch

from lslm.collectives.barrier import agree
from lslm.collectives.p2p import (
    GroupView,
    as_flat,
    binomial_children,
    binomial_parent,
    exchange,
    group_view,
    recv_all,
    resolve,
    send_all,
    write_back,
)
from lslm.runtime.ledger import Comm


def broadcast_flat(tensor: torch.Tensor, src: int, comm: Comm | None = None, group: Any = None, *,
                   check: bool = True) -> torch.Tensor:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place; returns ``tensor``.

    The root posts one send of the whole tensor to each of the other n-1 ranks, then
    waits for them all; every other rank posts one receive from the root. Nothing
    cycles (only the root sends), so nothing can deadlock. The root's link carries
    all the traffic: cost (n-1)(alpha + N beta). The root sends (n-1)·N bytes, every
    other rank receives N bytes and sends nothing.

    ``check`` first compares numel, dtype and root across ranks (see
    :func:`~lslm.collectives.barrier.agree`); a disagreement or a missing rank raises
    :class:`~lslm.collectives.p2p.CollectiveError`.
    """
    comm, gv = resolve(comm), group_view(group)
    root = gv.group_rank_of(src, "src")
    flat = as_flat(tensor)
    if check:
        agree(comm, gv, "broadcast_flat", flat.numel(), flat.dtype, root, device=flat.device)
    if gv.rank == root:
        send_all(comm, gv, [(flat, d) for d in range(gv.size) if d != root], "broadcast_flat")
    else:
        recv_all(comm, gv, [(flat, root)], "broadcast_flat")
        write_back(tensor, flat)
    return tensor


def broadcast_tree_flat(comm: Comm, gv: GroupView, flat: torch.Tensor, root: int, name: str) -> None:
    """Binomial-tree broadcast of the 1-D contiguous ``flat`` from group rank ``root`` (no checks).

    Ranks are numbered relative to the root, ``v = (rank - root) mod n``. A rank
    first receives from its parent (``v`` minus its lowest set bit), then sends to
    its children ``v + 2^k`` one after the other, largest subtree first so the
    busiest branch starts earliest.
    """
    n, v = gv.size, (gv.rank - root) % gv.size
    parent = binomial_parent(v, n)
    if parent is not None:
        exchange(comm, gv, None, 0, flat, parent + root, name)
    for child in binomial_children(v, n):
        exchange(comm, gv, flat, child + root, None, 0, name)


def broadcast_tree(tensor: torch.Tensor, src: int, comm: Comm | None = None, group: Any = None, *,
                   check: bool = True) -> torch.Tensor:
    """Binomial-tree broadcast of ``tensor`` from global rank ``src``, in place; returns ``tensor``.

    Round k (k = 0 .. ceil(log2 n) - 1): every rank that already holds the data sends
    it to the rank 2^k further along (relative to the root), so the number of holders
    doubles each round. Each rank receives once from its parent *before* it sends,
    and the tree has no cycles, so blocking in any order is safe: a child's only
    earlier action is its own receive from the same parent.

    Cost: ceil(log2 n)(alpha + N beta), against (n-1)(alpha + N beta) for
    :func:`broadcast_flat`. Bytes: every non-root receives N; a rank sends N to each
    child - the root has ceil(log2 n) children, relative rank v with lowest set bit
    2^j has the children v + 2^i (i < j) that exist, leaves send nothing; in total
    the tree moves (n-1)·N, the same as the flat version, but spread over many links.
    """
    comm, gv = resolve(comm), group_view(group)
    root = gv.group_rank_of(src, "src")
    flat = as_flat(tensor)
    if check:
        agree(comm, gv, "broadcast_tree", flat.numel(), flat.dtype, root, device=flat.device)
    broadcast_tree_flat(comm, gv, flat, root, "broadcast_tree")
    write_back(tensor, flat)
    return tensor
