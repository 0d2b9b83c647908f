"""Compute, communication and *exposed* communication of each step, read from a profiler trace.

Input: the Chrome-trace JSON that :mod:`lslm.metrics.trace` writes (one file per rank; plain
Python over the parsed JSON, no torch). Everything is measured on the **main thread**, the
thread that ran the ``lslm.step#<id>`` ranges: it is the step's critical path on the host.

* **Steps**: the ``lslm.step#<id>`` ranges (the whole trace is one step ``"all"`` if there is none).
* **Collectives**: the ledger's ranges (:mod:`lslm.runtime.comm_trace`). A blocking call is one
  ``lslm.comm:`` range; an asynchronous call is its ``lslm.comm:`` issue range and, later, its
  ``lslm.wait:`` range, joined by the sequence number ``#k``. A collective's **communication time**
  (``comm_s``) is its span from issue to the end of its wait (its call range if nobody waited
  inside the trace). On CPU/gloo the transfer itself runs on gloo's threads (``gloo:all_reduce``
  events, kept in :attr:`Timeline.other_threads`) while the main thread computes; issue-to-wait
  is what the main thread can overlap, so that is what we attribute to the collective.
* **Compute** (``compute_s``): the union of the main thread's operator ranges (``aten::...``,
  any ``cpu_op``; on CUDA also those of autograd's device threads, where the backward runs) *outside*
  the main thread's ledger ranges; torch's own ``c10d::`` / ``gloo:`` /
  ``nccl:`` / ``record_param_comms`` events are communication, never compute.
* **Exposed communication** (``exposed_s``): the time the main thread spends inside a ledger range
  (a blocking call, or the ``wait()`` of an asynchronous one) while no compute runs: on gloo the
  main thread does nothing else there, so it is the length of those ranges. It is split by the
  outermost ledger range that covers it (a batch of sends and receives posted together shares its
  time equally), hence per collective kind and group (axis). An asynchronous collective that is
  finished when its ``wait()`` is called is not exposed at all, however long its span.
* ``issue_s``: the part of ``exposed_s`` spent *issuing* asynchronous collectives (their ``lslm.comm:``
  range; gloo's enqueue can block the caller for milliseconds on a loaded machine): exposed, but
  inside backward, where the recipe's marks count it as compute.
* ``idle_s``: the rest of the step (Python between operators, the profiler's own cost):
  ``step_s = compute_s + exposed_s + idle_s`` exactly.

The step timer's marks (``lslm.mark:<name>`` ranges) are kept per step (``marks``, seconds from the
step's start), so the harness's own measure of the same step can be read from the same clock:
for DDP's recipe exposed communication is ``sync_end - backward_end`` (the time in
``finish_grad_sync``, :func:`lslm.recipes.ddp.split_compute_comm`), the "exposed = step - compute
- optimizer" of :mod:`lslm.metrics.step_time`. It compares with ``exposed_s - issue_s`` (the waits):
the marks' window also holds the Python between the waits and the division of each bucket by the
world size (``aten::div_``, compute here), so it reads a little more; the trace's ``issue_s``
(blocking enqueues inside backward) is exposed communication that the marks call compute.
``step_s - compute_s`` is not exposed communication on a trace: it also holds ``idle_s``, which for
a tiny model on the CPU (many small operators) is most of the step.

On CUDA the host ranges still say when the host waited (a ``wait()`` on NCCL makes the *stream*
wait, not the host); the kernels are summarised separately per step (``device``): busy time of
compute kernels and of NCCL kernels, and NCCL time not covered by a compute kernel.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lslm.metrics.trace import MARK_PREFIX, STEP_PREFIX
from lslm.runtime.comm_trace import CommRange, parse_range

__all__ = ["Collective", "StepOverlap", "Timeline", "analyse", "analyse_files", "is_comm_event", "load_trace",
           "merge", "overlap_table", "slowest_rank", "total", "union_length"]

_COMM_EVENT = re.compile(r"^(c10d::|gloo:|nccl:|nccl|record_param_comms|ProcessGroup)", re.IGNORECASE)
Interval = tuple[float, float]


def is_comm_event(name: str) -> bool:
    """True for torch's own communication events (``c10d::``, ``gloo:``, ``nccl...``, ``record_param_comms``)."""
    return bool(_COMM_EVENT.match(name))


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of ``(start, end)`` intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total(intervals: Iterable[Interval]) -> float:
    """Length of the union of ``intervals``."""
    return sum(b - a for a, b in merge(intervals))


