"""Ledger records: :class:`CommRecord` (one call) and :class:`CommLedger` (one rank's list of them).

The story (what is counted, and why) is in :mod:`lslm.runtime.ledger`, whose
:class:`~lslm.runtime.ledger.Comm` fills these; this module is the data and its queries.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from lslm.runtime.completion import Completion

_BUS_FACTOR_KIND = {
    "all_reduce": "2(n-1)/n",
    "all_gather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "gather": "(n-1)/n",
    "scatter": "(n-1)/n",
    "broadcast": "1",
    "reduce": "1",
    "send": "1",
    "recv": "1",
    "barrier": "0",
}
SUMMARY_KEYS = ("op", "axis", "label")


def bus_factor(op: str, group_size: int) -> float:
    """The nccl-tests bus-bandwidth factor of ``op`` on ``group_size`` ranks (see :mod:`lslm.runtime.ledger`)."""
    kind = _BUS_FACTOR_KIND.get(op)
    if kind is None:
        raise ValueError(f"unknown op {op!r}; known: {sorted(_BUS_FACTOR_KIND)}")
    n = group_size
    return {"2(n-1)/n": 2 * (n - 1) / n, "(n-1)/n": (n - 1) / n, "1": 1.0, "0": 0.0}[kind]


@dataclass(frozen=True)
class CommRecord:
    """One communication call as seen by this rank.

    Immutable except for its completion time, which is set once (from any thread)
    when the operation is known to be done: :attr:`completion_s`. A :class:`~lslm.runtime.ledger.Comm`
    stamps it only while its ledger asks for completion times (:attr:`CommLedger.stamps_completion`);
    otherwise it stays None, and the byte counts, labels and issue time are there as always.
    """

    op: str
    nbytes: int
    group_size: int
    dtype: str = ""
    peer: int | None = None  # global rank of the other side, for send/recv
    label: str = ""  # free text set by the caller (e.g. "bucket 3"), for plots
    axis: str = ""  # the grid axes of the group ("dp", "dp,cp"), "world" for the default group, "" if unknown
    issue_s: float = field(default_factory=time.perf_counter)  # perf_counter() when the call was made
    done: Completion = field(default_factory=Completion, repr=False, compare=False)

    @property
    def bus_bytes(self) -> float:
        """Bytes each rank sends under a bandwidth-optimal algorithm (see :mod:`lslm.runtime.ledger`)."""
        return self.nbytes * bus_factor(self.op, self.group_size)

    @property
    def completion_s(self) -> float | None:
        """perf_counter() time the operation finished; None while unknown (in flight, failed, never waited, or
        issued while the ledger recorded no completion times: :attr:`CommLedger.stamps_completion`)."""
        return self.done.time()

    @property
    def duration_s(self) -> float | None:
        """``completion_s - issue_s``, or None while the completion is unknown."""
        end = self.completion_s
        return None if end is None else end - self.issue_s

    def complete(self, t: float | None = None) -> None:
        """Set the completion time (default: now) unless it was set before."""
        self.done.set(time.perf_counter() if t is None else t)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field, plus ``bus_bytes`` and ``completion_s``."""
        return {"op": self.op, "nbytes": self.nbytes, "group_size": self.group_size, "dtype": self.dtype,
                "peer": self.peer, "label": self.label, "axis": self.axis, "issue_s": self.issue_s,
                "completion_s": self.completion_s, "bus_bytes": self.bus_bytes}


