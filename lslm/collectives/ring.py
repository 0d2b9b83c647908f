"""Ring all-gather and ring reduce-scatter: n-1 steps, each rank talks only to its neighbours.

Rank r sends to r+1 and receives from r-1 (mod n) in every step, posting the
receive and the send together (:func:`~lslm.collectives.p2p.exchange`). All ranks
send at once, so all n links are busy in every step, and each rank moves only
(n-1)/n of the data: the bandwidth-optimal pattern behind ring all-reduce.
A ring of *blocking* sends (everybody sends first) deadlocks instead: see
:mod:`lslm.collectives.deadlock`.
"""

from __future__ import annotations

from typing import Any

import torch

from lslm.collectives.barrier import agree
from lslm.collectives.p2p import (
    GroupView,
    Pending,
    as_flat,
    check_op,
    chunk_bounds,
    combine_,
    exchange,
    group_view,
    post,
    post_pairs,
    posts_ahead,
    reap,
    resolve,
    split_sends,
    wait_all,
    write_back,
)
from lslm.runtime.ledger import Comm


def _piece(flat: torch.Tensor, bounds: list[tuple[int, int]], i: int) -> torch.Tensor:
    start, stop = bounds[i % len(bounds)]
    return flat[start:stop]


def _pieces(bounds: list[tuple[int, int]], i: int, piece: int) -> list[tuple[int, int]]:
    """Chunk ``i`` (mod n) cut into consecutive pieces of at most ``piece`` elements.

    Sender and receiver cut the same chunk the same way, so piece j of one side's send
    always meets piece j of the other side's receive.
    """
    start, stop = bounds[i % len(bounds)]
    return [(a, min(a + piece, stop)) for a in range(start, stop, max(piece, 1))]


def _cuts(bounds: list[tuple[int, int]], i: int, piece: int | None) -> list[tuple[int, int]]:
    """Chunk ``i`` (mod n) as messages: whole (``piece=None``) or in pieces; empty ones left out on both ends."""
    whole = [bounds[i % len(bounds)]] if piece is None else _pieces(bounds, i, piece)
    return [(a, b) for a, b in whole if b > a]


def _all_gather_ahead(comm: Comm, gv: GroupView, flat: torch.Tensor, bounds: list[tuple[int, int]], name: str,
                      piece: int | None) -> None:
    """:func:`ring_all_gather_flat` with every receive posted before the first send (gloo only)."""
    n, r = gv.size, gv.rank
    # Every receive lands in its own place in ``flat``, so all of them can wait there from the start.
    incoming = [(s, a, b) for s in range(n - 1) for a, b in _cuts(bounds, r - s - 1, piece)]
    recvs = [post(comm, gv, "recv", flat[a:b], r - 1, name) for _, a, b in incoming]
    sends = [(post(comm, gv, "send", flat[a:b], r + 1, name), r + 1, "send") for a, b in _cuts(bounds, r, piece)]
    for (s, a, b), work in zip(incoming, recvs):
        wait_all([(work, r - 1, "recv")], gv, name)
        if s + 1 < n - 1:  # what arrived in step s leaves in step s+1, piece by piece, as soon as it is here
            sends.append((post(comm, gv, "send", flat[a:b], r + 1, name), r + 1, "send"))
        sends = reap(sends, gv, name)
    wait_all(sends, gv, name)


