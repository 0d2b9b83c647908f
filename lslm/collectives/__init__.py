"""lslm.collectives: every collective built from point-to-point messages only.

Each function sends through a :class:`~lslm.runtime.ledger.Comm` (so the ledger
counts every byte), takes an optional process ``group`` (roots are *global*
ranks, as in ``torch.distributed``), works for any world size and any length
(uneven chunks follow the array_split rule), and documents its semantics, its
send/receive order, why it cannot deadlock, and its alpha-beta cost.

* broadcast: :func:`broadcast_flat`, :func:`broadcast_tree`
* reduce: :func:`reduce_tree`
* scatter / gather: :func:`scatter`, :func:`gather`
* ring: :func:`all_gather_ring`, :func:`reduce_scatter_ring`
* all-to-all: :func:`all_to_all_pairwise`
* all-reduce: :func:`all_reduce_reduce_broadcast`, :func:`all_reduce_tree` (recursive doubling),
  :func:`all_reduce_ring`
* :func:`barrier` (dissemination)
* :data:`ALGORITHMS`: name -> kind, function, cost and exact bytes per rank.

Every collective first checks that all ranks agree on size, dtype, root and op
(``check=True``), so a mismatch raises :class:`CollectiveError` on every rank
instead of corrupting data or aborting a process; a rank that never arrives makes
the others raise it after the process group's timeout.

They run unchanged on gloo and NCCL: every buffer and check message lives on the
data's device, and a send and a receive that belong together are posted as one
``batch_isend_irecv`` (:func:`~lslm.collectives.p2p.post_pairs`).
"""

from lslm.collectives.all_reduce import all_reduce_reduce_broadcast, all_reduce_ring, all_reduce_tree
from lslm.collectives.all_to_all import all_to_all_pairwise
from lslm.collectives.barrier import CHECK_LABEL, agree, barrier
from lslm.collectives.broadcast import broadcast_flat, broadcast_tree
from lslm.collectives.p2p import OPS, TIMEOUT_HINT, CollectiveError, chunk_bounds, chunk_sizes, exchange, group_view
from lslm.collectives.reduce import reduce_tree
from lslm.collectives.registry import ALGORITHMS, KINDS, Algorithm, barrier_bytes, check_bytes
from lslm.collectives.ring import all_gather_ring, reduce_scatter_ring
from lslm.collectives.scatter_gather import gather, scatter

__all__ = [
    "ALGORITHMS", "Algorithm", "CHECK_LABEL", "CollectiveError", "KINDS", "OPS", "TIMEOUT_HINT", "agree",
    "all_gather_ring", "all_reduce_reduce_broadcast", "all_reduce_ring", "all_reduce_tree", "all_to_all_pairwise",
    "barrier", "barrier_bytes", "broadcast_flat", "broadcast_tree", "check_bytes", "chunk_bounds", "chunk_sizes",
    "exchange", "gather", "group_view", "reduce_scatter_ring", "reduce_tree", "scatter",
]
