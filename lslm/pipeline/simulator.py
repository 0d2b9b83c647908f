"""Play a pipeline schedule without processes: timings from cost ratios, deadlocks under NCCL rules, memory.

Each rank walks its action list (:meth:`PipelineSchedule.actions`: compute plus the comm plan's
sends and receives). A compute action takes ``costs[kind]`` time units. Communication follows
the executor's contract and NCCL's matching rules, strictly:

* each maximal run of consecutive comm actions of a rank is **one batch** (one ``batch_isend_irecv``);
* point-to-point ops between an ordered pair of ranks match in posting order: the k-th send from
  ``a`` to ``b`` pairs with ``b``'s k-th receive from ``a`` (a pair carrying different tensors is an error);
* a batch completes only when every op in it is matched by a posted op of the peer, and the peer's
  batch has started; a batch starts once the rank's earlier batches with a common peer have
  completed (``stream="peer"``: one NCCL stream per pair of ranks), or all its earlier batches
  (``stream="rank"``: one stream per rank, as when every p2p op of a rank goes through one communicator);
* a rank blocks at a batch that contains a receive until the batch completes; send-only batches
  do not block (the executor waits for them at the end of the step, so they must complete by then).

Sends never complete on their own (no eager buffering): a schedule that passes here does not
rely on NCCL's small-message buffering. A matched pair takes ``comm`` time units after both
batches have started.

**In flight** on a rank: the (stage, micro-batch) pairs whose ``F`` ran and whose ``B``/``I``
has not yet; each holds one stage's activations for one micro-batch. **Activation units**:
in-flight count divided by ``v`` (stages per rank), i.e. in units of one micro-batch's
activations over ``L / p`` layers (one rank's share of a non-interleaved pipeline), the unit in
which 1F1B's first rank peaks at ``p`` (Narayanan et al. 2021, sec. 2.2). Activations a
pending ``W`` still needs are not counted there (reported as ``peak_pending_w``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lslm.pipeline.actions import DEFAULT_COSTS, Action
from lslm.pipeline.comm_plan import comm_batches, ideal_times, peer_of
from lslm.pipeline.schedules import PipelineSchedule
from lslm.pipeline.timeline import Event, Timeline

__all__ = ["DEFAULT_COSTS", "SimResult", "format_grid", "ideal_timeline", "simulate", "time_grid"]



@dataclass
class SimResult:
    """What :func:`simulate` found.

    ``completed``: every rank ran its whole list and every batch completed. ``deadlock``: why not, naming each
    stuck rank's blocking action (``None`` when completed or on an ordering ``error``). ``error``: an action ran
    before something it needs (or a p2p pair carrying different tensors). ``peak_in_flight`` /
    ``peak_activation_units`` / ``peak_pending_w`` per rank (module doc for units).
    """

    timeline: Timeline
    completed: bool
    deadlock: str | None = None
    error: str | None = None
    blocked: dict[int, str] = field(default_factory=dict)
    peak_in_flight: list[int] = field(default_factory=list)
    peak_activation_units: list[float] = field(default_factory=list)
    peak_pending_w: list[int] = field(default_factory=list)

    @property
    def problem(self) -> str | None:
        """The deadlock or error message, ``None`` when the schedule ran to completion."""
        return self.error or self.deadlock


@dataclass
class _Op:
    action: Action
    batch: _Batch
    src: int
    dst: int
    key: tuple[str, int, int]
    partner: _Op | None = None


@dataclass
class _Batch:
    rank: int
    index: int
    actions: list[Action]
    ops: list[_Op] = field(default_factory=list)
    preds: list[_Batch] = field(default_factory=list)
    posted: float | None = None
    start: float | None = None
    done: float | None = None

    @property
    def has_recv(self) -> bool:
        return any(a.kind.startswith("RECV") for a in self.actions)

    def __str__(self) -> str:
        return "[" + " ".join(map(str, self.actions)) + "]"


def _tensor_key(a: Action) -> tuple[str, int, int]:
    # Which tensor a p2p op carries: the output of a stage (forward) or the gradient of a stage's input (backward).
    return {"SEND_F": ("act", a.stage, a.mb), "RECV_F": ("act", a.stage - 1, a.mb),
            "SEND_B": ("grad", a.stage, a.mb), "RECV_B": ("grad", a.stage + 1, a.mb)}[a.kind]


def _costs(costs: Mapping[str, float] | None) -> dict[str, float]:
    out = dict(DEFAULT_COSTS)
    for k, val in (costs or {}).items():
        if k not in out:
            raise ValueError(f"unknown cost kind {k!r}; costs are given for {tuple(out)}")
        if isinstance(val, bool) or not isinstance(val, int | float) or val < 0:
            raise ValueError(f"cost of {k} must be a number >= 0, got {val!r}")
        out[k] = float(val)
    return out


def simulate(schedule: PipelineSchedule, costs: Mapping[str, float] | None = None, comm: float = 0.0,
             stream: str = "peer", sends: str = "rendezvous", split_sends: bool = False,
             stage_costs: Mapping[int, Mapping[str, float]] | None = None,
             compute_overhead: float = 0.0) -> SimResult:
    """Run ``schedule`` as an event simulation (module doc): a simulated :class:`Timeline`, deadlock check, memory.

    ``costs``: time of each compute kind (defaults F=1, B=2, I=1, W=1); ``comm``: time of one matched p2p
    transfer (comm events appear in the timeline when > 0); ``stream``: ``"peer"`` or ``"rank"`` (module doc).
    ``sends="eager"``: a send completes once posted, as if buffered (NCCL's small messages, the free and
    asynchronous messages bubble formulas assume); the default ``"rendezvous"`` waits for the receiver.
    ``split_sends``: post each run's sends and receives as two batches, sends first (the split Megatron avoids:
    with stream order it deadlocks 1F1B, see the tests).
    ``stage_costs``: per virtual stage, costs that replace ``costs`` for that stage (e.g. each stage's measured
    average F and B, when stages are not balanced).
    ``compute_overhead``: time a rank spends on its own after each compute action, neither computing nor waiting
    (an executor's bookkeeping before it posts the next batch or starts the next action; on a GPU, a launch).
    """
    c = _costs(costs)
    if isinstance(compute_overhead, bool) or not isinstance(compute_overhead, int | float) or compute_overhead < 0:
        raise ValueError(f"compute_overhead must be a number >= 0, got {compute_overhead!r}")
    per_stage = {int(stage): _costs({**c, **kinds}) for stage, kinds in (stage_costs or {}).items()}
    if isinstance(comm, bool) or not isinstance(comm, int | float) or comm < 0:
        raise ValueError(f"comm latency must be a number >= 0, got {comm!r}")
    if stream not in ("peer", "rank"):
        raise ValueError(f"stream must be 'peer' or 'rank', got {stream!r}")
    if sends not in ("rendezvous", "eager"):
        raise ValueError(f"sends must be 'rendezvous' or 'eager', got {sends!r}")
    eager = sends == "eager"
    p, s2r, v = schedule.num_ranks, schedule.stage_to_rank, schedule.stages_per_rank
    last = schedule.num_stages - 1

    items: list[list[Action | _Batch]] = []
    for r in range(p):
        seq: list[Action | _Batch] = []
        prev_by_peer: dict[int, _Batch] = {}
        prev: _Batch | None = None
        runs: list[Action | list[Action]] = []
        for it in comm_batches(schedule.actions(r)):
            if isinstance(it, list) and split_sends:
                runs += [x for x in ([a for a in it if a.kind.startswith("SEND")],
                                     [a for a in it if a.kind.startswith("RECV")]) if x]
            else:
                runs.append(it)
        for it in runs:
            if isinstance(it, Action):
                seq.append(it)
                continue
            b = _Batch(r, len(seq), list(it))
            peers = set()
            for a in it:
                q = peer_of(a, s2r)
                src, dst = (r, q) if a.kind.startswith("SEND") else (q, r)
                b.ops.append(_Op(a, b, src, dst, _tensor_key(a)))
                peers.add(q)
            if stream == "rank":
                b.preds = [prev] if prev is not None else []
            else:
                b.preds = list({id(prev_by_peer[q]): prev_by_peer[q] for q in peers if q in prev_by_peer}.values())
            for q in peers:
                prev_by_peer[q] = b
            prev = b
            seq.append(b)
        items.append(seq)

    sends: dict[tuple[int, int], list[_Op]] = {}
    recvs: dict[tuple[int, int], list[_Op]] = {}
    pending: list[_Batch] = []
    pc = [0] * p
    clock = [0.0] * p
    waiting: list[_Batch | None] = [None] * p
    done_compute: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]
    in_flight = [0] * p
    peak = [0] * p
    pending_w = [0] * p
    peak_w = [0] * p
    events: list[Event] = []
    error: str | None = None

    def needs(r: int, a: Action) -> list[tuple[str, int, int]]:
        # Same-rank prerequisites; cross-rank ones arrive through the matched receives.
        if a.kind == "F":
            return [("F", a.stage - 1, a.mb)] if a.stage > 0 and s2r[a.stage - 1] == r else []
        if a.kind in ("B", "I"):
            out = [("F", a.stage, a.mb)]
            if a.stage < last and s2r[a.stage + 1] == r:
                out.append(("BI", a.stage + 1, a.mb))
            return out
        return [("I", a.stage, a.mb)]

    def run_compute(r: int, a: Action) -> str | None:
        if s2r[a.stage] != r:
            return f"rank {r} runs {a} but stage {a.stage} lives on rank {s2r[a.stage]}"
        for need in needs(r, a):
            if need not in done_compute[r]:
                kind = "B/I" if need[0] == "BI" else need[0]
                return f"rank {r} runs {a} before {need[1]}{kind}{need[2]}, which it needs, has run on this rank"
        start = clock[r]
        clock[r] = start + per_stage.get(a.stage, c)[a.kind]
        events.append(Event(r, a.kind, a.stage, a.mb, start, clock[r]))
        clock[r] += compute_overhead
        done_compute[r].add((a.kind, a.stage, a.mb))
        if a.kind in ("B", "I"):
            done_compute[r].add(("BI", a.stage, a.mb))
            in_flight[r] -= 1
        if a.kind == "F":
            in_flight[r] += 1
            peak[r] = max(peak[r], in_flight[r])
        elif a.kind == "I":
            pending_w[r] += 1
            peak_w[r] = max(peak_w[r], pending_w[r])
        elif a.kind == "W":
            pending_w[r] -= 1
        return None

    def post(b: _Batch) -> str | None:
        b.posted = clock[b.rank]
        pending.append(b)
        for op in b.ops:
            table = sends if op.src == b.rank else recvs
            lst = table.setdefault((op.src, op.dst), [])
            lst.append(op)
            other = (recvs if op.src == b.rank else sends).get((op.src, op.dst), [])
            k = len(lst) - 1
            if k < len(other):
                op.partner, other[k].partner = other[k], op
                if other[k].key != op.key:
                    s, rv = (op, other[k]) if op.src == b.rank else (other[k], op)
                    return (f"p2p mismatch: send #{k} from rank {s.src} to rank {s.dst} is {s.action} but rank {rv.dst}"
                            f"'s receive #{k} from rank {rv.src} is {rv.action}: the ranks post their ops in orders "
                            "that disagree")
        return None

    def started(b: _Batch) -> bool:
        if b.start is None and b.posted is not None and all(q.done is not None for q in b.preds):
            b.start = max([b.posted] + [q.done for q in b.preds])  # type: ignore[type-var]
        return b.start is not None

    progress = True
    while progress and error is None:
        progress = False
        for r in range(p):
            while error is None:
                wb = waiting[r]
                if wb is not None:
                    if wb.done is None:
                        break
                    clock[r] = max(clock[r], wb.done)
                    waiting[r] = None
                if pc[r] == len(items[r]):
                    break
                it = items[r][pc[r]]
                pc[r] += 1
                progress = True
                if isinstance(it, Action):
                    error = run_compute(r, it)
                else:
                    error = post(it)
                    if it.has_recv:
                        waiting[r] = it
        changed = True
        while changed and error is None:
            changed = False
            for b in list(pending):
                if not started(b) or any(not (eager and op.src == b.rank) and (
                        op.partner is None or not started(op.partner.batch)) for op in b.ops):
                    continue
                t0s = [b.start if eager and op.src == b.rank else max(b.start, op.partner.batch.start)  # type: ignore
                       for op in b.ops]
                b.done = max(t0s) + comm
                pending.remove(b)
                changed = progress = True
                if comm > 0:
                    for op, t0 in zip(b.ops, t0s):
                        events.append(Event(b.rank, op.action.kind, op.action.stage, op.action.mb, t0, t0 + comm))

    blocked: dict[int, str] = {}
    deadlock = None
    if error is None:
        for r in range(p):
            wb = waiting[r]
            if wb is not None:
                blocked[r] = f"waits at batch {wb} ({_why(wb)})"
            elif pc[r] < len(items[r]):
                blocked[r] = f"stopped before {items[r][pc[r]]}"
            else:
                stuck = [b for b in pending if b.rank == r]
                if stuck:
                    blocked[r] = f"finished its list but send batch {stuck[0]} never completes ({_why(stuck[0])})"
        if blocked:
            deadlock = "deadlock: " + "; ".join(f"rank {r} {msg}" for r, msg in sorted(blocked.items()))
    completed = error is None and not blocked
    tl = Timeline(p, sorted(events, key=lambda e: (e.rank, e.start, not e.is_compute)), "simulated",
                  {"schedule": schedule.name, "p": p, "m": schedule.num_microbatches, "v": v, "costs": c,
                   "comm": float(comm), "stream": stream, "time_unit": "cost units"})
    return SimResult(tl, completed, deadlock, error, blocked, peak, [x / v for x in peak], peak_w)


def ideal_timeline(schedule: PipelineSchedule, costs: Mapping[str, float] | None = None) -> Timeline:
    """The compute timeline with free messages that never wait for a receiver (no comm plan involved).

    The assumption of the bubble formulas; :func:`simulate` reproduces it exactly when ``costs`` are the
    comm plan's own (the defaults). Raises ValueError when the compute order cannot run at all.
    """
    c = _costs(costs)
    times = ideal_times(schedule, c)
    if times is None:
        raise ValueError("this compute order cannot run even with free messages; validate_schedule says why")
    events = [Event(r, a.kind, a.stage, a.mb, t0, t1) for r, acts in enumerate(schedule.compute)
              for a, (t0, t1) in zip(acts, times[r])]
    return Timeline(schedule.num_ranks, events, "simulated",
                    {"schedule": schedule.name, "p": schedule.num_ranks, "m": schedule.num_microbatches,
                     "v": schedule.stages_per_rank, "costs": c, "comm": 0.0, "time_unit": "cost units"})


def _why(b: _Batch) -> str:
    if b.start is None:
        held = [q for q in b.preds if q.done is None]
        if held:
            return f"NCCL stream order: its earlier batch {held[0]} on rank {b.rank} has not completed"
    for op in b.ops:
        if op.partner is None:
            peer = op.dst if op.src == b.rank else op.src
            what = "receive" if op.src == b.rank else "send"
            return f"{op.action} unmatched: rank {peer} has not posted the matching {what}"
        if op.partner.batch.start is None:
            return f"{op.action}: the peer's batch {op.partner.batch} on rank {op.partner.batch.rank} has not started"
    return "unknown"


def time_grid(timeline: Timeline, step: float | None = None) -> list[list[str]]:
    """Rank x time-step table of action strings (``"-"`` idle) from a timeline's compute events.

    ``step`` defaults to the shortest compute event; cell ``j`` of rank ``r`` shows the action running at
    time ``t0 + (j + 1/2) * step``. With ``costs`` all 1 each cell is one action (the textbook grid).
    """
    ev = timeline.compute()
    if not ev:
        return [[] for _ in range(timeline.num_ranks)]
    t0, t1 = timeline.span()
    step = step or min(e.duration for e in ev if e.duration > 0)
    n = round((t1 - t0) / step)
    rows = [["-"] * n for _ in range(timeline.num_ranks)]
    for e in ev:
        for j in range(max(0, int((e.start - t0) / step + 0.5)), min(n, int((e.end - t0) / step + 0.5))):
            rows[e.rank][j] = f"{e.stage}{e.kind}{e.mb}"
    return rows


def format_grid(rows: Sequence[Sequence[str]]) -> str:
    """A :func:`time_grid` as aligned text, one line per rank."""
    width = max((len(x) for row in rows for x in row), default=1)
    return "\n".join(f"rank {r}: " + " ".join(x.rjust(width) for x in row) for r, row in enumerate(rows))