def _reduce_scatter_ahead(comm: Comm, gv: GroupView, flat: torch.Tensor, bounds: list[tuple[int, int]], op: str,
                          name: str, piece: int | None) -> None:
    """:func:`ring_reduce_scatter_flat` with each receive posted before the previous piece is folded (gloo only)."""
    n, r = gv.size, gv.rank
    incoming = [(s, a, b) for s in range(n - 1) for a, b in _cuts(bounds, r - s - 2, piece)]
    size = max((b - a for _, a, b in incoming), default=0)
    bufs = [comm.scratch(size, flat.dtype, flat.device, slot) for slot in (0, 1)]
    sends = [(post(comm, gv, "send", flat[a:b], r + 1, name), r + 1, "send") for a, b in _cuts(bounds, r - 1, piece)]
    nxt = post(comm, gv, "recv", bufs[0][: incoming[0][2] - incoming[0][1]], r - 1, name) if incoming else None
    for m, (s, a, b) in enumerate(incoming):
        wait_all([(nxt, r - 1, "recv")], gv, name)
        if m + 1 < len(incoming):  # into the other buffer, whose piece was folded one iteration ago
            _, a2, b2 = incoming[m + 1]
            nxt = post(comm, gv, "recv", bufs[(m + 1) % 2][: b2 - a2], r - 1, name)
        combine_(flat[a:b], bufs[m % 2][: b - a], op)
        if s + 1 < n - 1:  # this piece of chunk r-s-2 is now step s+1's send
            sends.append((post(comm, gv, "send", flat[a:b], r + 1, name), r + 1, "send"))
        sends = reap(sends, gv, name)
    wait_all(sends, gv, name)


def ring_all_gather_flat(comm: Comm, gv: GroupView, flat: torch.Tensor, bounds: list[tuple[int, int]], name: str,
                         piece: int | None = None, ahead: bool = False) -> None:
    """In place on ``flat``: chunk r of rank r ends up on every rank (no checks).

    Step s: send chunk r-s (received in the step before, or our own at s=0) to the
    right, receive chunk r-s-1 from the left straight into its place - no buffer.
    With ``piece``, each chunk travels as several messages of at most ``piece`` elements.

    A step waits for its receive only: what step s+1 sends is what step s received. The
    sends are waited for at the end (those already done as soon as they are seen done),
    because no later step writes into a chunk that an earlier step sent. On
    oversubscribed CPUs each wait that finds its peer not yet scheduled costs a context
    switch, and the send of a step is often still draining when its receive is complete.

    ``ahead`` (gloo only, see :func:`~lslm.collectives.p2p.posts_ahead`): all n-1
    receives are posted first, each straight into its place, and every piece is sent on
    as soon as it has arrived. Deadlock-free because a rank's k-th send needs only its
    own (k-1)-th receive, which its left neighbour's (k-1)-th send feeds.
    """
    if ahead:
        _all_gather_ahead(comm, gv, flat, bounds, name, piece)
        return
    n, r = gv.size, gv.rank
    sends: list[Pending] = []
    for s in range(n - 1):
        # One batch per step: every piece's receive and send progress together (one NCCL group).
        items = [("recv", flat[a:b], r - 1) for a, b in _cuts(bounds, r - s - 1, piece)]
        items += [("send", flat[a:b], r + 1) for a, b in _cuts(bounds, r - s, piece)]
        recvs, posted = split_sends(post_pairs(comm, gv, items, name))
        wait_all(recvs, gv, name)
        sends = reap(sends + posted, gv, name)
    wait_all(sends, gv, name)