def _clip(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def _minus(intervals: Sequence[Interval], cut: Sequence[Interval]) -> list[Interval]:
    """``intervals`` (disjoint, sorted) minus the union ``cut`` (disjoint, sorted)."""
    out = []
    for a, b in intervals:
        pos = a
        for c, d in cut:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
        if pos < b:
            out.append((pos, b))
    return out


def union_length(intervals: Iterable[Interval], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` inside ``[lo, hi]``."""
    return total(_clip(intervals, lo, hi))


@dataclass
class Collective:
    """One ledger call on the main thread: its range name fields, issue range and (if asynchronous) wait range."""

    info: CommRange
    call: Interval
    wait: Interval | None = None

    @property
    def span(self) -> Interval:
        """Issue to end of wait (the call range for a blocking call, or when no wait was traced)."""
        return (self.call[0], self.wait[1] if self.wait is not None else self.call[1])

    @property
    def key(self) -> str:
        """``"<op>@<axis>"``: the kind and the group, the keys of the per-kind tables."""
        return f"{self.info.op}@{self.info.axis or '-'}"


@dataclass
class Timeline:
    """One rank's trace reduced to what the analysis and the plot need (times in seconds from the trace's start)."""

    rank: int
    steps: list[tuple[str, float, float]]
    compute: list[Interval]
    collectives: list[Collective]
    marks: list[tuple[str, float]] = field(default_factory=list)
    other_threads: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)
    device_compute: list[Interval] = field(default_factory=list)
    device_comm: list[Interval] = field(default_factory=list)
    origin_us: float = 0.0  # the trace's zero on the profiler's clock (us; same clock for every process of a host)

    def shifted(self, dt: float) -> Timeline:
        """This timeline with every time moved by ``dt`` seconds (to put several ranks on one zero)."""
        def mv(x: Interval) -> Interval:
            return (x[0] + dt, x[1] + dt)

        colls = [Collective(c.info, mv(c.call), mv(c.wait) if c.wait is not None else None) for c in self.collectives]
        return Timeline(self.rank, [(n, a + dt, b + dt) for n, a, b in self.steps], [mv(x) for x in self.compute],
                        colls, [(n, t + dt) for n, t in self.marks],
                        {k: [(n, a + dt, b + dt) for n, a, b in v] for k, v in self.other_threads.items()},
                        [mv(x) for x in self.device_compute], [mv(x) for x in self.device_comm],
                        self.origin_us - 1e6 * dt)  # the same absolute times

    def blocking(self) -> list[tuple[Interval, list[Collective]]]:
        """The outermost ledger ranges on the main thread (calls and waits), each with the collectives it stands for."""
        ranges: dict[Interval, list[Collective]] = defaultdict(list)
        for c in self.collectives:
            ranges[c.call].append(c)
            if c.wait is not None:
                ranges[c.wait].append(c)
        keys = sorted(ranges, key=lambda iv: (iv[0], -iv[1]))
        out: list[tuple[Interval, list[Collective]]] = []
        for iv in keys:
            if out and iv[0] >= out[-1][0][0] and iv[1] <= out[-1][0][1] and iv != out[-1][0]:
                continue  # nested inside an outer ledger range: its time is the outer one's
            out.append((iv, ranges[iv]))
        return out


def load_trace(source: str | Path | dict[str, Any], rank: int | None = None) -> Timeline:
    """Read one rank's Chrome trace (a path or the parsed JSON) into a :class:`Timeline`.

    The rank comes from ``rank``, else the trace's ``distributedInfo``, else the file name
    (``...-rank<r>.json``), else 0.
    """
    data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    if rank is None:
        rank = (data.get("distributedInfo") or {}).get("rank")
    if rank is None and not isinstance(source, dict):
        m = re.search(r"rank(\d+)", Path(source).name)
        rank = int(m[1]) if m else 0
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not events:
        raise ValueError("the trace has no complete ('X') events: is it a torch.profiler Chrome trace?")
    t0 = min(float(e["ts"]) for e in events)

    def iv(e: dict[str, Any]) -> Interval:
        return ((float(e["ts"]) - t0) / 1e6, (float(e["ts"]) + float(e["dur"]) - t0) / 1e6)

    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function", None)]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    step_tids = [e.get("tid") for e in host if e["name"].startswith(STEP_PREFIX)]
    if step_tids:
        main = max(set(step_tids), key=step_tids.count)
    else:
        ops = [e.get("tid") for e in host if e.get("cat") == "cpu_op"]
        main = max(set(ops), key=ops.count) if ops else None
    on_main = [e for e in host if e.get("tid") == main]

    steps = sorted(((e["name"][len(STEP_PREFIX):], *iv(e)) for e in on_main if e["name"].startswith(STEP_PREFIX)),
                   key=lambda s: s[1])
    if not steps:
        lo = min(iv(e)[0] for e in events)
        steps = [("all", lo, max(iv(e)[1] for e in events))]
    marks = sorted(((e["name"][len(MARK_PREFIX):], iv(e)[0]) for e in on_main
                    if e["name"].startswith(MARK_PREFIX)), key=lambda m: m[1])

    calls: dict[int, Collective] = {}
    waits: dict[int, Interval] = {}
    for e in on_main:
        info = parse_range(e["name"])
        if info is None:
            continue
        if info.wait:
            waits[info.seq] = iv(e)
        else:
            calls[info.seq] = Collective(info, iv(e))
    for seq, w in waits.items():
        if seq in calls:
            calls[seq].wait = w
    collectives = sorted(calls.values(), key=lambda c: c.call[0])

    comm_ranges = merge([c.call for c in collectives] + [c.wait for c in collectives if c.wait is not None])
    # On CUDA the backward runs on autograd's device threads, not the caller's: their operators are compute too.
    workers = {e.get("tid") for e in host if e["name"].startswith("autograd::engine::evaluate_function")} - {main}
    ops = merge(iv(e) for e in host if e.get("cat") == "cpu_op" and not is_comm_event(e["name"])
                and (e.get("tid") == main or e.get("tid") in workers))
    compute = _minus(ops, comm_ranges)  # operators inside a ledger call are that collective's own work

    other: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    for e in host:
        if e.get("tid") != main and is_comm_event(e["name"]):
            other[str(e.get("tid"))].append((e["name"], *iv(e)))
    dev_comm = merge(iv(e) for e in kernels if "nccl" in e["name"].lower())
    dev_compute = merge(iv(e) for e in kernels if "nccl" not in e["name"].lower())
    origin = t0 + float(data.get("baseTimeNanoseconds", 0)) / 1e3
    return Timeline(int(rank), steps, compute, collectives, marks, dict(other), dev_compute, dev_comm, origin)


@dataclass
class StepOverlap:
    """One step of one rank: seconds of each part, and per collective kind and group (``"op@axis"``)."""

    rank: int
    step: str
    step_s: float
    compute_s: float
    exposed_s: float
    issue_s: float
    idle_s: float
    comm_s: dict[str, float]
    exposed_by_kind: dict[str, float]
    bytes_by_kind: dict[str, int]
    calls_by_kind: dict[str, int]
    marks: dict[str, float]
    device: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return dict(self.__dict__)


def analyse(timeline: Timeline) -> list[StepOverlap]:
    """Per step of ``timeline``: compute, exposed communication and idle time, and per collective kind.

    Collectives belong to the step in which they were issued; their exposed time is counted in the
    step where the main thread waited (clipped to the step).
    """
    out = []
    blocking = timeline.blocking()
    for name, lo, hi in timeline.steps:
        compute = _clip(timeline.compute, lo, hi)
        compute_s = total(compute)
        exposed: dict[str, float] = defaultdict(float)
        issue_s = 0.0
        for iv, members in blocking:
            part = _clip([iv], lo, hi)
            if not part:
                continue
            length = total(part) - total(_clip(compute, *part[0]))
            for c in members:
                exposed[c.key] += length / len(members)
                if c.wait is not None and c.call == iv:
                    issue_s += length / len(members)
        mine = [c for c in timeline.collectives if lo <= c.call[0] < hi]
        comm_s: dict[str, float] = defaultdict(float)
        nbytes: dict[str, int] = defaultdict(int)
        calls: dict[str, int] = defaultdict(int)
        for c in mine:
            comm_s[c.key] += c.span[1] - c.span[0]
            nbytes[c.key] += c.info.nbytes
            calls[c.key] += 1
        exposed_s = sum(exposed.values())
        device = None
        if timeline.device_compute or timeline.device_comm:
            dc, dm = _clip(timeline.device_compute, lo, hi), _clip(timeline.device_comm, lo, hi)
            device = {"compute_s": total(dc), "comm_s": total(dm), "exposed_s": total(_minus(merge(dm), merge(dc)))}
        out.append(StepOverlap(
            rank=timeline.rank, step=name, step_s=hi - lo, compute_s=compute_s, exposed_s=exposed_s,
            issue_s=issue_s, idle_s=(hi - lo) - compute_s - exposed_s, comm_s=dict(comm_s),
            exposed_by_kind=dict(exposed),
            bytes_by_kind=dict(nbytes), calls_by_kind=dict(calls),
            marks={m: t - lo for m, t in timeline.marks if lo <= t <= hi}, device=device))
    return out


def slowest_rank(per_rank: dict[int, list[StepOverlap]]) -> tuple[int, float]:
    """The rank whose traced steps took longest in total, and that total (seconds): the critical path."""
    if not per_rank:
        raise ValueError("no ranks to compare: pass {rank: analyse(load_trace(path))}")
    times = {r: sum(s.step_s for s in steps) for r, steps in per_rank.items()}
    rank = max(times, key=lambda r: times[r])
    return rank, times[rank]


def analyse_files(paths: Iterable[str | Path]) -> dict[int, list[StepOverlap]]:
    """``{rank: analyse(load_trace(path))}`` for one run's files (one per rank, e.g. ``DIR/<run>-rank*.json``)."""
    out: dict[int, list[StepOverlap]] = {}
    for path in paths:
        tl = load_trace(path)
        if tl.rank in out:
            raise ValueError(f"two traces of rank {tl.rank} ({path}): pass one run's files")
        out[tl.rank] = analyse(tl)
    if not out:
        raise ValueError("no trace files given")
    return dict(sorted(out.items()))


def overlap_table(per_rank: dict[int, list[StepOverlap]]) -> str:
    """A text table: per rank and step, step / compute / exposed communication / idle (ms), then per collective
    kind and group its calls, bytes, issue-to-wait time and exposed time; the last line names the slowest rank."""
    lines = [f"{'rank':>4} {'step':>10} {'step ms':>9} {'compute':>9} {'exposed':>9} {'idle':>9}   per op@group: "
             "calls, bytes, issue->wait ms, exposed ms"]
    for rank, steps in per_rank.items():
        for s in steps:
            kinds = "; ".join(f"{k}: {s.calls_by_kind[k]}, {s.bytes_by_kind[k]:,} B, {1e3 * s.comm_s[k]:.2f}, "
                              f"{1e3 * s.exposed_by_kind.get(k, 0.0):.2f}" for k in sorted(s.calls_by_kind))
            lines.append(f"{rank:>4} {s.step:>10} {1e3 * s.step_s:9.2f} {1e3 * s.compute_s:9.2f} "
                         f"{1e3 * s.exposed_s:9.2f} {1e3 * s.idle_s:9.2f}   {kinds}")
    rank, t = slowest_rank(per_rank)
    lines.append(f"slowest rank: {rank} ({1e3 * t:.2f} ms over its traced steps)")
    return "\n".join(lines)
