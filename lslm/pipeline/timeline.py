"""Timelines: what each rank did when, measured (the executor) or ideal (the simulator), in one format.

An :class:`Event` is one interval on one rank: a compute action (``F``, ``B``, ``I``,
``W``) or a communication (``SEND_F`` ... from the ledger's issue and completion times).
Measured and simulated timelines have the same type, so one Gantt plot
(:mod:`lslm.plot.pipeline`) and one bubble formula apply to both.

**Bubble fraction** (the definition plotted everywhere in lslm): over the step's span
``[t0, t1]`` (first compute start to last compute end over all ranks),

    bubble = 1 - (sum over ranks of compute time) / (ranks x (t1 - t0)),

the share of rank-time spent not computing. For GPipe and 1F1B with equal per-stage
costs this is ``(p - 1) / (m + p - 1)`` (Huang et al. 2019, section 2.2; Narayanan et al.
2021, section 2.2).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lslm.pipeline.actions import COMPUTE_KINDS

__all__ = ["Event", "Timeline"]


@dataclass(frozen=True)
class Event:
    """One interval on ``rank``: ``kind`` (an action kind) of micro-batch ``mb`` on virtual stage ``stage``.

    ``start`` and ``end`` are seconds (measured: ``time.perf_counter()`` on the rank,
    aligned across ranks by the recorder; simulated: cost units).
    """

    rank: int
    kind: str
    stage: int
    mb: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self.kind in COMPUTE_KINDS


@dataclass
class Timeline:
    """Events of ``num_ranks`` ranks; ``source`` is ``"measured"`` or ``"simulated"``; ``meta`` says under what."""

    num_ranks: int
    events: list[Event] = field(default_factory=list)
    source: str = "measured"
    meta: dict[str, Any] = field(default_factory=dict)

    def compute(self, rank: int | None = None) -> list[Event]:
        """Compute events (of ``rank``, or all), by start time."""
        return sorted((e for e in self.events if e.is_compute and (rank is None or e.rank == rank)),
                      key=lambda e: (e.start, e.rank))

    def span(self) -> tuple[float, float]:
        """(first compute start, last compute end) over all ranks."""
        ev = self.compute()
        if not ev:
            raise ValueError("this timeline has no compute events")
        return min(e.start for e in ev), max(e.end for e in ev)

    def makespan(self) -> float:
        """Length of :meth:`span`."""
        t0, t1 = self.span()
        return t1 - t0

    def busy(self, rank: int) -> float:
        """Compute time of ``rank``."""
        return sum(e.duration for e in self.compute(rank))

    def bubble_fraction(self) -> float:
        """``1 - sum(busy) / (ranks x makespan)``: the share of rank-time not spent computing (module doc)."""
        total = self.num_ranks * self.makespan()
        return 1.0 - sum(self.busy(r) for r in range(self.num_ranks)) / total if total > 0 else 0.0

    def shifted(self, offset: float) -> Timeline:
        """The same timeline with every time minus ``offset``."""
        return Timeline(self.num_ranks, [Event(e.rank, e.kind, e.stage, e.mb, e.start - offset, e.end - offset)
                                         for e in self.events], self.source, dict(self.meta))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (see :meth:`from_dict`)."""
        return {"num_ranks": self.num_ranks, "source": self.source, "meta": self.meta,
                "events": [asdict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """Inverse of :meth:`to_dict`."""
        return cls(int(data["num_ranks"]), [Event(**e) for e in data["events"]], data.get("source", "measured"),
                   dict(data.get("meta", {})))

    @classmethod
    def merge(cls, parts: Sequence[Iterable[Event]], source: str = "measured", **meta: Any) -> Timeline:
        """One timeline from per-rank event lists (``parts[r]`` holds rank ``r``'s events)."""
        return cls(len(parts), [e for part in parts for e in part], source, dict(meta))