def ring_reduce_scatter_flat(comm: Comm, gv: GroupView, flat: torch.Tensor, bounds: list[tuple[int, int]], op: str,
                             name: str, piece: int | None = None, ahead: bool = False) -> None:
    """In place on ``flat``: afterwards chunk r of rank r holds the reduction over all ranks (no checks).

    Step s: send the partial of chunk r-s-1 to the right, receive the partial of
    chunk r-s-2 from the left and fold it into our own copy of that chunk - which we
    then send in step s+1. After n-1 steps the chunk received last, r-n = r, has
    passed through every rank. Other chunks of ``flat`` are left holding partials.

    Pipelining: each chunk travels as pieces of at most ``piece`` elements (default:
    the whole chunk). Piece j's receive (from the left) and send (to the right) are
    posted together, one ``batch_isend_irecv``, and piece j+1's pair is posted before
    piece j is waited for and folded in: received pieces go into two piece-sized
    buffers used in turn, so while piece j is being folded in, piece j+1 is already
    arriving - the reduction hides behind the transfer. The buffers are the Comm's
    :meth:`~lslm.runtime.ledger.Comm.scratch`, kept between calls (a fresh one costs page
    faults on every call).
    No deadlock, on gloo or NCCL: every rank posts its pairs in the same piece order,
    pair j of a rank sends exactly what its right neighbour's pair j receives (the
    chunk one rank sends is the chunk its neighbour receives, cut the same way), and
    a rank only waits for pair j after posting pair j+1, which needs nothing but its
    own progress. In a 2-rank ring left and right are the same peer, which is why the
    pairs must be batched (see :func:`~lslm.collectives.p2p.post_pairs`).

    Only receives are waited for inside the loop (a fold needs its piece; a send needs
    the fold before it, which ran on this thread). Sends are waited for when seen done
    and all of them before returning: no step writes into a chunk an earlier step sent
    (step s sends chunk r-s-1 and folds into chunk r-s-2), but the caller's all-gather
    receives into those chunks.

    ``ahead`` (gloo only, see :func:`~lslm.collectives.p2p.posts_ahead`): messages are
    posted one by one, each receive before the previous piece is folded, so the data
    finds its buffer waiting instead of queuing in the transport. Step 0's sends (raw
    input) go out at once; every later piece is sent the moment its fold is done. On 4
    gloo processes sharing 2 cores, back-to-back 16 MiB all-reduces ran a few percent
    faster this way than with step pairs; timed one call at a time (``lslm bench
    collectives``: ``all_reduce_ring`` next to ``all_reduce_ring[paired]``) the two differ
    by less than that machine's run-to-run spread.
    """
    n, r = gv.size, gv.rank
    if n == 1 or flat.numel() == 0:
        return
    if ahead:
        _reduce_scatter_ahead(comm, gv, flat, bounds, op, name, piece)
        return
    biggest = max(b - a for a, b in bounds)
    piece = biggest if piece is None else max(1, min(piece, biggest))
    # Two buffers only when some chunk has several pieces (one is enough otherwise).
    bufs = [comm.scratch(piece, flat.dtype, flat.device, slot) for slot in range(1 if piece == biggest else 2)]
    sends: list[Pending] = []
    for s in range(n - 1):
        incoming, outgoing = _pieces(bounds, r - s - 2, piece), _pieces(bounds, r - s - 1, piece)
        steps = max(len(incoming), len(outgoing))

        def post_pair(j: int, incoming: list[tuple[int, int]] = incoming,
                      outgoing: list[tuple[int, int]] = outgoing) -> list[tuple[Any, int, str]]:
            items = []
            if j < len(incoming):
                a, b = incoming[j]
                items.append(("recv", bufs[j % len(bufs)][: b - a], r - 1))
            if j < len(outgoing):
                a, b = outgoing[j]
                items.append(("send", flat[a:b], r + 1))
            return post_pairs(comm, gv, items, name)

        pending = {0: post_pair(0)} if steps else {}
        for j in range(steps):
            if j + 1 < steps:
                pending[j + 1] = post_pair(j + 1)
            recvs, posted = split_sends(pending.pop(j))
            wait_all(recvs, gv, name)
            sends = reap(sends + posted, gv, name)
            if j < len(incoming):
                a, b = incoming[j]
                combine_(flat[a:b], bufs[j % len(bufs)][: b - a], op)
    # The caller may write into the chunks sent here (the all-gather receives into them).
    wait_all(sends, gv, name)


