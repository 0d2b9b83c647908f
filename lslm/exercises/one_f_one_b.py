"""Exercise of notebook 06: write the 1F1B instruction list of one pipeline rank.

The learner writes ``one_f_one_b_order(p, m, rank)``: the order in which rank ``rank`` of a
``p``-stage pipeline (one stage per rank, stage ``rank``) runs the forward (``"F3"``) and
backward (``"B3"``) passes of ``m`` micro-batches under 1F1B (PipeDream-Flush, Narayanan et
al. 2021, section 2.2; Megatron's non-interleaved schedule): a warm-up of forwards, a steady
state alternating one forward and one backward, a cool-down of backwards.

The checker needs no processes. For several ``(p, m)`` it builds every rank's list, turns it
into a :class:`~lslm.pipeline.schedules.PipelineSchedule` and plays it on the simulator
(:mod:`lslm.pipeline.simulator`, forward 1 unit, backward 2, communication free). It accepts
the answer when, on every rank:

1. each micro-batch has exactly one ``F`` and one ``B``, the ``F`` first;
2. the simulation completes: every action's inputs exist when it runs and no rank waits for
   a message that is never sent (the ranks exchange activations and gradients in the order
   the lists imply);
3. at most ``p - rank`` micro-batches are in flight (forward done, backward not yet): 1F1B's
   memory bound, which GPipe breaks;
4. the step takes ``(m + p - 1) x (F + B)`` units, the shortest any schedule can do with
   this split: 1F1B's bubble, not the naive schedule's.

Cases include fewer micro-batches than stages (``m < p``), where the warm-up must be clamped
to ``m`` forwards.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from lslm.exercises.core import Verdict, report, run_local
from lslm.exercises.registry import Exercise, register

#: (p, m) cases: m >= p (every rank reaches the steady state), then m < p (fewer micro-batches than stages:
#: a warm-up of p - 1 - rank forwards would run micro-batches that do not exist, so it is min(p - 1 - rank, m)).
CASES = ((2, 2), (2, 5), (3, 6), (4, 4), (4, 8), (4, 2), (3, 1))
COSTS = {"F": 1.0, "B": 2.0}
_ITEM = re.compile(r"^([FB])(\d+)$")
_ITEM_ANY = re.compile(r"^[FB]-?\d+$")  # also negative micro-batch numbers: what an unclamped warm-up produces


def reference_one_f_one_b_order(p: int, m: int, rank: int) -> list[str]:
    """Our solution: ``p - 1 - rank`` warm-up forwards, then one forward and one backward at a time, then backwards.

    Rank ``rank`` may run ``p - 1 - rank`` forwards before the first backward reaches it
    (the last stage runs each backward right after its forward); after that, every
    forward is paired with the backward of the oldest micro-batch still in flight.
    """
    warmup = min(p - 1 - rank, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    order += [f"B{i}" for i in range(m - warmup, m)]
    return order


HINTS = {
    "few_microbatches": "with fewer micro-batches than stages (m < p) a warm-up of p - 1 - rank forwards asks for "
                        "micro-batches that do not exist: warm up with min(p - 1 - rank, m) forwards",
    "type": "return a list of strings such as ['F0', 'F1', 'B0', ...]: 'F' or 'B' then the micro-batch number",
    "count": "every micro-batch 0 .. m-1 needs exactly one forward 'F<i>' and one backward 'B<i>' on every rank",
    "b_before_f": "a micro-batch's backward needs its forward's saved activations: 'F<i>' must come before 'B<i>'",
    "stuck": "the ranks exchange tensors in the order your lists imply: rank r's B<i> needs rank r+1's B<i> first, "
             "and its F<i> needs rank r-1's F<i>; run the micro-batches' backwards in the order of their forwards",
    "gpipe": "all forwards first is GPipe: rank r then holds m micro-batches' activations; 1F1B starts backwards "
             "as soon as they arrive, so at most p - r are ever in flight",
    "in_flight": "rank r can afford p - r micro-batches in flight; its warm-up is p - 1 - r forwards (the last rank "
                 "runs each backward right after its forward), then one forward and one backward at a time",
    "slow": "valid and within memory, but slower than 1F1B: the steady state must alternate one forward and one "
            "backward so no rank waits; warm up with p - 1 - rank forwards",
}


def _parse(order: Any, m: int) -> list[tuple[str, int]] | None:
    if not isinstance(order, list | tuple):
        return None
    out = []
    for item in order:
        hit = _ITEM.match(item.strip()) if isinstance(item, str) else None
        if hit is None or int(hit.group(2)) >= m:
            return None
        out.append((hit.group(1), int(hit.group(2))))
    return out


def _fail(kind: str, message: str, **details: Any) -> dict[str, Any]:
    return {"passed": False, "message": message, "hint": HINTS[kind], "details": {"kind": kind, **details}}


def _is_gpipe(fn: Callable[[int, int, int], Any]) -> bool:
    """True when ``fn`` runs every forward before any backward, on every rank, with more micro-batches than ranks."""
    p, m = 2, 5  # at m <= p a too-long warm-up and GPipe can be the same lists; here they differ
    return all(list(fn(p, m, r))[:m] == [f"F{i}" for i in range(m)] for r in range(p))


def _judge_case(fn: Callable[[int, int, int], Any], p: int, m: int) -> dict[str, Any] | None:
    from lslm.pipeline.schedules import schedule_from_lists
    from lslm.pipeline.simulator import simulate

    where = f"p={p}, m={m}"
    lists = []
    for rank in range(p):
        got = fn(p, m, rank)
        items = _parse(got, m)
        if items is None and m < p and isinstance(got, list | tuple) and got and all(
                isinstance(x, str) and _ITEM_ANY.match(x.strip()) for x in got):
            return _fail("few_microbatches", f"{where}, rank {rank}: {list(got)!r} names micro-batches outside "
                         f"0..{m - 1}", p=p, m=m, rank=rank)
        if items is None:
            return _fail("type", f"{where}, rank {rank}: {got!r} is not a list of 'F<i>' / 'B<i>' with i < {m}",
                         p=p, m=m, rank=rank)
        for i in range(m):
            nf, nb = items.count(("F", i)), items.count(("B", i))
            if (nf, nb) != (1, 1):
                return _fail("count", f"{where}, rank {rank}: micro-batch {i} has {nf} forward(s) and {nb} "
                             "backward(s); expected one of each", p=p, m=m, rank=rank, mb=i)
            if items.index(("B", i)) < items.index(("F", i)):
                return _fail("b_before_f", f"{where}, rank {rank}: B{i} comes before F{i}", p=p, m=m, rank=rank)
        lists.append([f"{rank}{kind}{i}" for kind, i in items])
    sim = simulate(schedule_from_lists(lists, m), costs=COSTS)
    if not sim.completed:
        return _fail("stuck", f"{where}: the pipeline cannot run these lists: {sim.problem}", p=p, m=m)
    for rank, peak in enumerate(sim.peak_in_flight):
        if peak > p - rank:
            return _fail("gpipe" if _is_gpipe(fn) else "in_flight",
                         f"{where}, rank {rank}: {peak} micro-batches in flight at once; 1F1B keeps at most "
                         f"p - rank = {p - rank}", p=p, m=m, rank=rank, peak=peak)
    best = (m + p - 1) * (COSTS["F"] + COSTS["B"])
    took = sim.timeline.makespan()
    if took > best + 1e-9:
        return _fail("slow", f"{where}: your schedule takes {took:g} time units (forward 1, backward 2); 1F1B "
                     f"takes (m + p - 1) x 3 = {best:g}", p=p, m=m, makespan=took)
    return None


def _judge(fn: Callable[[int, int, int], Any]) -> dict[str, Any]:
    for p, m in CASES:
        failure = _judge_case(fn, p, m)
        if failure is not None:
            return failure
    cases = ", ".join(f"(p={p}, m={m})" for p, m in CASES)
    return {"passed": True, "message": f"valid, within p - rank in flight and as fast as 1F1B for {cases}"}


def check_one_f_one_b_order(fn: Callable[[int, int, int], list[str]]) -> Verdict:
    """Check the learner's ``one_f_one_b_order(p, m, rank)`` on the simulator (no processes); print the verdict."""
    return report(run_local(fn, _judge, exercise="one_f_one_b_order"))


register(Exercise(
    name="one_f_one_b_order", notebook="06_pipeline_parallel", reference=reference_one_f_one_b_order,
    check=check_one_f_one_b_order,
    hints=("three phases: warm-up forwards, a steady state of one forward then one backward, a cool-down of "
           "backwards; the last rank has no warm-up at all",
           "rank r warms up with min(p - 1 - r, m) forwards; then for each remaining forward F<k> it runs F<k> "
           "followed by the backward of the oldest micro-batch in flight; the rest are backwards in order")))
