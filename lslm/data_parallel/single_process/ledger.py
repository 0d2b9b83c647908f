"""Byte ledger for single-process DataParallel: every device-to-device copy, in the comm ledger's vocabulary.

nn.DataParallel moves tensors between the devices of one process with plain copies
(no ``torch.distributed``), so :class:`lslm.runtime.ledger.Comm` never sees them. Our
DataParallel records each copy itself, as a :class:`Transfer`: a
:class:`~lslm.runtime.ledger.CommRecord` (same ``op`` names, ``label``, ``nbytes``,
``dtype``, issue / completion times) plus the source and destination *places*. A
:class:`TransferLedger` is a :class:`~lslm.runtime.ledger.CommLedger`, so
``select`` / ``total_bytes`` / ``calls`` / ``summary`` work the same on both; it adds
the place-aware sums the course plots.

``op`` is the collective the copy is part of, ``label`` the autograd pass:

======================  ==========  ===========  =========================================
copy                    op          label        from -> to
======================  ==========  ===========  =========================================
batch chunks            scatter     forward      batch's place -> replica i
parameters              broadcast   forward      replica 0 -> replica i
buffers (no autograd)   broadcast   buffers      replica 0 -> replica i
outputs                 gather      forward      replica i -> output place
output gradient         scatter     backward     output place -> replica i (Gather's backward)
input gradient          gather      backward     replica i -> batch's place (Scatter's backward)
parameter gradients     reduce      backward     replica i -> replica 0 (Broadcast's backward, a sum)
======================  ==========  ===========  =========================================

A *place* is the index of a replica (``0 .. n-1``), not a device: the CPU demo runs two
"devices" that are both ``cpu``, and we still want to know which copy went where. A
tensor that lives on none of the replicas (a batch on the host, an ``output_device``
outside ``device_ids``) gets the place ``"host"``/``"out"``.

One record is one copy, a transfer between two places (like a send/recv pair:
``group_size`` 2, ``bus_bytes == nbytes``); a collective's bytes are the sum of its
records. Only real copies are recorded. Where the data already sits at its destination
nothing is copied (replica 0's parameters *are* the module's parameters; the first input
chunk is a view), and nothing is recorded - except in the forward ``gather``, whose
output is a fresh buffer on the output device: the local replica's chunk is copied into
it too, and recorded with ``src == dst``. That is deliberate: the gathered output's size
is the memory the output device must hold, which is the imbalance we measure.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from lslm.runtime.ledger import CommLedger, CommRecord

__all__ = ["Place", "Transfer", "TransferLedger", "tensor_bytes"]

Place = int | str


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements of ``t`` (``numel * element_size``), what a copy of it moves."""
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Transfer(CommRecord):
    """One copy of ``nbytes`` from place ``src`` to place ``dst``, part of ``op`` in pass ``label``."""

    src: Place = 0
    dst: Place = 0

    @property
    def phase(self) -> str:
        """The pass (``"forward"``, ``"backward"``; ``"buffers"`` for buffer copies): the record's label."""
        return self.label

    @property
    def bus_bytes(self) -> float:
        """A copy moves each of its bytes once."""
        return float(self.nbytes)


@dataclass
class TransferLedger(CommLedger):
    """A :class:`~lslm.runtime.ledger.CommLedger` of :class:`Transfer` records, with sums by place.

    Thread-safe like its base: autograd may run backward functions on other threads
    (one per CUDA device).
    """

    def record_copy(self, op: str, label: str, src: Place, dst: Place, t: torch.Tensor, *,
                    issue_s: float | None = None, finished: bool = False) -> Transfer:
        """Record the copy of tensor ``t`` (its bytes and dtype) and return the record.

        ``issue_s`` is when the copy started (default: now). ``finished=True`` (a copy
        between CPU tensors, done when it returns) sets the completion time to now; a
        CUDA copy may still be queued, so its completion stays unknown.
        """
        rec = Transfer(op=op, nbytes=tensor_bytes(t), group_size=2, dtype=str(t.dtype).removeprefix("torch."),
                       label=label, issue_s=time.perf_counter() if issue_s is None else issue_s, src=src, dst=dst)
        if finished:
            rec.complete()
        self.record(rec)
        return rec

    def clear(self) -> None:
        """Forget every record (call between steps to measure one step); same as :meth:`reset`."""
        self.reset()

    def _transfers(self, cross_only: bool) -> list[Transfer]:
        return [r for r in self.snapshot() if not (cross_only and r.src == r.dst)]

    def total(self, op: str | None = None, label: str | None = None, *, dst: Place | None = None,
              src: Place | None = None, cross_only: bool = False) -> int:
        """Sum of bytes over the records that match every given filter (``None`` matches anything).

        ``cross_only`` leaves out copies whose source and destination are the same place
        (the local chunk of a gather).
        """
        return sum(r.nbytes for r in self._transfers(cross_only)
                   if (op is None or r.op == op) and (label is None or r.label == label)
                   and (dst is None or r.dst == dst) and (src is None or r.src == src))

    def by_op(self) -> dict[tuple[str, str], int]:
        """``{(label, op): bytes}``, e.g. ``("backward", "reduce")``, in the order the copies first happened."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for r in self.snapshot():
            out[(r.label, r.op)] += r.nbytes
        return dict(out)

    def received(self, *, cross_only: bool = True) -> dict[Place, int]:
        """Bytes that arrived at each place (by default only from other places)."""
        out: dict[Place, int] = defaultdict(int)
        for r in self._transfers(cross_only):
            out[r.dst] += r.nbytes
        return dict(out)

    def sent(self, *, cross_only: bool = True) -> dict[Place, int]:
        """Bytes that left each place (by default only to other places)."""
        out: dict[Place, int] = defaultdict(int)
        for r in self._transfers(cross_only):
            out[r.src] += r.nbytes
        return dict(out)

    def table(self) -> str:
        """A small text table: phase (the label), op, bytes, one row per (phase, op)."""
        rows = [f"{'phase':<9} {'op':<13} {'bytes':>14}"]
        for (label, op), nbytes in self.by_op().items():
            rows.append(f"{label:<9} {op:<13} {nbytes:>14,}")
        return "\n".join(rows)