def all_gather_ring(output: torch.Tensor, input: torch.Tensor, comm: Comm | None = None, group: Any = None, *,
                    check: bool = True, post_ahead: bool | None = None) -> torch.Tensor:
    """Gather every rank's ``input`` into ``output`` (n x input.numel() elements, rank order); returns ``output``.

    ``output`` is written in place on every rank; ``input`` is only read (it may be
    ``output``'s own block, as in torch's in-place all-gather). Rank r first copies
    its input to block r, then in step s = 0..n-2 sends block r-s to the right while
    receiving block r-s-1 from the left (receive and send posted together, so the
    ring cannot deadlock). Cost: (n-1)(alpha + M beta) for M-byte inputs. Bytes:
    every rank sends and receives (n-1)·M. ``post_ahead``: post every receive first
    (``None``: on gloo only; see :func:`~lslm.collectives.p2p.posts_ahead`).
    """
    comm, gv = resolve(comm), group_view(group)
    n = gv.size
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather_ring: output has {output.numel()} elements, expected group size x "
                         f"input.numel() = {n} x {input.numel()} = {n * input.numel()}")
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(f"all_gather_ring: output ({output.dtype}, {output.device}) and input "
                         f"({input.dtype}, {input.device}) must have the same dtype and device")
    m = input.numel()
    if check:
        agree(comm, gv, "all_gather_ring", m, input.dtype, device=input.device)
    flat = as_flat(output)
    bounds = [(i * m, (i + 1) * m) for i in range(n)]
    _piece(flat, bounds, gv.rank).copy_(input.reshape(-1))
    ring_all_gather_flat(comm, gv, flat, bounds, "all_gather_ring", ahead=posts_ahead(gv, post_ahead))
    write_back(output, flat)
    return output


def reduce_scatter_ring(output: torch.Tensor, input: torch.Tensor, op: str = "sum", comm: Comm | None = None,
                        group: Any = None, *, check: bool = True) -> torch.Tensor:
    """Reduce the flat ``input`` (N elements) over ``group``; ``output`` gets chunk ``rank``; returns ``output``.

    Chunks follow the array_split rule (the first N % n chunks are one element
    longer), so N need not divide by n: ``output.numel()`` must equal this rank's
    chunk size. ``input`` is not modified (partials live in two chunk-sized buffers).

    Step s = 0..n-2: send the partial of chunk r-s-1 to the right, receive the partial
    of chunk r-s-2 from the left and fold our own input chunk into it; the last step
    receives chunk r, folds it and copies it into ``output`` (which may therefore be a
    view of ``input``'s chunk r). Receive and send are posted
    together, so the ring cannot deadlock. Two buffers alternate because the partial
    received in step s is sent in step s+1 while step s+1's receive arrives.
    Cost: (n-1)(alpha + (N/n) beta + (N/n) gamma). Bytes: rank r sends every chunk
    but its own, N - c_r, and receives every chunk but chunk r-1, N - c_(r-1).
    """
    comm, gv = resolve(comm), group_view(group)
    check_op(op)
    n, r = gv.size, gv.rank
    bounds = chunk_bounds(input.numel(), n)
    mine = bounds[r][1] - bounds[r][0]
    if output.numel() != mine:
        raise ValueError(f"reduce_scatter_ring: output has {output.numel()} elements, but chunk {r} of "
                         f"{input.numel()} elements over {n} ranks has {mine} (the first N % n chunks get one extra)")
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(f"reduce_scatter_ring: output ({output.dtype}, {output.device}) and input "
                         f"({input.dtype}, {input.device}) must have the same dtype and device")
    if check:
        agree(comm, gv, "reduce_scatter_ring", input.numel(), input.dtype, op=op, device=input.device)
    src, out = as_flat(input), as_flat(output)
    if n == 1:
        out.copy_(src)
    else:
        size = max(b - a for a, b in bounds)
        bufs = (comm.scratch(size, src.dtype, src.device, 0), comm.scratch(size, src.dtype, src.device, 1))
        sending = _piece(src, bounds, r - 1)  # step 0 sends our raw input chunk r-1
        for s in range(n - 1):
            chunk = (r - s - 2) % n
            incoming = bufs[s % 2][: bounds[chunk][1] - bounds[chunk][0]]
            exchange(comm, gv, sending, r + 1, incoming, r - 1, "reduce_scatter_ring")
            combine_(incoming, _piece(src, bounds, chunk), op)
            sending = incoming
        # The last partial goes through a buffer too (one chunk-sized copy), so that
        # ``output`` may alias ``input``'s chunk r, as torch allows.
        out.copy_(sending)
    write_back(output, out)
    return output
