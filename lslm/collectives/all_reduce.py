"""Three all-reduces from send/recv, each best somewhere.

=========================  ==========================================  =====================
algorithm                  time (alpha-beta-gamma)                     bytes sent per rank
=========================  ==========================================  =====================
reduce + broadcast (tree)  2 ceil(log2 n)(alpha + N beta) + ...        up to 2 ceil(log2 n) N
recursive doubling         log2 n (alpha + N beta + N gamma)           log2 n · N
ring (reduce-scatter +     2(n-1) alpha + 2 (n-1)/n N beta             2 (n-1)/n · N
all-gather)                + (n-1)/n N gamma
=========================  ==========================================  =====================

Few large messages (gradients): the ring wins, its bandwidth term does not grow
with n. Many small messages: recursive doubling wins, it has the fewest rounds.
Reduce + broadcast is the easiest to understand and the slowest of the three.
"""

from __future__ import annotations

from typing import Any

import torch

from lslm.collectives.barrier import agree
from lslm.collectives.broadcast import broadcast_tree_flat
from lslm.collectives.p2p import (
    as_flat,
    check_op,
    chunk_bounds,
    combine_,
    exchange,
    group_view,
    posts_ahead,
    resolve,
    write_back,
)
from lslm.collectives.reduce import reduce_tree_flat
from lslm.collectives.ring import ring_all_gather_flat, ring_reduce_scatter_flat
from lslm.runtime.ledger import Comm


def all_reduce_reduce_broadcast(tensor: torch.Tensor, op: str = "sum", comm: Comm | None = None, group: Any = None,
                                *, check: bool = True) -> torch.Tensor:
    """All-reduce ``tensor`` in place as a binomial-tree reduce onto group rank 0, then a binomial-tree broadcast.

    Every rank ends with the same bits (rank 0 computed them once and sent them).
    Order and deadlock freedom: the reduce only sends up the tree and the broadcast
    only down it, each rank receiving from its children (resp. parent) before it
    sends, so no waiting cycle exists. Cost: 2 ceil(log2 n)(alpha + N beta) +
    ceil(log2 n) N gamma - the full tensor crosses every tree level twice, and the
    root's link carries 2 ceil(log2 n) N. Bytes: a rank with c children in the
    binomial tree rooted at 0 sends and receives (c + [rank != 0]) · N.
    """
    comm, gv = resolve(comm), group_view(group)
    check_op(op)
    flat = as_flat(tensor)
    if check:
        agree(comm, gv, "all_reduce_reduce_broadcast", flat.numel(), flat.dtype, op=op, device=flat.device)
    # The non-root partials may go straight into ``flat``: the broadcast overwrites them.
    reduce_tree_flat(comm, gv, flat, 0, op, "all_reduce_reduce_broadcast", overwrite=True)
    broadcast_tree_flat(comm, gv, flat, 0, "all_reduce_reduce_broadcast")
    write_back(tensor, flat)
    return tensor


def all_reduce_tree(tensor: torch.Tensor, op: str = "sum", comm: Comm | None = None, group: Any = None, *,
                    check: bool = True) -> torch.Tensor:
    """All-reduce ``tensor`` in place by recursive doubling (the butterfly); returns ``tensor``.

    The butterfly is n binomial trees at once, one rooted at every rank: in round k
    rank r swaps its whole partial with rank r XOR 2^k and both fold the other's in,
    so after log2 n rounds every rank holds the full reduction - half the rounds of
    reduce + broadcast and no idle root. Both partners compute a op b and b op a,
    which are the same bits for sum, prod, max and min, so all ranks agree bitwise.

    Non-powers of two (n = p + rem, p the largest power of two below n): first the
    2·rem lowest ranks pair up and each even one hands its tensor to its odd
    neighbour and sits out; the p survivors run the butterfly; then each odd rank
    hands the result back. Order and deadlock freedom: in the butterfly partners
    post receive and send together and wait for both; the fold/unfold steps are
    one-way pairs.

    Cost: log2 n (alpha + N beta + N gamma) when n is a power of two, else
    (floor(log2 n) + 2)(alpha + N beta) + (floor(log2 n) + 1) N gamma. Bytes, with
    k = floor(log2 n): k·N sent and received per rank; with rem > 0, the even ranks
    below 2·rem send and receive N, the odd ones (k+1)·N.
    """
    comm, gv = resolve(comm), group_view(group)
    check_op(op)
    flat = as_flat(tensor)
    if check:
        agree(comm, gv, "all_reduce_tree", flat.numel(), flat.dtype, op=op, device=flat.device)
    n, r, name = gv.size, gv.rank, "all_reduce_tree"
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    buf = torch.empty_like(flat) if n > 1 else flat
    # Fold: the even rank of each of the first rem pairs gives its data to its odd neighbour.
    if r < 2 * rem and r % 2 == 0:
        exchange(comm, gv, flat, r + 1, None, 0, name)
        vr = -1
    elif r < 2 * rem:
        exchange(comm, gv, None, 0, buf, r - 1, name)
        combine_(flat, buf, op)
        vr = r // 2
    else:
        vr = r - rem
    if vr >= 0:
        mask = 1
        while mask < p:
            vpartner = vr ^ mask
            partner = 2 * vpartner + 1 if vpartner < rem else vpartner + rem
            exchange(comm, gv, flat, partner, buf, partner, name)
            combine_(flat, buf, op)
            mask <<= 1
    # Unfold: hand the result back to the ranks that sat out.
    if r < 2 * rem:
        if r % 2:
            exchange(comm, gv, flat, r - 1, None, 0, name)
        else:
            exchange(comm, gv, None, 0, flat, r + 1, name)
    write_back(tensor, flat)
    return tensor


