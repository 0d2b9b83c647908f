"""Shared plumbing for collectives built from point-to-point messages.

Everything in :mod:`lslm.collectives` talks through the helpers defined here:

* :func:`group_view` - this rank's place in a process group and the *global* rank
  of every member (``Comm.send`` wants global ranks; algorithms think in group ranks).
* :func:`exchange` / :func:`post_pairs` - post a receive and a send together (one
  ``batch_isend_irecv``), then wait for both. Because neither call blocks and they
  form one NCCL group, two ranks that exchange with each other (or a whole ring that
  shifts data one step) cannot deadlock, whatever the message size and backend.
  On gloo the rings may instead post receives ahead of the data, one message at a
  time (:func:`posts_ahead`); sends that are not needed yet are waited for later
  (:func:`split_sends`, :func:`reap`), but always before the call returns.
* :func:`chunk_sizes` / :func:`chunk_bounds` - the ``numpy.array_split`` rule: ``N``
  elements over ``n`` ranks, the first ``N % n`` chunks one element longer. Every
  rank computes the same boundaries, so no sizes ever travel on the wire.
* :func:`as_flat` / :func:`write_back` - algorithms work on a 1-D contiguous tensor
  and slice it into views; a non-contiguous input is copied once and written back.

A p2p wait that fails (gloo's timeout, a peer that crashed or left) is re-raised
as :class:`CollectiveError`, which names the collective, this rank and the peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lslm.runtime.ledger import Comm

OPS = ("sum", "max", "min", "prod")

TIMEOUT_HINT = ("a peer did not answer within the timeout: mismatched shapes across ranks, "
                "or a rank that never called the collective")


class CollectiveError(RuntimeError):
    """A collective could not complete: a peer timed out, left, or disagreed about the call."""


@dataclass(frozen=True)
class GroupView:
    """This process's view of a process group: its group rank and every member's global rank."""

    group: Any  # the ProcessGroup passed to Comm (None means the default group)
    ranks: tuple[int, ...]  # ranks[i] is the global rank of group rank i
    rank: int  # this process's rank inside the group

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    def glob(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` (taken modulo the group size, which rings rely on)."""
        return self.ranks[group_rank % len(self.ranks)]

    def group_rank_of(self, global_rank: int, what: str) -> int:
        """Group rank of the global rank ``global_rank``; ValueError if it is not a member."""
        if isinstance(global_rank, bool) or not isinstance(global_rank, int):
            raise ValueError(f"{what} must be an int (a global rank), got {global_rank!r}")
        if global_rank not in self.ranks:
            raise ValueError(f"{what}={global_rank} is not a member of the group (its global ranks are "
                             f"{list(self.ranks)})")
        return self.ranks.index(global_rank)

    def me(self) -> str:
        """'rank G (group rank r)' for error messages."""
        return f"rank {self.ranks[self.rank]} (group rank {self.rank} of {self.size})"


def group_view(group: Any = None) -> GroupView:
    """Describe ``group`` (None = the default group) from this rank's side.

    Raises RuntimeError when torch.distributed is not initialised and ValueError when
    this rank is not a member (a non-member has no part to play in a collective).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call lslm.runtime.init_distributed() first")
    pg = dist.group.WORLD if group is None else group
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the group it was asked to use")
    size = dist.get_world_size(pg)
    ranks = tuple(dist.get_global_rank(pg, i) for i in range(size))
    return GroupView(group=group, ranks=ranks, rank=rank)


def posts_ahead(gv: GroupView, post_ahead: bool | None) -> bool:
    """Whether a ring may post its receives ahead of its sends, one by one (``None``: only on gloo).

    gloo runs every isend/irecv on its own, so a receive posted before the data leaves
    lets the transport read it straight into place; NCCL runs separately posted p2p
    operations in order on one stream, where a receive posted ahead of the matching
    send *of the same rank* can wait forever (see :func:`post_pairs`), so there the
    rings post each step's receive and send together.
    """
    if post_ahead is not None:
        if not isinstance(post_ahead, bool):
            raise ValueError(f"post_ahead must be True, False or None (auto: gloo only), got {post_ahead!r}")
        return post_ahead
    return str(dist.get_backend(gv.group)) == "gloo"


def resolve(comm: Comm | None) -> Comm:
    """The caller's Comm, or a fresh one (its own ledger then records this call, and only this call)."""
    return comm if comm is not None else Comm()


