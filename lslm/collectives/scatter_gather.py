"""Scatter and gather from send/recv: flat, the root talks to every other rank directly.

Both move (n-1)·M bytes through the root's link for blocks of M bytes, which is
also the minimum: every block but the root's own has to cross it. A tree would
only save latency (ceil(log2 n) alpha instead of (n-1) alpha), at the price of
forwarding whole sub-lists; we keep the flat form, the one worth reading first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lslm.collectives.barrier import agree
from lslm.collectives.p2p import as_flat, group_view, recv_all, resolve, send_all, write_back
from lslm.runtime.ledger import Comm


def _check_list(items: Sequence[torch.Tensor] | None, like: torch.Tensor, n: int, what: str,
                need_contiguous: bool) -> None:
    if items is None or len(items) != n:
        raise ValueError(f"{what} must be a list of {n} tensors (one per rank of the group) on the root, "
                         f"got {None if items is None else len(items)}")
    for i, t in enumerate(items):
        if t.numel() != like.numel() or t.dtype != like.dtype or t.device != like.device:
            raise ValueError(f"{what}[{i}] has {t.numel()} {t.dtype} elements on {t.device}; every item must match "
                             f"this rank's tensor: {like.numel()} {like.dtype} elements on {like.device}")
        if need_contiguous and not t.is_contiguous():
            raise ValueError(f"{what}[{i}] is not contiguous: messages are received straight into it")


def scatter(output: torch.Tensor, scatter_list: Sequence[torch.Tensor] | None, src: int, comm: Comm | None = None,
            group: Any = None, *, check: bool = True) -> torch.Tensor:
    """Rank i of ``group`` receives ``scatter_list[i]`` from global rank ``src`` into ``output``; returns ``output``.

    ``scatter_list`` is read on the root only (n tensors shaped like ``output``) and
    ignored elsewhere. ``output`` is written in place on every rank, the root
    included (it copies its own item). The root posts its n-1 sends at once and waits
    for them; each other rank posts one receive. Only the root sends, so there is no
    cycle and no deadlock. Cost: (n-1)(alpha + M beta) on the root's link. Bytes: the
    root sends (n-1)·M, every other rank receives M.
    """
    comm, gv = resolve(comm), group_view(group)
    root = gv.group_rank_of(src, "src")
    if gv.rank == root:
        _check_list(scatter_list, output, gv.size, "scatter_list", need_contiguous=False)
    flat = as_flat(output)
    if check:
        agree(comm, gv, "scatter", flat.numel(), flat.dtype, root, device=flat.device)
    if gv.rank == root:
        assert scatter_list is not None  # checked above
        flat.copy_(scatter_list[root].reshape(-1))
        items = [(as_flat(scatter_list[d]), d) for d in range(gv.size) if d != root]
        send_all(comm, gv, items, "scatter")
    else:
        recv_all(comm, gv, [(flat, root)], "scatter")
    write_back(output, flat)
    return output


def gather(tensor: torch.Tensor, gather_list: Sequence[torch.Tensor] | None, dst: int, comm: Comm | None = None,
           group: Any = None, *, check: bool = True) -> Sequence[torch.Tensor] | None:
    """Global rank ``dst`` receives rank i's ``tensor`` into ``gather_list[i]``; returns ``gather_list`` there.

    ``gather_list`` (n contiguous tensors shaped like ``tensor``) is needed on the root
    only; other ranks may pass None and get None back. ``tensor`` is never modified.
    The root posts its n-1 receives at once, straight into the list's tensors, then
    waits; every other rank posts one send. Only the root receives, so no cycle and no
    deadlock. Cost: (n-1)(alpha + M beta) on the root's link. Bytes: every non-root
    sends M, the root receives (n-1)·M.
    """
    comm, gv = resolve(comm), group_view(group)
    root = gv.group_rank_of(dst, "dst")
    if gv.rank == root:
        _check_list(gather_list, tensor, gv.size, "gather_list", need_contiguous=True)
    flat = as_flat(tensor)
    if check:
        agree(comm, gv, "gather", flat.numel(), flat.dtype, root, device=flat.device)
    if gv.rank != root:
        send_all(comm, gv, [(flat, root)], "gather")
        return None
    assert gather_list is not None  # checked above
    gather_list[root].view(-1).copy_(flat)
    recv_all(comm, gv, [(gather_list[s].view(-1), s) for s in range(gv.size) if s != root], "gather")
    return gather_list
