"""Exercise of notebook 04b: the communication a bucketed DDP step cannot hide.

The learner writes ``exposed_comm(buckets, n, alpha, beta, backward_s)``: ``buckets`` are the
bucket sizes in bytes in the order backward fills them, ``n`` the number of ranks, ``alpha`` and
``beta`` the ring all-reduce's constants (seconds per message, seconds per byte), ``backward_s``
the duration of backward. Under the step-time model of :mod:`lslm.metrics.step_time`:

* one bucket of ``S`` bytes all-reduces in ``t(S) = 2(n-1) alpha + 2(n-1)/n S beta`` (0 for ``n = 1``);
* bytes become ready at a constant rate, so bucket ``k`` is ready at ``r_k = T_b C_k / G``
  (``C_k``: bytes of buckets ``0..k``, ``G``: all of them);
* one channel: bucket ``k`` all-reduces from ``s_k = max(r_k, e_{k-1})`` to ``e_k = s_k + t(S_k)``;

and the exposed communication is ``E = e_last - T_b``. The checker needs no processes: it compares
the answer with :func:`lslm.metrics.step_time.exposed_comm_s` on cases where each classic mistake
(no overlap at all, perfect overlap, no queue on the channel, the wrong cost of one all-reduce)
gives another number, and names the mistake it recognises.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from lslm.exercises.core import Verdict, report, run_local
from lslm.exercises.registry import Exercise, register

#: (buckets in bytes, n, alpha s, beta s/byte, backward s): hidden but one; channel-bound; unequal buckets;
#: more ranks; one rank.
CASES: tuple[tuple[tuple[float, ...], int, float, float, float], ...] = (
    ((4e6,) * 4, 2, 1e-4, 1e-9, 0.030),
    ((4e6,) * 4, 2, 1e-4, 1e-9, 0.008),
    ((1e6, 8e6, 2e6, 5e5), 2, 2e-4, 1.5e-9, 0.012),
    ((2e6,) * 6, 8, 5e-5, 5e-10, 0.010),
    ((4e6,) * 3, 1, 1e-4, 1e-9, 0.010),
)
REL_TOL = 1e-9


def reference_exposed_comm(buckets: Sequence[float], n: int, alpha: float, beta: float,
                           backward_s: float) -> float:
    """Our solution: walk the buckets in order on one channel; what is left after backward ends is exposed."""
    def t(size: float) -> float:  # ring all-reduce of one bucket
        return 0.0 if n == 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * size * beta

    total, done, end = sum(buckets), 0.0, 0.0
    for size in buckets:
        done += size
        ready = backward_s * done / total  # bytes become ready at a constant rate during backward
        end = max(ready, end) + t(size)    # one channel: wait for the bucket and for the previous all-reduce
    return end - backward_s


def _cost(n: int, alpha: float, beta: float, kind: str = "ring") -> Callable[[float], float]:
    if kind == "p2p":  # one message of S bytes, as if there were no ring
        return lambda s: alpha + s * beta
    if kind == "no_over_n":  # 2(n-1) S beta: every step moving the whole bucket, not a 1/n chunk
        return lambda s: 0.0 if n == 1 else 2 * (n - 1) * (alpha + s * beta)
    return lambda s: 0.0 if n == 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta


def _schedule(buckets: Sequence[float], backward_s: float, t: Callable[[float], float], queue: bool = True) -> float:
    total, done, end, last = float(sum(buckets)), 0.0, 0.0, 0.0
    for size in buckets:
        done += size
        ready = backward_s * done / total
        end = (max(ready, end) if queue else ready) + t(size)
        last = max(last, end)
    return last - backward_s


def _mistakes(buckets: Sequence[float], n: int, alpha: float, beta: float, backward_s: float) -> dict[str, float]:
    """What each classic mistake returns on one case."""
    t = _cost(n, alpha, beta)
    comm = sum(t(s) for s in buckets)
    return {"no_overlap": comm, "perfect_overlap": max(0.0, comm - backward_s),
            "no_queue": _schedule(buckets, backward_s, t, queue=False),
            "ring_cost": _schedule(buckets, backward_s, _cost(n, alpha, beta, "p2p")),
            "ring_cost_n": _schedule(buckets, backward_s, _cost(n, alpha, beta, "no_over_n"))}


HINTS = {
    "type": "return the exposed time in seconds, as a float",
    "no_overlap": "you returned the time of all the all-reduces back to back: that is what a step pays with no "
                  "overlap; buckets all-reduce while backward still runs, so only what is left after T_b shows",
    "perfect_overlap": "W - T_b assumes the channel can start at once and never waits for a bucket; bucket k is "
                       "ready only at T_b * C_k / G, and the last one only when backward ends, so at least its own "
                       "all-reduce is always exposed",
    "no_queue": "there is one channel: a bucket's all-reduce starts at max(its ready time, the end of the previous "
                "all-reduce), not as soon as the bucket is ready",
    "ring_cost": "one bucket's ring all-reduce costs 2(n-1) alpha + 2(n-1)/n * S * beta: 2(n-1) steps, each "
                 "sending a 1/n chunk of the bucket",
    "wrong": "walk the buckets in order: ready r_k = T_b * C_k / G, start s_k = max(r_k, e_(k-1)), end "
             "e_k = s_k + t(S_k); the answer is e_last - T_b",
}


def _judge(fn: Callable[..., Any]) -> dict[str, Any]:
    from lslm.metrics.step_time import LinkCost, exposed_comm_s

    for buckets, n, alpha, beta, backward in CASES:
        args = (list(buckets), n, alpha, beta, backward)
        got = fn(*args)
        where = (f"buckets of {', '.join(f'{b / 1e6:g}' for b in buckets)} MB, n={n}, alpha={alpha * 1e6:g} us, "
                 f"1/beta={1 / beta / 1e9:g} GB/s, backward {backward * 1e3:g} ms")
        if isinstance(got, bool) or not isinstance(got, int | float) or not math.isfinite(got):
            return {"passed": False, "message": f"{where}: you returned {got!r}, not a number of seconds",
                    "hint": HINTS["type"], "details": {"kind": "type"}}
        want = exposed_comm_s(list(buckets), n, LinkCost(alpha, beta), backward)
        if math.isclose(got, want, rel_tol=REL_TOL, abs_tol=1e-15):
            continue
        kind = next((k for k, v in _mistakes(*args).items() if math.isclose(got, v, rel_tol=1e-6, abs_tol=1e-15)),
                    "wrong")
        kind = "ring_cost" if kind.startswith("ring_cost") else kind
        return {"passed": False, "message": f"{where}: expected {want * 1e3:.4f} ms exposed, you returned "
                                            f"{got * 1e3:.4f} ms",
                "hint": HINTS[kind], "details": {"kind": kind, "case": args, "expected": want, "got": got}}
    return {"passed": True, "message": f"matches lslm.metrics.step_time.exposed_comm_s on all {len(CASES)} cases "
                                       "(mostly hidden, channel-bound, unequal buckets, 8 ranks, 1 rank)"}


def check_exposed_comm(fn: Callable[..., float]) -> Verdict:
    """Check the learner's ``exposed_comm(buckets, n, alpha, beta, backward_s)``; print the verdict (no processes)."""
    return report(run_local(fn, _judge, exercise="exposed_comm"))


register(Exercise(
    name="exposed_comm", notebook="04b_ddp_in_practice", reference=reference_exposed_comm,
    check=check_exposed_comm,
    hints=("write t(S), one bucket's ring all-reduce time, first; then walk the buckets in order, keeping the "
           "time the channel becomes free",
           "bucket k is ready at T_b * C_k / G (C_k: bytes of buckets 0..k), starts at max(ready, end of the "
           "previous all-reduce) and ends t(S_k) later; return end_last - T_b")))
