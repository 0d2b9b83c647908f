"""Check a schedule against the rules every pipeline schedule obeys, naming the first one it breaks.

Rules, checked in this order (:data:`RULES`):

1. ``placement`` - each action runs on the rank holding its stage, for a stage and micro-batch that exist;
2. ``counts`` - every (stage, micro-batch) has exactly one ``F`` and either exactly one ``B`` or exactly
   one ``I`` and one ``W``;
3. ``order`` - on each rank, a pair's ``F`` comes before its ``B``/``I``, and ``I`` before ``W``;
4. ``dependencies`` - with free messages the lists can run: ``F(s, mb)`` after ``F(s-1, mb)``,
   ``B/I(s, mb)`` after ``B/I(s+1, mb)`` (the last stage's after its own ``F``); a cycle of waits is named;
5. ``deadlock`` - played with the schedule's comm plan under strict NCCL matching (:mod:`lslm.pipeline.simulator`),
   every rank finishes;
6. ``in_flight`` - 1F1B-family limits: ``"1f1b"`` and ``"zb-h1"`` keep at most ``p - rank`` micro-batches
   in flight on rank ``rank`` (Narayanan et al. 2021 sec. 2.2.1; Qi et al. 2023 sec. 2.1).

:func:`validate_schedule` takes a :class:`PipelineSchedule` or hand-written per-rank lists (``Action`` s or
strings such as ``"0F1"``), so an exercise checker can call it on a learner's lists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from lslm.pipeline.actions import Action
from lslm.pipeline.comm_plan import ideal_times
from lslm.pipeline.schedules import PipelineSchedule, schedule_from_lists
from lslm.pipeline.simulator import simulate

__all__ = ["RULES", "ScheduleError", "validate_schedule"]

RULES = ("placement", "counts", "order", "dependencies", "deadlock", "in_flight")
_LIMITED = ("1f1b", "zb-h1")


class ScheduleError(ValueError):
    """A broken schedule rule: ``rule`` (one of :data:`RULES`), and where (``rank``, ``action``) when known."""

    def __init__(self, rule: str, message: str, rank: int | None = None, action: str | None = None) -> None:
        super().__init__(f"[{rule}] {message}")
        self.rule, self.rank, self.action = rule, rank, action


def _as_schedule(schedule: PipelineSchedule | Sequence[Sequence[Action | str]], num_microbatches: int | None,
                 stage_to_rank: Sequence[int] | None, name: str | None) -> PipelineSchedule:
    if isinstance(schedule, PipelineSchedule):
        return schedule
    if num_microbatches is None:
        raise ValueError("give num_microbatches when validating per-rank lists")
    try:
        return schedule_from_lists(schedule, num_microbatches, stage_to_rank, name or "custom")
    except ValueError as err:
        raise ScheduleError("placement", str(err)) from err


def _check_counts(s: PipelineSchedule) -> None:
    where: dict[tuple[int, int], Counter[str]] = {}
    for r, acts in enumerate(s.compute):
        for a in acts:
            if not (0 <= a.stage < s.num_stages and 0 <= a.mb < s.num_microbatches):
                raise ScheduleError("placement", f"rank {r}: {a} names stage {a.stage} / micro-batch {a.mb}, but "
                                    f"stages are 0..{s.num_stages - 1} and micro-batches 0..{s.num_microbatches - 1}",
                                    r, str(a))
            if s.stage_to_rank[a.stage] != r:
                raise ScheduleError("placement", f"rank {r} runs {a}, but stage {a.stage} lives on rank "
                                    f"{s.stage_to_rank[a.stage]}", r, str(a))
            where.setdefault((a.stage, a.mb), Counter())[a.kind] += 1
    for stage in range(s.num_stages):
        for mb in range(s.num_microbatches):
            n = where.get((stage, mb), Counter())
            r = s.stage_to_rank[stage]
            if n["F"] != 1:
                raise ScheduleError("counts", f"stage {stage}, micro-batch {mb} has {n['F']} forwards on rank {r}; "
                                    "expected exactly one", r, f"{stage}F{mb}")
            full, split = (n["B"], n["I"], n["W"]) == (1, 0, 0), (n["B"], n["I"], n["W"]) == (0, 1, 1)
            if not (full or split):
                raise ScheduleError("counts", f"stage {stage}, micro-batch {mb} has B x{n['B']}, I x{n['I']}, "
                                    f"W x{n['W']} on rank {r}; expected one B, or one I and one W", r,
                                    f"{stage}B{mb}")


def _check_order(s: PipelineSchedule) -> None:
    for r, acts in enumerate(s.compute):
        seen: set[tuple[str, int, int]] = set()
        for a in acts:
            if a.kind in ("B", "I") and ("F", a.stage, a.mb) not in seen:
                raise ScheduleError("order", f"rank {r} runs {a} before {a.stage}F{a.mb}: a backward needs its "
                                    "forward's activations", r, str(a))
            if a.kind == "W" and ("I", a.stage, a.mb) not in seen:
                raise ScheduleError("order", f"rank {r} runs {a} before {a.stage}I{a.mb}: W needs the output "
                                    "gradient that I receives", r, str(a))
            seen.add((a.kind, a.stage, a.mb))


def _check_dependencies(s: PipelineSchedule) -> None:
    if ideal_times(s) is not None:
        return
    # Replay with free messages to find where each rank stops, and what it waits for.
    done: set[tuple[str, int, int]] = set()
    pos = [0] * s.num_ranks
    last = s.num_stages - 1

    def need(a: Action) -> tuple[str, int, int] | None:
        if a.kind == "F":
            return ("F", a.stage - 1, a.mb) if a.stage > 0 else None
        if a.kind in ("B", "I"):
            return ("BI", a.stage + 1, a.mb) if a.stage < last else None
        return None

    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(s.compute):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                n = need(a)
                if n is not None and n not in done:
                    break
                done.add(("BI" if a.kind in ("B", "I") else a.kind, a.stage, a.mb))
                pos[r] += 1
                progress = True
    waits = []
    for r, acts in enumerate(s.compute):
        if pos[r] < len(acts):
            a = acts[pos[r]]
            n = need(a)
            assert n is not None
            what = f"{n[1]}F{n[2]}" if n[0] == "F" else f"the backward of stage {n[1]}, micro-batch {n[2]}"
            waits.append(f"rank {r} waits at {a} for {what} (rank {s.stage_to_rank[n[1]]})")
    first = next(r for r in range(s.num_ranks) if pos[r] < len(s.compute[r]))
    raise ScheduleError("dependencies", "the lists wait on each other in a cycle, even with free messages: "
                        + "; ".join(waits), first, str(s.compute[first][pos[first]]))


def validate_schedule(schedule: PipelineSchedule | Sequence[Sequence[Action | str]],
                      num_microbatches: int | None = None, *, stage_to_rank: Sequence[int] | None = None,
                      name: str | None = None, max_in_flight: Sequence[int] | None = None) -> None:
    """Raise :class:`ScheduleError` naming the first broken rule (module doc); return ``None`` when all hold.

    ``schedule``: a :class:`PipelineSchedule`, or one list per rank of compute actions (``Action`` or strings
    like ``"0F1"``) with ``num_microbatches`` and optionally ``stage_to_rank`` (default stage ``r`` on rank ``r``)
    and ``name`` (``"1f1b"`` / ``"zb-h1"`` switch on the in-flight limit). ``max_in_flight``: explicit per-rank
    limits instead.
    """
    s = _as_schedule(schedule, num_microbatches, stage_to_rank, name)
    _check_counts(s)
    _check_order(s)
    _check_dependencies(s)
    sim = simulate(s)
    if not sim.completed:
        raise ScheduleError("deadlock", f"with the {s.comm_plan!r} comm plan under NCCL matching: {sim.problem}")
    limits = list(max_in_flight) if max_in_flight is not None else (
        [s.num_ranks - r for r in range(s.num_ranks)] if (name or s.name) in _LIMITED else None)
    if limits is not None:
        for r, (peak, lim) in enumerate(zip(sim.peak_in_flight, limits)):
            if peak > lim:
                raise ScheduleError("in_flight", f"rank {r} has {peak} micro-batches in flight at once; "
                                    f"at most {lim} allowed (p - rank for 1F1B and ZB-H1)", r)