@dataclass
class CommLedger:
    """An append-only list of :class:`CommRecord` for one rank, resettable and summarisable.

    Every method is safe to call while other threads record (gradient hooks may
    fire on autograd's worker thread). ``enabled = False`` (or :meth:`paused`) stops
    recording on purpose, e.g. in a timed loop; calls made meanwhile are counted in
    ``dropped``, so a ledger never loses records without saying so.

    **Completion times are opt-in.** Stamping when an operation finished costs a work
    wrapper and a callback on its future per asynchronous call (a CUDA event per call on
    GPUs), and only timelines read it. So a :class:`~lslm.runtime.ledger.Comm` stamps
    ``completion_s`` only for calls issued while :attr:`stamps_completion` holds: set
    ``record_completion = True`` for a whole run, or issue the calls to time inside
    ``with ledger.timed():`` (as the pipeline executor's timeline and the tensor-parallel
    overlap log do). Otherwise records have ``completion_s = None`` and an asynchronous
    call returns torch's own work.
    """

    records: list[CommRecord] = field(default_factory=list)
    enabled: bool = True
    dropped: int = 0
    record_completion: bool = False
    _timed_scopes: int = field(default=0, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def stamps_completion(self) -> bool:
        """Whether a call issued now gets its completion time: ``record_completion``, or inside :meth:`timed`."""
        return self.record_completion or self._timed_scopes > 0

    @contextmanager
    def timed(self, on: bool = True) -> Iterator[CommLedger]:
        """``with ledger.timed():`` calls issued inside get completion times (``on=False`` changes nothing).

        Scopes are counted rather than toggled, so two threads (a step and a gradient hook) can
        each open one without the first to leave turning the other's off. Calls issued on
        another thread while a scope is open are stamped too: harmless, their times are known.
        """
        if not on:
            yield self
            return
        with self._lock:
            self._timed_scopes += 1
        try:
            yield self
        finally:
            with self._lock:
                self._timed_scopes -= 1

    def record(self, rec: CommRecord) -> None:
        """Append ``rec`` (while ``enabled`` is False, count it in ``dropped`` instead)."""
        with self._lock:
            if self.enabled:
                self.records.append(rec)
            else:
                self.dropped += 1

    def drop(self, count: int) -> None:
        """Count ``count`` calls made while not ``enabled`` (what :meth:`record` does for one record)."""
        with self._lock:
            self.dropped += count

    @contextmanager
    def paused(self) -> Iterator[CommLedger]:
        """``with ledger.paused():`` records nothing inside (counted in ``dropped``); restores ``enabled`` after."""
        before, self.enabled = self.enabled, False
        try:
            yield self
        finally:
            self.enabled = before

    def reset(self) -> None:
        """Forget every record (and the ``dropped`` count)."""
        with self._lock:
            self.records.clear()
            self.dropped = 0

    def snapshot(self) -> list[CommRecord]:
        """A copy of the records, taken under the lock."""
        with self._lock:
            return list(self.records)

    def select(self, op: str | None = None, label: str | None = None, since: int = 0, *,
               axis: str | None = None) -> list[CommRecord]:
        """The records from index ``since`` on (``len(records)`` taken earlier), of one op, label and/or axis.

        ``None`` matches anything. Counting "what this step sent" is
        ``since=len(ledger.records)`` read before the step; ``axis="dp,cp"`` picks
        the calls made on that group (see :class:`~lslm.runtime.context.ParallelContext`).
        """
        with self._lock:
            recs = self.records[since:]
        return [r for r in recs if (op is None or r.op == op) and (label is None or r.label == label)
                and (axis is None or r.axis == axis)]

    def total_bytes(self, op: str | None = None, label: str | None = None, since: int = 0, *,
                    axis: str | None = None) -> int:
        """Sum of ``nbytes`` over the records :meth:`select` picks (default: all)."""
        return sum(r.nbytes for r in self.select(op, label, since, axis=axis))

    def total_bus_bytes(self, op: str | None = None, label: str | None = None, since: int = 0, *,
                        axis: str | None = None) -> float:
        """Sum of ``bus_bytes`` over the records :meth:`select` picks (default: all)."""
        return sum(r.bus_bytes for r in self.select(op, label, since, axis=axis))

    def calls(self, op: str | None = None, label: str | None = None, since: int = 0, *,
              axis: str | None = None) -> int:
        """Number of calls among the records :meth:`select` picks (default: all)."""
        return len(self.select(op, label, since, axis=axis))

    def summary(self, by: str = "op") -> dict[str, dict[str, float]]:
        """Per op (or per ``by="axis"`` / ``"label"``): ``{"calls", "bytes", "bus_bytes"}``, JSON-ready."""
        if by not in SUMMARY_KEYS:
            raise ValueError(f"by must be one of {SUMMARY_KEYS}, got {by!r}")
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
        for r in self.snapshot():
            row = out[getattr(r, by)]
            row["calls"] += 1
            row["bytes"] += r.nbytes
            row["bus_bytes"] += r.bus_bytes
        return dict(out)

    def to_list(self) -> list[dict[str, Any]]:
        """Every record as a dict (see :meth:`CommRecord.as_dict`), for JSON results."""
        return [r.as_dict() for r in self.snapshot()]