def check_op(op: str) -> str:
    """Validate a reduction name (``"sum"``, ``"max"``, ``"min"``, ``"prod"``)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op


def combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
    """``acc = acc (op) other`` in place, without allocating (the inner loop of every reduction)."""
    if op == "sum":
        return acc.add_(other)
    if op == "prod":
        return acc.mul_(other)
    if op == "max":
        return torch.maximum(acc, other, out=acc)
    return torch.minimum(acc, other, out=acc)


# -- chunking ------------------------------------------------------------------------
def chunk_sizes(numel: int, n: int) -> list[int]:
    """Sizes of ``numel`` elements split over ``n`` ranks: the first ``numel % n`` get one extra."""
    base, extra = divmod(numel, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of the ``n`` chunks of :func:`chunk_sizes`."""
    bounds, start = [], 0
    for size in chunk_sizes(numel, n):
        bounds.append((start, start + size))
        start += size
    return bounds


# -- flat working copies -------------------------------------------------------------
def as_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor with ``t``'s elements: a view when ``t`` is contiguous, else one copy."""
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def write_back(t: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``t`` when :func:`as_flat` had to copy (a no-op for a view)."""
    if not t.is_contiguous():
        t.copy_(flat.view(t.shape))


# -- point to point ------------------------------------------------------------------
def wait_all(pending: Sequence[tuple[Any, int, str]], gv: GroupView, name: str) -> None:
    """Wait for ``(work, peer_group_rank, "send"|"recv")`` handles; turn backend failures into CollectiveError."""
    for work, peer, kind in pending:
        try:
            work.wait()
        except RuntimeError as exc:
            raise _peer_error(gv, name, peer, kind, exc) from exc


Pending = tuple[Any, int, str]  # (work, peer group rank, "send" | "recv"), as post_pairs returns them


def split_sends(pending: Sequence[Pending]) -> tuple[list[Pending], list[Pending]]:
    """``(receives, sends)`` of a :func:`post_pairs` result (a coalesced NCCL batch counts as a receive)."""
    return [p for p in pending if p[2] != "send"], [p for p in pending if p[2] == "send"]


def reap(pending: list[Pending], gv: GroupView, name: str) -> list[Pending]:
    """Wait for the handles in ``pending`` that have already completed (no blocking); return the others.

    Lets a loop that defers its send waits stamp each send's completion close to when it
    happened (the ledger's overlap figures read those times) without ever sleeping on one.
    """
    done: list[Pending] = []
    rest: list[Pending] = []
    for p in pending:
        (done if p[0].is_completed() else rest).append(p)
    wait_all(done, gv, name)
    return rest


def _peer_error(gv: GroupView, name: str, peer: int, kind: str, exc: BaseException) -> CollectiveError:
    direction = "to" if kind == "send" else "from"
    return CollectiveError(f"{name}: {gv.me()} could not {kind} {direction} rank {gv.glob(peer)} "
                           f"(group rank {peer % gv.size}): {TIMEOUT_HINT}. The backend said: {exc}")


def post(comm: Comm, gv: GroupView, kind: str, t: torch.Tensor, peer: int, name: str, label: str | None = None) -> Any:
    """isend (``kind="send"``) or irecv ``t`` to/from group rank ``peer``; return the work handle.

    ``name`` (the collective) goes into error messages and, unless ``label`` is given,
    into the ledger record's label. Posting can fail too (gloo notices a closed
    connection when it writes), so it is wrapped like a wait.
    """
    try:
        if kind == "send":
            return comm.isend(t, gv.glob(peer), group=gv.group, label=label or name)
        return comm.irecv(t, gv.glob(peer), group=gv.group, label=label or name)
    except RuntimeError as exc:
        raise _peer_error(gv, name, peer, kind, exc) from exc


def exchange(comm: Comm, gv: GroupView, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
             name: str, label: str | None = None) -> None:
    """Send ``send`` to group rank ``dst`` while receiving ``recv`` from group rank ``src``; wait for both.

    The receive and the send are posted together, as one ``batch_isend_irecv`` (one
    NCCL group), and neither blocks, so any pattern in which every send has a
    matching receive completes: a ring where every rank sends right and receives
    left, or two ranks swapping. (With a blocking ``send`` first on every rank, gloo
    deadlocks at any size: its sender waits until the receiver has posted the
    matching receive. NCCL deadlocks even with *non-blocking* calls posted one by one
    when both go to the same peer, as in a 2-rank ring: see :func:`post_pairs`.)
    ``None`` or a 0-element tensor skips that side: both ends compute the same sizes,
    so they skip together; a one-sided exchange is a single isend or irecv.
    """
    pairs = []
    if recv is not None and recv.numel() > 0:
        pairs.append(("recv", recv, src))
    if send is not None and send.numel() > 0:
        pairs.append(("send", send, dst))
    wait_all(post_pairs(comm, gv, pairs, name, label), gv, name)


def post_pairs(comm: Comm, gv: GroupView, items: Sequence[tuple[str, torch.Tensor, int]], name: str,
               label: str | None = None) -> list[tuple[Any, int, str]]:
    """Post ``(kind, tensor, peer_group_rank)`` sends/receives *together*; return the pending handles.

    Several items go through one ``batch_isend_irecv`` (on NCCL one group, in which
    every operation progresses at once; on gloo plain isend/irecv calls). This is how
    every lslm send and receive that belong together must be posted: NCCL runs the
    separately posted p2p kernels of one pair of ranks in order on one stream, so two
    ranks that each post a receive and then a send to the other would each wait for
    the other's send, queued behind its receive, once messages are too large for
    NCCL's eager buffers. Every returned handle must be waited on (:func:`wait_all`).
    """
    if not items:
        return []
    if len(items) == 1:
        kind, t, peer = items[0]
        return [(post(comm, gv, kind, t, peer, name, label), peer, kind)]
    ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, gv.glob(peer), group=gv.group)
           for kind, t, peer in items]
    try:
        works = comm.batch_isend_irecv(ops, label=label or name)
    except RuntimeError as exc:
        raise _peer_error(gv, name, items[0][2], items[0][0], exc) from exc
    if len(works) == len(items):
        return [(w, peer, kind) for w, (kind, _, peer) in zip(works, items)]
    # NCCL coalesces the batch into one work: blame the first peer if it fails.
    return [(w, items[0][2], items[0][0]) for w in works]


def send_all(comm: Comm, gv: GroupView, items: Sequence[tuple[torch.Tensor, int]], name: str) -> None:
    """Post every ``(tensor, dst_group_rank)`` send at once, then wait for all of them."""
    pending = [(post(comm, gv, "send", t, dst, name), dst, "send") for t, dst in items if t.numel() > 0]
    wait_all(pending, gv, name)


def recv_all(comm: Comm, gv: GroupView, items: Sequence[tuple[torch.Tensor, int]], name: str) -> None:
    """Post every ``(tensor, src_group_rank)`` receive at once, then wait for all of them."""
    pending = [(post(comm, gv, "recv", t, src, name), src, "recv") for t, src in items if t.numel() > 0]
    wait_all(pending, gv, name)


# -- binomial trees --------------------------------------------------------------------
def binomial_parent(v: int, n: int) -> int | None:
    """Parent of relative rank ``v`` (root = 0) in the binomial tree on ``n`` ranks: ``v`` minus its lowest set bit."""
    return None if v == 0 else v - (v & -v)


def binomial_children(v: int, n: int) -> list[int]:
    """Children of relative rank ``v``, largest subtree first: ``v + 2^k`` for each 2^k below v's lowest set bit.

    The root's children are 1, 2, 4, ... (all powers of two below ``n``), so a
    broadcast reaches every rank in ceil(log2 n) rounds: in round k every rank that
    already has the data sends it 2^k further.
    """
    limit = (v & -v) if v else 1 << max(n - 1, 0).bit_length()
    kids, mask = [], limit >> 1
    while mask >= 1:
        if v + mask < n:
            kids.append(v + mask)
        mask >>= 1
    return kids


def ceil_log2(n: int) -> int:
    """Smallest k with 2^k >= n (0 for n = 1): the number of rounds of a tree or a dissemination."""
    return max(n - 1, 0).bit_length()
