"""Where the sends and receives go: the communication actions a rank's compute order implies.

The executor posts each maximal run of consecutive communication actions as **one**
``batch_isend_irecv`` and, when the run has a receive, waits for all of it before the next compute.
Two plans (``PipelineSchedule.comm_plan``):

``"jit"`` (the default, just in time):

* ``RECV_F(s, mb)`` immediately before ``F(s, mb)`` when stage ``s - 1`` lives on another rank;
* ``SEND_F(s, mb)`` immediately after ``F(s, mb)`` when stage ``s + 1`` lives on another rank;
* ``RECV_B(s, mb)`` immediately before the ``B``/``I`` of ``(s, mb)`` when stage ``s + 1`` lives elsewhere;
* ``SEND_B(s, mb)`` immediately after that ``B``/``I`` when stage ``s - 1`` lives elsewhere.

After a forward in the 1F1B steady state the run ``SEND_F; RECV_B`` is Megatron's
``send_forward_recv_backward``. ``W`` needs nothing from other ranks. Under strict NCCL matching
(:mod:`lslm.pipeline.simulator`) this rule is deadlock-free for naive, GPipe, 1F1B and ZB-H1, but not for
the looped placement of interleaved 1F1B (a rank's batch sends a forward across the loop and waits for a
gradient, while the receiver needs that forward only much later) nor for DualPipeV (ranks exchange forward
activations and backward gradients in both directions, and the two ends post them in different orders).

``"timed"`` (:func:`timed_plan`, used by ``build_schedule`` for ``"interleaved"`` and ``"dualpipev"``): place
every message where both ranks are between computes at a common time of the ideal timeline, deferring
sends and posting receives early (prefetch) as needed; Megatron's interleaved schedule likewise receives the
next micro-batch's tensors one step ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

from lslm.pipeline.actions import DEFAULT_COSTS, Action

__all__ = ["COMM_PLANS", "ScheduleLike", "add_communication", "comm_batches", "ideal_times", "peer_of", "timed_plan"]


class ScheduleLike(Protocol):
    """What a plan reads of a schedule: :class:`lslm.pipeline.schedules.PipelineSchedule` is one.

    A protocol rather than an import, so that the schedules build on this module and not the other way round.
    """

    @property
    def num_ranks(self) -> int: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def stage_to_rank(self) -> tuple[int, ...]: ...

    @property
    def compute(self) -> tuple[tuple[Action, ...], ...]: ...

    @property
    def comm_plan(self) -> str: ...


def _insert(compute: Sequence[Action], stage_to_rank: Sequence[int], rank: int) -> list[Action]:
    last = len(stage_to_rank) - 1
    out: list[Action] = []
    for a in compute:
        s = a.stage
        prev_remote = s > 0 and stage_to_rank[s - 1] != rank
        next_remote = s < last and stage_to_rank[s + 1] != rank
        if a.kind == "F":
            if prev_remote:
                out.append(Action(s, "RECV_F", a.mb))
            out.append(a)
            if next_remote:
                out.append(Action(s, "SEND_F", a.mb))
        elif a.kind in ("B", "I"):
            if next_remote:
                out.append(Action(s, "RECV_B", a.mb))
            out.append(a)
            if prev_remote:
                out.append(Action(s, "SEND_B", a.mb))
        else:
            out.append(a)
    return out


COMM_PLANS = ("jit", "timed")


def add_communication(schedule: ScheduleLike, rank: int) -> list[Action]:
    """``rank``'s compute actions of ``schedule`` with send/receive actions inserted, by ``schedule.comm_plan``.

    ``"jit"`` is the module doc's rule. ``"timed"`` (:func:`timed_plan`) keeps the sends right after their
    compute but posts each receive in the batch that is current on the receiving rank when the sender sends.
    """
    if not 0 <= rank < schedule.num_ranks:
        raise ValueError(f"rank {rank} is outside 0..{schedule.num_ranks - 1}")
    plan = getattr(schedule, "comm_plan", "jit")
    if plan == "timed":
        return list(timed_plan(schedule)[rank])
    if plan != "jit":
        raise ValueError(f"unknown comm plan {plan!r}; choose one of {COMM_PLANS}")
    return _insert(schedule.compute[rank], schedule.stage_to_rank, rank)


def _producer(a: Action, last: int) -> list[tuple[str, int, int]]:
    # The compute results ``a`` consumes: ("F", s, mb) is stage s's output, ("BI", s, mb) stage s's input grad.
    if a.kind == "F":
        return [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind in ("B", "I"):
        return [("F", a.stage, a.mb)] + ([("BI", a.stage + 1, a.mb)] if a.stage < last else [])
    return [("I", a.stage, a.mb)]


def ideal_times(schedule: ScheduleLike, costs: dict[str, float] | None = None
                ) -> list[list[tuple[float, float]]] | None:
    """(start, end) of every compute action when messages are free and never wait for a receiver.

    Each rank runs its list in order; an action starts once the rank is free and its inputs exist. ``None`` when
    some action waits for an input that never comes (the compute order itself is invalid).
    """
    c = {**DEFAULT_COSTS, **(costs or {})}
    last = schedule.num_stages - 1
    p = schedule.num_ranks
    done: dict[tuple[str, int, int], float] = {}
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    clock = [0.0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            acts = schedule.compute[r]
            while len(times[r]) < len(acts):
                a = acts[len(times[r])]
                need = _producer(a, last)
                if any(k not in done for k in need):
                    break
                start = max([clock[r]] + [done[k] for k in need])
                clock[r] = start + c[a.kind]
                times[r].append((start, clock[r]))
                done[("BI" if a.kind in ("B", "I") else a.kind, a.stage, a.mb)] = clock[r]
                if a.kind == "I":
                    done[("I", a.stage, a.mb)] = clock[r]
                progress = True
    return times if all(len(t) == len(a) for t, a in zip(times, schedule.compute)) else None


@lru_cache(maxsize=64)
def timed_plan(schedule: ScheduleLike) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions with each message placed where both ends are free in the ideal timeline.

    Take the ideal timeline (:func:`ideal_times`, default costs). A rank's comm run between two computes is
    "open" from the end of one to the start of the next. Each message from compute ``k`` on rank ``a`` to its
    consumer on rank ``b`` goes into the earliest pair of runs (one of ``a`` after ``k``, one of ``b`` before the
    consumer) that are open at a common time: the send may wait in ``a``'s memory for a few computes, the
    receive may be posted before it is needed (a prefetch). Then neither side's batch waits for the other in
    the ideal timeline. Where no such pair exists the send goes right after ``k`` and the receive into ``b``'s
    run open at (or next after) that time. Per ordered pair of ranks, sends and receives keep one order (the
    order of production), so the k-th send from ``a`` to ``b`` and ``b``'s k-th receive from ``a`` carry the
    same tensor. Falls back to ``"jit"`` when the compute order itself is invalid.
    """
    s2r, p = schedule.stage_to_rank, schedule.num_ranks
    times = ideal_times(schedule)
    if times is None:
        return tuple(tuple(_insert(schedule.compute[r], s2r, r)) for r in range(p))
    inf = float("inf")

    def window(r: int, i: int) -> tuple[float, float]:
        # The comm run before compute i of rank r (i = len: after its last compute) is open over this interval.
        t = times[r]
        return (t[i - 1][1] if i > 0 else -inf, t[i][0] if i < len(t) else inf)

    where = {(r, a): i for r, acts in enumerate(schedule.compute) for i, a in enumerate(acts)}
    msgs: dict[tuple[int, int], list[tuple[float, int, int, Action, Action]]] = {}
    for r, acts in enumerate(schedule.compute):
        for k, a in enumerate(acts):
            send = [x for x in _insert([a], s2r, r) if x.kind.startswith("SEND")]
            if not send:
                continue
            if a.kind == "F":
                dst, recv, consumer = s2r[a.stage + 1], Action(a.stage + 1, "RECV_F", a.mb), Action(a.stage + 1,
                                                                                                     "F", a.mb)
                cons = where.get((dst, consumer), len(times[dst]))
            else:
                dst, recv = s2r[a.stage - 1], Action(a.stage - 1, "RECV_B", a.mb)
                cons = min((where[dst, Action(a.stage - 1, kind, a.mb)] for kind in ("B", "I")
                            if (dst, Action(a.stage - 1, kind, a.mb)) in where), default=len(times[dst]))
            msgs.setdefault((r, dst), []).append((times[r][k][1], k, cons, send[0], recv))
    at: list[list[list[tuple[float, int, Action]]]] = [[[] for _ in range(len(a) + 1)] for a in schedule.compute]
    for (a, b), lst in msgs.items():
        lst.sort(key=lambda x: x[0])
        # Receive points must not pass a later message's consumer, so the pair's order stays the production order.
        caps, cap = [], len(times[b])
        for _, _, cons, _, _ in reversed(lst):
            cap = min(cap, cons)
            caps.append(cap)
        caps.reverse()
        lo_i = lo_j = 0
        for (t, k, _, send, recv), cap in zip(lst, caps):
            first_j = max(lo_j, next((j for j in range(len(times[b]) + 1) if window(b, j)[1] >= t), len(times[b])))
            best = None
            for i in range(max(k + 1, lo_i), len(times[a]) + 1):
                ws = window(a, i)
                if best is not None and ws[0] > best[0]:
                    break
                for j in range(first_j, cap + 1):
                    wr = window(b, j)
                    if max(ws[0], wr[0]) <= min(ws[1], wr[1]):
                        key = (max(ws[0], wr[0]), i, j)
                        best = key if best is None or key < best else best
                        break
            i, j = (best[1], best[2]) if best is not None else (max(k + 1, lo_i), min(first_j, cap))
            at[a][i].append((t, 0, send))
            at[b][j].append((t, 1, recv))
            lo_i, lo_j = i, j
    out = []
    for r, acts in enumerate(schedule.compute):
        seq: list[Action] = []
        for i in range(len(acts) + 1):
            seq += [x for _, _, x in sorted(at[r][i], key=lambda e: (e[1], e[0]))]
            if i < len(acts):
                seq.append(acts[i])
        out.append(tuple(seq))
    return tuple(out)


def peer_of(action: Action, stage_to_rank: Sequence[int]) -> int:
    """The rank at the other end of communication ``action`` (the neighbouring stage's rank)."""
    if action.kind in ("SEND_F", "RECV_B"):
        return stage_to_rank[action.stage + 1]
    if action.kind in ("RECV_F", "SEND_B"):
        return stage_to_rank[action.stage - 1]
    raise ValueError(f"{action} is not a communication action")


def comm_batches(actions: Sequence[Action]) -> list[list[Action] | Action]:
    """``actions`` grouped as the executor posts them: each maximal run of comm actions becomes one list (one batch)."""
    out: list[list[Action] | Action] = []
    run: list[Action] = []
    for a in actions:
        if a.is_comm:
            run.append(a)
            continue
        if run:
            out.append(run)
            run = []
        out.append(a)
    if run:
        out.append(run)
    return out