PIPELINE_BYTES = 4 << 20  # measured on gloo/CPU: 4-8 MiB pieces beat both whole chunks and 1 MiB pieces


def all_reduce_ring(tensor: torch.Tensor, op: str = "sum", comm: Comm | None = None, group: Any = None, *,
                    check: bool = True, pipeline_bytes: int | None = PIPELINE_BYTES,
                    post_ahead: bool | None = None) -> torch.Tensor:
    """Ring all-reduce (Baidu / Patarasuk-Yuan) of ``tensor``, in place; returns ``tensor``.

    The flat tensor is cut into n chunks by the array_split rule (any N works). A
    ring reduce-scatter (n-1 steps) leaves chunk r fully reduced on rank r, then a
    ring all-gather (n-1 steps) passes the finished chunks around. In every step
    each rank posts a receive from its left and a send to its right together and
    waits for both, so all n links are busy and nothing deadlocks. Received
    partials are folded into the chunk in place; the all-gather receives straight
    into the tensor; nothing is allocated or concatenated per step. Every rank ends
    with the same bits (each chunk was reduced once, on one rank, then copied).

    Pipelining: chunks travel as pieces of at most ``pipeline_bytes`` (None: whole
    chunks), received into two preallocated piece buffers used in turn, so folding
    piece j overlaps the arrival of piece j+1 (see
    :func:`~lslm.collectives.ring.ring_reduce_scatter_flat` for why this cannot
    deadlock). On gloo/CPU this is what brings a 64 MiB all-reduce from ~0.75x to
    ~1x of ``torch.distributed.all_reduce``; it changes the number of messages, not
    the bytes.

    ``post_ahead``: post receives ahead of the data, one message at a time, instead of
    each step's receive and send together (``None``: on gloo only; NCCL would deadlock,
    see :func:`~lslm.collectives.p2p.posts_ahead`). Same messages, same bytes.

    Cost with P pieces per chunk: 2(n-1) P alpha + 2(n-1)/n N beta + (n-1)/n N gamma,
    the gamma term mostly hidden behind beta - the bandwidth term is almost
    independent of n. Bytes, chunk sizes c_i: rank r sends 2N - c_r - c_(r+1) and
    receives 2N - c_(r-1) - c_r, i.e. exactly 2(n-1)/n · N when n divides N.
    """
    comm, gv = resolve(comm), group_view(group)
    check_op(op)
    if pipeline_bytes is not None and pipeline_bytes < 1:
        raise ValueError(f"pipeline_bytes must be a positive number of bytes or None, got {pipeline_bytes!r}")
    flat = as_flat(tensor)
    if check:
        agree(comm, gv, "all_reduce_ring", flat.numel(), flat.dtype, op=op, device=flat.device)
    if gv.size > 1:
        bounds = chunk_bounds(flat.numel(), gv.size)
        piece = None if pipeline_bytes is None else max(1, pipeline_bytes // flat.element_size())
        ahead = posts_ahead(gv, post_ahead)
        ring_reduce_scatter_flat(comm, gv, flat, bounds, op, "all_reduce_ring", piece, ahead)
        ring_all_gather_flat(comm, gv, flat, bounds, "all_reduce_ring", piece, ahead)
    write_back(tensor, flat)
    return tensor
