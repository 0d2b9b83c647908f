"""The ring all-reduce, simulated step by step without communication, for pictures.

Each of ``n`` ranks starts with its own vector cut into ``n`` chunks. The trace
records, after every step, which ranks' contributions each chunk of each rank
holds. Phase 1 (reduce-scatter, n-1 steps; steps counted from 0): at step s rank
r sends chunk (r - s - 1) mod n to rank r+1, which adds it to its own copy;
afterwards rank r owns the complete sum of chunk r. Phase 2 (all-gather, n-1
steps): at step s rank r sends chunk (r - s) mod n, so the complete chunks travel
once more around the ring, overwriting stale copies.
Same schedule as :func:`lslm.collectives.all_reduce_ring`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RingStep:
    """State after one step: ``holds[r][c]`` is the set of ranks summed in rank r's chunk c."""

    phase: str  # "start", "reduce-scatter" or "all-gather"
    step: int
    holds: tuple[tuple[frozenset[int], ...], ...]
    sends: tuple[tuple[int, int, int], ...]  # (src rank, dst rank, chunk index) during this step


def ring_all_reduce_trace(n: int) -> list[RingStep]:
    """Every state of a ring all-reduce on ``n`` ranks: the start, n-1 reduce-scatter and n-1 all-gather steps."""
    if n < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got n={n}")
    holds = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    trace = [RingStep("start", 0, tuple(map(tuple, holds)), ())]
    for s in range(n - 1):
        sends = tuple((r, (r + 1) % n, (r - s - 1) % n) for r in range(n))
        new = [row[:] for row in holds]
        for src, dst, c in sends:
            new[dst][c] = holds[dst][c] | holds[src][c]
        holds = new
        trace.append(RingStep("reduce-scatter", s + 1, tuple(map(tuple, holds)), sends))
    for s in range(n - 1):
        sends = tuple((r, (r + 1) % n, (r - s) % n) for r in range(n))
        new = [row[:] for row in holds]
        for src, dst, c in sends:
            new[dst][c] = holds[src][c]
        holds = new
        trace.append(RingStep("all-gather", s + 1, tuple(map(tuple, holds)), sends))
    assert all(h == frozenset(range(n)) for row in holds for h in row)
    return trace


def simulate_ring_all_reduce(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the ring schedule on in-memory tensors (one per rank); returns each rank's result.

    Uses the same chunking rule as the real collective (the first N mod n chunks one
    element longer), so it can be compared with a launched run element for element.
    """
    n = len(inputs)
    bufs = [x.clone().reshape(-1) for x in inputs]
    numel = bufs[0].numel()
    base, extra = divmod(numel, n)
    bounds = []
    start = 0
    for c in range(n):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    for s in range(n - 1):
        moved = [(r, (r + 1) % n, (r - s - 1) % n) for r in range(n)]
        payload = [bufs[src][slice(*bounds[c])].clone() for src, _, c in moved]
        for (_, dst, c), data in zip(moved, payload):
            bufs[dst][slice(*bounds[c])] += data
    for s in range(n - 1):
        moved = [(r, (r + 1) % n, (r - s) % n) for r in range(n)]
        payload = [bufs[src][slice(*bounds[c])].clone() for src, _, c in moved]
        for (_, dst, c), data in zip(moved, payload):
            bufs[dst][slice(*bounds[c])] = data
    return [b.reshape(x.shape) for b, x in zip(bufs, inputs)]
