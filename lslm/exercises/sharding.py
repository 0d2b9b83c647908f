"""Exercise of notebook 01: split ``n_items`` across ranks, as every data loader must.

Specification (the same as ``numpy.array_split``): rank ``r`` of ``world_size``
gets the contiguous half-open range ``[start, stop)``; the first
``n_items % world_size`` ranks get one item more than the others; the ranges
cover ``[0, n_items)`` in rank order without overlap.

Each rank calls the learner's function with its real ``RANK`` and ``WORLD_SIZE``;
rank 0 looks at all ranks' ranges of one input together, so the verdict can name
the mistake (remainder dropped, stop off by one or inclusive, overlap, order, balance).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lslm.exercises.core import Verdict, call_learner, check_each, collect_and_judge, report, run_check
from lslm.exercises.registry import Exercise, register

CASES = (0, 1, 2, 5, 7, 10, 11, 1000, 1003)


def reference_shard_range(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """Our solution: ``(start, stop)`` of rank ``rank``'s contiguous share of ``n_items``."""
    base, extra = divmod(n_items, world_size)
    start = rank * base + min(rank, extra)  # every earlier rank holds base items, the first `extra` one more
    return start, start + base + (1 if rank < extra else 0)


HINTS = {
    "shape": "return a pair of ints (start, stop)",
    "error": "run it by hand for n_items=5, world_size=2 and every rank first",
    "remainder_dropped": "n_items // world_size items per rank leaves n_items % world_size items to nobody: "
                         "the first n_items % world_size ranks take one extra item each",
    "inclusive_stop": "stop is exclusive, as in range(start, stop): a rank holding k items has stop = start + k",
    "off_by_one_stop": "the start is right but the stop is off by one: a rank below n_items % world_size holds "
                       "n_items // world_size + 1 items, the others n_items // world_size",
    "overlap": "two ranks would read the same items: each stop must be the next rank's start",
    "order": "these are the right ranges in the wrong order: rank 0 starts at 0 and each rank starts where the "
             "previous one stops",
    "gap": "some items belong to no rank: each stop must be the next rank's start, rank 0 starts at 0 and the "
           "last rank stops at n_items",
    "uneven": "the ranges cover every item once, but shard sizes must differ by at most one, the larger ones on "
              "the first ranks (n_items % world_size of them)",
}


def _kind(got: list[Any], want: list[tuple[int, int]], n: int) -> str:
    """Name the mistake in the ranges ``got`` of every rank for ``n`` items (``want``: the reference's)."""
    if any(isinstance(g, str) for g in got):
        return "error"
    if any(not isinstance(g, list) or len(g) != 2 for g in got):
        return "shape"
    world = len(got)
    base = n // world
    starts, stops = [g[0] for g in got], [g[1] for g in got]
    contiguous = starts[0] == 0 and all(stops[r] == starts[r + 1] for r in range(world - 1))
    if contiguous and all(b - a == base for a, b in got) and n % world:
        return "remainder_dropped"
    if all(g[0] == w[0] for g, w in zip(got, want)):
        if all(g[1] == w[1] - 1 for g, w in zip(got, want)):
            return "inclusive_stop"
        if all(abs(g[1] - w[1]) <= 1 for g, w in zip(got, want)):
            return "off_by_one_stop"
    if sorted(tuple(g) for g in got) == sorted(want):
        return "order"
    nonempty = sorted((a, b) for a, b in got if b > a)
    if any(nonempty[i][1] > nonempty[i + 1][0] for i in range(len(nonempty) - 1)):
        return "overlap"
    if contiguous and stops[-1] == n:
        return "uneven"
    return "gap"


def _judge(everyone: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """First input where some rank is wrong; the whole world's ranges for it decide the kind."""
    for n in CASES:
        got = [everyone[r][str(n)] for r in range(world)]  # JSON keys are strings
        want = [reference_shard_range(n, r, world) for r in range(world)]
        wrong = [r for r in range(world) if got[r] != list(want[r])]
        if not wrong:
            continue
        r = wrong[0]
        kind = _kind(got, want, n)
        shown = got[r] if isinstance(got[r], str) else tuple(got[r]) if isinstance(got[r], list) else got[r]
        all_ranges = ", ".join(str(tuple(g)) if isinstance(g, list) else repr(g) for g in got)
        return {"passed": False, "hint": HINTS[kind],
                "message": f"rank {r}, n_items={n}: expected {want[r]}, got {shown} (all ranks: {all_ranges})",
                "details": {"kind": kind, "rank": r, "n_items": n, "expected": list(want[r]), "got": got[r]}}
    return {"passed": True, "message": "ok"}


def _check_one(fn: Callable[[int, int, int], Any], ctx: Any) -> dict[str, Any] | None:
    got: dict[str, Any] = {}
    for n in CASES:
        try:
            value = call_learner(fn, n, ctx.rank, ctx.world_size, label=f"n_items={n}")
            got[str(n)] = [int(v) for v in value]
        except Exception as exc:  # noqa: BLE001 - the learner's bug becomes the verdict
            got[str(n)] = f"raised {type(exc).__name__}: {exc}"
    return collect_and_judge(got, lambda everyone: _judge(everyone, ctx.world_size))


def worker(module: str, name: str | list[str]) -> Any:
    """Each rank calls the learner's function with its real RANK/WORLD_SIZE; rank 0 judges."""
    return check_each(module, name, _check_one)


def check_shard_range(fn: Callable[[int, int, int], tuple[int, int]], world_sizes: tuple[int, ...] = (2, 3)) -> Verdict:
    """Check the learner's ``shard_range(n_items, rank, world_size)`` on real processes and print the verdict.

    ``fn`` may be a tuple ``(shard_range, helper, SomeClass, ...)`` of cell-defined objects it uses.
    """
    return report(run_check(fn, "lslm.exercises.sharding:worker", world_sizes, timeout=60, exercise="shard_range"))


register(Exercise(
    name="shard_range", notebook="01_multiprocessing", reference=reference_shard_range, check=check_shard_range,
    hints=("with base, extra = divmod(n_items, world_size), every rank holds base items and the first `extra` "
           "ranks one more; the ranges are contiguous and in rank order",
           "rank r starts after r ranks of base items plus min(r, extra) extra ones; stop = start + its size")))
