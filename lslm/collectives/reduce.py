"""Reduce from send/recv: the binomial tree, a broadcast run backwards."""

from __future__ import annotations

from typing import Any

import torch

from lslm.collectives.barrier import agree
from lslm.collectives.p2p import (
    GroupView,
    as_flat,
    binomial_children,
    binomial_parent,
    check_op,
    combine_,
    exchange,
    group_view,
    resolve,
    write_back,
)
from lslm.runtime.ledger import Comm


def reduce_tree_flat(comm: Comm, gv: GroupView, flat: torch.Tensor, root: int, op: str, name: str,
                     overwrite: bool) -> None:
    """Binomial-tree reduction of the 1-D contiguous ``flat`` onto group rank ``root`` (no checks).

    Relative rank ``v`` receives the partial result of each child subtree, smallest
    first (it is ready first), folds it in, then sends its own partial to its parent.
    The root reduces straight into ``flat``; other ranks reduce into a scratch copy
    unless ``overwrite`` (all-reduce may scribble, the broadcast that follows
    overwrites it anyway), so a caller's input survives on non-root ranks.
    """
    n, v = gv.size, (gv.rank - root) % gv.size
    children = binomial_children(v, n)[::-1]
    acc = flat if (v == 0 or overwrite or not children) else flat.clone()
    if children:
        incoming = torch.empty_like(flat)  # one receive buffer, reused for every child
        for child in children:
            exchange(comm, gv, None, 0, incoming, child + root, name)
            combine_(acc, incoming, op)
    parent = binomial_parent(v, n)
    if parent is not None:
        exchange(comm, gv, acc, parent + root, None, 0, name)


def reduce_tree(tensor: torch.Tensor, dst: int, op: str = "sum", comm: Comm | None = None, group: Any = None, *,
                check: bool = True) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` onto global rank ``dst`` with a binomial tree; returns ``tensor``.

    Semantics: on ``dst`` the result is written into ``tensor`` (in place, like
    ``torch.distributed.reduce``). On every other rank ``tensor`` is left exactly as it
    was: interior ranks of the tree accumulate into a scratch copy, leaves only send.
    ``op`` is ``"sum"``, ``"max"``, ``"min"`` or ``"prod"``. The reduction order is
    fixed by the tree (a rank folds in its children's partials, smallest subtree
    first), so results are deterministic run to run, but floating-point sums may
    differ in the last bits from another algorithm's order.

    Order and deadlock freedom: it is :func:`~lslm.collectives.broadcast.broadcast_tree`
    backwards - a rank first receives from all its children, then sends once to its
    parent. Messages flow only up an acyclic tree, so no rank waits on a rank that
    waits on it. Cost: ceil(log2 n)(alpha + N beta + N gamma). Bytes: every non-root
    sends N once; a rank receives N from each child (the root ceil(log2 n) times).
    """
    comm, gv = resolve(comm), group_view(group)
    root = gv.group_rank_of(dst, "dst")
    check_op(op)
    flat = as_flat(tensor)
    if check:
        agree(comm, gv, "reduce_tree", flat.numel(), flat.dtype, root, op, device=flat.device)
    reduce_tree_flat(comm, gv, flat, root, op, "reduce_tree", overwrite=False)
    if gv.rank == root:
        write_back(tensor, flat)
    return tensor
