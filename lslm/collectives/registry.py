"""ALGORITHMS: every collective of this package with its kind, its cost and its exact byte counts.

For benchmarks and plots: ``ALGORITHMS["all_reduce_ring"].sent(n=4, rank=1, numel=10, elem_size=4)`` is
the number of bytes rank 1 of 4 puts on the wire (what ``comm.ledger`` records as
"send"), uneven chunks included. Ranks and roots here are *group* ranks.

What ``numel`` means depends on the kind:

* all_reduce, broadcast, reduce, reduce_scatter, all_to_all: the tensor / the input (N);
* all_gather, scatter, gather: one rank's block (M), the output holding n blocks.

With ``check=True`` (the default of every collective) each call also runs the
agreement of :func:`~lslm.collectives.barrier.agree`: ceil(log2 n) messages of
:data:`~lslm.collectives.barrier.CHECK_MESSAGE_BYTES` sent and received per
rank, tagged ``"shape-check"`` in the ledger. ``sent(..., check=True)`` adds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lslm.collectives.all_reduce import all_reduce_reduce_broadcast, all_reduce_ring, all_reduce_tree
from lslm.collectives.all_to_all import all_to_all_pairwise
from lslm.collectives.barrier import CHECK_MESSAGE_BYTES
from lslm.collectives.broadcast import broadcast_flat, broadcast_tree
from lslm.collectives.p2p import binomial_children, ceil_log2, chunk_sizes
from lslm.collectives.reduce import reduce_tree
from lslm.collectives.ring import all_gather_ring, reduce_scatter_ring
from lslm.collectives.scatter_gather import gather, scatter

KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "scatter", "gather")

# A byte formula: (n, rank, numel, root) -> number of *elements* moved; Algorithm scales by elem_size.
Formula = Callable[[int, int, int, int], int]


@dataclass(frozen=True)
class Algorithm:
    """One collective algorithm: its function, kind, alpha-beta cost and per-rank byte formulas."""

    name: str
    kind: str
    fn: Callable[..., Any]
    cost: str  # time in the alpha-beta(-gamma) model, N = message bytes
    sent_elems: Formula
    recv_elems: Formula

    def sent(self, n: int, rank: int, numel: int, elem_size: int = 4, root: int = 0, *, check: bool = False) -> int:
        """Bytes group rank ``rank`` of ``n`` sends for a message of ``numel`` elements (see module doc)."""
        extra = check_bytes(n) if check else 0
        return self.sent_elems(n, rank, numel, root) * elem_size + extra

    def received(self, n: int, rank: int, numel: int, elem_size: int = 4, root: int = 0, *,
                 check: bool = False) -> int:
        """Bytes group rank ``rank`` of ``n`` receives for a message of ``numel`` elements."""
        extra = check_bytes(n) if check else 0
        return self.recv_elems(n, rank, numel, root) * elem_size + extra


def check_bytes(n: int) -> int:
    """Bytes each rank sends (and receives) for the cross-rank agreement check: ceil(log2 n) x 80."""
    return ceil_log2(n) * CHECK_MESSAGE_BYTES


def barrier_bytes(n: int) -> int:
    """Bytes each rank sends (and receives) in :func:`~lslm.collectives.barrier.barrier`: one per round."""
    return ceil_log2(n)


def _rel(rank: int, root: int, n: int) -> int:
    return (rank - root) % n


def _kids(n: int, rank: int, root: int) -> int:
    return len(binomial_children(_rel(rank, root, n), n))


def _butterfly(n: int, rank: int) -> int:
    # Messages of N elements rank sends (= receives) in recursive doubling; see all_reduce_tree.
    k = n.bit_length() - 1
    rem = n - (1 << k)
    if rank < 2 * rem:
        return 1 if rank % 2 == 0 else k + 1
    return k


def _ring_sent(n: int, r: int, numel: int) -> int:
    c = chunk_sizes(numel, n)
    return 2 * numel - c[r] - c[(r + 1) % n]


def _ring_recv(n: int, r: int, numel: int) -> int:
    c = chunk_sizes(numel, n)
    return 2 * numel - c[(r - 1) % n] - c[r]


def _entries() -> list[Algorithm]:
    root_only = lambda n, r, m, root: (n - 1) * m if r == root else 0  # noqa: E731 - a table of formulas
    non_root = lambda n, r, m, root: 0 if r == root else m  # noqa: E731
    return [
        Algorithm("broadcast_flat", "broadcast", broadcast_flat, "(n-1)(alpha + N beta)", root_only, non_root),
        Algorithm("broadcast_tree", "broadcast", broadcast_tree, "ceil(log2 n)(alpha + N beta)",
                  lambda n, r, m, root: _kids(n, r, root) * m, non_root),
        Algorithm("reduce_tree", "reduce", reduce_tree, "ceil(log2 n)(alpha + N beta + N gamma)",
                  non_root, lambda n, r, m, root: _kids(n, r, root) * m),
        Algorithm("scatter", "scatter", scatter, "(n-1)(alpha + M beta)", root_only, non_root),
        Algorithm("gather", "gather", gather, "(n-1)(alpha + M beta)", non_root, root_only),
        Algorithm("all_gather_ring", "all_gather", all_gather_ring, "(n-1)(alpha + M beta)",
                  lambda n, r, m, root: (n - 1) * m, lambda n, r, m, root: (n - 1) * m),
        Algorithm("reduce_scatter_ring", "reduce_scatter", reduce_scatter_ring,
                  "(n-1)(alpha + N/n beta + N/n gamma)",
                  lambda n, r, m, root: m - chunk_sizes(m, n)[r],
                  lambda n, r, m, root: m - chunk_sizes(m, n)[(r - 1) % n]),
        Algorithm("all_to_all_pairwise", "all_to_all", all_to_all_pairwise, "(n-1)(alpha + N/n beta)",
                  lambda n, r, m, root: (n - 1) * (m // n), lambda n, r, m, root: (n - 1) * (m // n)),
        Algorithm("all_reduce_reduce_broadcast", "all_reduce", all_reduce_reduce_broadcast,
                  "2 ceil(log2 n)(alpha + N beta) + ceil(log2 n) N gamma",
                  lambda n, r, m, root: (_kids(n, r, 0) + (r != 0)) * m,
                  lambda n, r, m, root: (_kids(n, r, 0) + (r != 0)) * m),
        Algorithm("all_reduce_tree", "all_reduce", all_reduce_tree,
                  "log2 n (alpha + N beta + N gamma), +2 rounds when n is not a power of two",
                  lambda n, r, m, root: _butterfly(n, r) * m, lambda n, r, m, root: _butterfly(n, r) * m),
        Algorithm("all_reduce_ring", "all_reduce", all_reduce_ring,
                  "2(n-1) alpha + 2(n-1)/n N beta + (n-1)/n N gamma",
                  lambda n, r, m, root: _ring_sent(n, r, m), lambda n, r, m, root: _ring_recv(n, r, m)),
    ]


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in _entries()}
