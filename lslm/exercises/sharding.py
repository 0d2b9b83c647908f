"""Exercise of notebook 01: split ``n_items`` across ranks, as every data loader must.

Specification (the same as ``numpy.array_split``): rank ``r`` of ``world_size``
gets the contiguous half-open range ``[start, stop)``; the first
``n_items % world_size`` ranks get one item more than the others; the ranges
cover ``[0, n_items)`` in rank order without overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lslm.exercises.core import Verdict, load_learner_function, report, run_check

CASES = (0, 1, 2, 5, 7, 10, 11, 1000, 1003)


def reference_shard_range(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """Our solution: ``(start, stop)`` of rank ``rank``'s contiguous share of ``n_items``."""
    base, extra = divmod(n_items, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def worker(module: str, name: str) -> dict[str, Any]:
    """Each rank calls the learner's function with its real RANK/WORLD_SIZE; rank 0 judges."""
    from lslm.runtime import init_distributed

    fn = load_learner_function(module, name)
    with init_distributed() as ctx:
        got = {}
        for n in CASES:
            try:
                value = fn(n, ctx.rank, ctx.world_size)
                got[n] = [int(v) for v in value]
            except Exception as exc:  # noqa: BLE001 - the learner's bug becomes the verdict
                got[n] = f"raised {type(exc).__name__}: {exc}"
        everyone: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(everyone, got)
        return _judge(everyone, ctx.world_size)


def _judge(everyone: list[dict[int, Any]], world: int) -> dict[str, Any]:
    for n in CASES:
        for rank in range(world):
            got = everyone[rank][n]
            want = list(reference_shard_range(n, rank, world))
            if got != want:
                hint = ("the first n_items % world_size ranks take one extra item"
                        if isinstance(got, list) and len(got) == 2 and got[1] - got[0] != want[1] - want[0]
                        else "return (start, stop) with stop exclusive; shards must be contiguous, in rank order")
                return {"passed": False, "hint": hint,
                        "message": f"rank {rank}, n_items={n}: expected {tuple(want)}, got {got}",
                        "details": {"rank": rank, "n_items": n, "expected": want, "got": got}}
    return {"passed": True, "message": "ok"}


def check_shard_range(fn: Callable[[int, int, int], tuple[int, int]], world_sizes: tuple[int, ...] = (2, 3)) -> Verdict:
    """Check the learner's ``shard_range(n_items, rank, world_size)`` on real processes and print the verdict."""
    return report(run_check(fn, "lslm.exercises.sharding:worker", world_sizes))
