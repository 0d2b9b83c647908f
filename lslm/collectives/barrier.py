"""Dissemination: the barrier, and the cross-rank agreement check every collective starts with.

In round k (k = 0, 1, ...) rank r sends to r + 2^k and receives from r - 2^k
(mod n). After round k, rank r has heard, directly or through others, from the
2^(k+1) ranks r, r-1, ..., so after ceil(log2 n) rounds it has heard from all of
them: nobody leaves before everybody has arrived. Unlike a tree it needs no root
and no second phase, and it works for every n, not only powers of two.

Combining what travels with ``max`` turns the same pattern into an all-reduce of a
tiny vector (``max`` does not mind that for non-powers of two a rank hears from
some ranks twice). :func:`agree` uses that to compare (collective, numel, dtype,
root, op) across ranks *before* any data moves. Without it, ranks that disagree
about a size either corrupt results silently (a message shorter than the receive
buffer fills only part of it) or kill the receiving process outright (gloo
aborts the whole process when a message is longer than its buffer, with no Python
traceback). The check costs ceil(log2 n) messages of 80 bytes per rank.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from lslm.collectives.p2p import OPS, CollectiveError, GroupView, exchange, group_view, resolve
from lslm.runtime.ledger import Comm

CHECK_LABEL = "shape-check"  # ledger label of the agreement messages (data messages carry the collective's name)
_FIELDS = ("collective", "numel", "dtype", "root", "op")
CHECK_MESSAGE_BYTES = 2 * len(_FIELDS) * 8  # each field and its negation, int64
BARRIER_MESSAGE_BYTES = 1


def dissemination_max(comm: Comm, gv: GroupView, payload: torch.Tensor, name: str, label: str) -> torch.Tensor:
    """Element-wise max of ``payload`` over the group, in ceil(log2 n) rounds (see module doc).

    Each round posts the receive and the send together (:func:`~lslm.collectives.p2p.exchange`),
    so all ranks can be in the same round at once without deadlock. Cost:
    ceil(log2 n) (alpha + m beta) for an m-byte payload. Returns a new tensor.
    """
    acc = payload.clone()
    incoming = torch.empty_like(payload)
    n, r, k = gv.size, gv.rank, 1
    while k < n:
        exchange(comm, gv, acc, r + k, incoming, r - k, name, label)
        torch.maximum(acc, incoming, out=acc)
        k <<= 1
    return acc


def barrier(comm: Comm | None = None, group: Any = None, device: torch.device | str | None = None) -> None:
    """Block until every rank of ``group`` has called ``barrier`` (dissemination, 1-byte messages).

    Order and deadlock freedom: in each round a rank posts its receive from r - 2^k and
    its send to r + 2^k together and waits for both; every send has exactly one
    matching receive in the same round. Cost: ceil(log2 n) alpha (the bytes are
    negligible); each rank sends and receives ceil(log2 n) bytes.
    A rank that never arrives makes the others fail after the group's timeout with a
    :class:`~lslm.collectives.p2p.CollectiveError` instead of waiting forever.

    The byte lives on ``device`` (default: ``comm.default_device(group)``, i.e. the
    context's device, or the GPU of a NCCL group): NCCL cannot send CPU tensors.
    """
    comm = resolve(comm)
    gv = group_view(group)
    dev = torch.device(device) if device is not None else comm.default_device(group)
    dissemination_max(comm, gv, torch.zeros(1, dtype=torch.uint8, device=dev), "barrier", "barrier")


_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int64: 4, torch.float64: 5,
                torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9, torch.bool: 10}


def _code(name: str) -> int:
    # crc32 is stable across processes (Python's hash() is salted per process).
    return zlib.crc32(name.encode())


def agree(comm: Comm, gv: GroupView, name: str, numel: int, dtype: torch.dtype, root: int = -1,
          op: str | None = None, *, device: torch.device | str | None = None) -> None:
    """Check that every rank called collective ``name`` with the same numel, dtype, root and op.

    ``root`` is a group rank (-1 when the collective has none); ``numel`` is whatever
    must match across ranks (the tensor, the per-rank block, ...). Every rank learns
    the min and max of each field, so *all* ranks raise the same
    :class:`~lslm.collectives.p2p.CollectiveError` when they differ - before any data
    moves, so nothing is corrupted and no process aborts. A rank that never calls
    makes the others time out (also a CollectiveError). The 80-byte message lives on
    ``device``: pass the data's device (default: ``comm.default_device``).
    """
    dev = torch.device(device) if device is not None else comm.default_device(gv.group)
    fields = torch.tensor([_code(name), numel, _DTYPE_CODES.get(dtype, _code(str(dtype))), root,
                           OPS.index(op) if op is not None else -1], dtype=torch.int64, device=dev)
    both = dissemination_max(comm, gv, torch.cat([fields, -fields]), name, CHECK_LABEL).tolist()  # one copy to host
    hi, lo = both[: len(_FIELDS)], [-v for v in both[len(_FIELDS):]]
    if hi == lo:
        return
    diffs = []
    for i, field in enumerate(_FIELDS):
        if hi[i] != lo[i]:
            detail = "" if field in ("collective", "dtype") else f" (from {lo[i]} to {hi[i]})"
            diffs.append(f"{field} differs{detail}")
    raise CollectiveError(
        f"{name}: {gv.me()} found mismatched shapes across ranks: {', '.join(diffs)}; this rank had numel={numel}, "
        f"dtype={dtype}, root={root}, op={op}. Every rank of the group must call the same collective with the same "
        f"size, dtype, root and op.")
