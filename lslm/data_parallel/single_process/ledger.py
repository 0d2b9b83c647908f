"""Byte ledger for single-process DataParallel: every device-to-device copy, with its size.

nn.DataParallel moves tensors between the devices of one process with plain
copies (no ``torch.distributed``), so the multi-process :mod:`lslm.runtime.ledger`
does not see them. This ledger records each copy our DataParallel makes as one
:class:`Transfer`: the operation (forward: ``scatter``, ``broadcast``, ``buffers``,
``gather``; backward: ``grad_scatter`` from the gather, ``grad_gather`` from the
scatter, ``reduce_add`` from the broadcast), the pass (``forward`` or
``backward``), the source and destination *places*, and the bytes.

A *place* is the index of a replica (``0 .. n-1``), not a device: the CPU demo
runs two "devices" that are both ``cpu``, and we still want to know which copy
went where. A tensor that lives on none of the replicas (a batch on the host,
an ``output_device`` outside ``device_ids``) gets the place ``"host"``/``"out"``.

Only real copies are recorded. Where the data already sits at its destination
place nothing is copied (replica 0's parameters *are* the module's parameters;
the first input chunk is a view), and nothing is recorded — except in
``gather``, whose output is a fresh buffer on the output device: the chunk of
the local replica is copied into it too, and recorded with ``src == dst``. That
is deliberate: the gathered output's size is the memory the output device must
hold, which is the imbalance we measure.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

__all__ = ["Place", "Transfer", "TransferLedger", "tensor_bytes"]

Place = int | str


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements of ``t`` (``numel * element_size``), what a copy of it moves."""
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Transfer:
    """One copy: ``nbytes`` from place ``src`` to place ``dst`` during ``op`` in ``phase``."""

    op: str
    phase: str
    src: Place
    dst: Place
    nbytes: int


class TransferLedger:
    """Thread-safe list of :class:`Transfer` records with the sums the course plots.

    Autograd may run backward functions on other threads (one per CUDA device),
    hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records: list[Transfer] = []

    def record(self, op: str, phase: str, src: Place, dst: Place, nbytes: int) -> None:
        """Append one transfer."""
        with self._lock:
            self.records.append(Transfer(op, phase, src, dst, int(nbytes)))

    def clear(self) -> None:
        """Forget every record (call between steps to measure one step)."""
        with self._lock:
            self.records.clear()

    def total(self, op: str | None = None, phase: str | None = None, *, dst: Place | None = None,
              src: Place | None = None, cross_only: bool = False) -> int:
        """Sum of bytes over the records that match every given filter.

        ``cross_only`` leaves out copies whose source and destination are the same
        place (the local chunk of a gather).
        """
        with self._lock:
            records = list(self.records)
        return sum(r.nbytes for r in records
                   if (op is None or r.op == op) and (phase is None or r.phase == phase)
                   and (dst is None or r.dst == dst) and (src is None or r.src == src)
                   and not (cross_only and r.src == r.dst))

    def by_op(self) -> dict[tuple[str, str], int]:
        """``{(phase, op): bytes}`` in the order the operations first happened."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        with self._lock:
            for r in self.records:
                out[(r.phase, r.op)] += r.nbytes
        return dict(out)

    def received(self, *, cross_only: bool = True) -> dict[Place, int]:
        """Bytes that arrived at each place (by default only from other places)."""
        out: dict[Place, int] = defaultdict(int)
        with self._lock:
            for r in self.records:
                if not (cross_only and r.src == r.dst):
                    out[r.dst] += r.nbytes
        return dict(out)

    def sent(self, *, cross_only: bool = True) -> dict[Place, int]:
        """Bytes that left each place (by default only to other places)."""
        out: dict[Place, int] = defaultdict(int)
        with self._lock:
            for r in self.records:
                if not (cross_only and r.src == r.dst):
                    out[r.src] += r.nbytes
        return dict(out)

    def table(self) -> str:
        """A small text table: phase, op, bytes, one row per (phase, op)."""
        rows = [f"{'phase':<9} {'op':<13} {'bytes':>14}"]
        for (phase, op), nbytes in self.by_op().items():
            rows.append(f"{phase:<9} {op:<13} {nbytes:>14,}")
        return "\n".join(rows)
