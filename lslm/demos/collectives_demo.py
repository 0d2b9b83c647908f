"""Workers for notebook 02: every lslm collective next to torch.distributed's, bytes counted; the deadlock lesson."""

from __future__ import annotations

import re
import time
from typing import Any

import torch
import torch.distributed as dist

import lslm.collectives as C
from lslm.collectives.deadlock import blocking_ring_exchange, ordered_ring_exchange
from lslm.runtime import init_distributed


def _sent_received(comm: Any) -> tuple[int, int]:
    recs = [r for r in comm.ledger.records if r.label != C.CHECK_LABEL]
    return (sum(r.nbytes for r in recs if r.op == "send"), sum(r.nbytes for r in recs if r.op == "recv"))


def compare_with_torch(numel: int = 1000, root: int = 0) -> dict[str, Any]:
    """Each lslm algorithm and torch's collective on the same integer-valued fp32 data.

    Returns, per algorithm: whether this rank's result equals torch's bitwise, and the
    bytes this rank sent/received (ledger, the agreement check excluded) next to the
    formula of :data:`lslm.collectives.ALGORITHMS`. ``numel`` is N for all-reduce,
    broadcast, reduce, reduce-scatter and all-to-all, and one rank's block M for
    all-gather, scatter and gather.
    """
    with init_distributed() as ctx:
        n, r, comm = ctx.world_size, ctx.rank, ctx.comm
        gen = torch.Generator().manual_seed(r)  # on the host: the same draws on any device
        # small integers: every sum is exact
        x = torch.randint(-8, 8, (numel,), generator=gen).float().to(ctx.device)  # lslm: cpu-ok (host RNG, moved)
        rows = []
        for name, algo in C.ALGORITHMS.items():
            comm.ledger.reset()
            kind = algo.kind
            if kind == "all_reduce":
                got, want = x.clone(), x.clone()
                algo.fn(got, comm=comm)
                dist.all_reduce(want)
            elif kind == "broadcast":
                got, want = x.clone(), x.clone()
                algo.fn(got, src=root, comm=comm)
                dist.broadcast(want, src=root)
            elif kind == "reduce":
                got, want = x.clone(), x.clone()
                algo.fn(got, dst=root, comm=comm)
                dist.reduce(want, dst=root)
                if r != root:  # only the root's result is defined
                    got, want = got[:0], want[:0]
            elif kind == "all_gather":
                got, want = x.new_empty(n * numel), x.new_empty(n * numel)
                algo.fn(got, x, comm=comm)
                dist.all_gather(list(want.chunk(n)), x)
            elif kind == "reduce_scatter":
                size = numel // n
                got, want = x.new_empty(size), x.new_empty(size)
                algo.fn(got, x[: size * n].contiguous(), comm=comm)
                full = x[: size * n].clone()
                dist.all_reduce(full)
                want = full[r * size:(r + 1) * size]
            elif kind == "all_to_all":
                size = numel // n * n
                inp = x[:size].contiguous()
                got, want = x.new_empty(size), x.new_empty(size)
                algo.fn(got, inp, comm=comm)
                dist.all_to_all_single(want, inp)
            elif kind == "scatter":
                parts = [x + 100 * j for j in range(n)] if r == root else None
                got, want = x.new_empty(numel), x.new_empty(numel)
                algo.fn(got, parts, src=root, comm=comm)
                comm.ledger.enabled = False
                dist.scatter(want, parts, src=root)
                comm.ledger.enabled = True
            elif kind == "gather":
                got_list = [x.new_empty(numel) for _ in range(n)] if r == root else None
                want_list = [x.new_empty(numel) for _ in range(n)] if r == root else None
                algo.fn(x, got_list, dst=root, comm=comm)
                dist.gather(x, want_list, dst=root)
                got = torch.cat(got_list) if got_list else x[:0]
                want = torch.cat(want_list) if want_list else x[:0]
            else:  # pragma: no cover - the registry only holds the kinds above
                raise AssertionError(kind)
            sent, received = _sent_received(comm)
            m = numel // n * n if kind in ("reduce_scatter", "all_to_all") else numel
            rows.append({"algorithm": name, "kind": kind, "equal": bool(torch.equal(got, want)), "sent": sent,
                         "received": received, "sent_formula": algo.sent(n, r, m, 4, root),
                         "received_formula": algo.received(n, r, m, 4, root)})
        return {"rank": r, "rows": rows}


def ring_all_reduce_result(numel: int = 10) -> dict[str, Any]:
    """Ring all-reduce of ``arange(numel) + 100 * rank`` (to compare with the in-memory simulation)."""
    with init_distributed() as ctx:
        x = torch.arange(numel, dtype=torch.float32, device=ctx.device) + 100 * ctx.rank
        C.all_reduce_ring(x, comm=ctx.comm)
        return {"rank": ctx.rank, "result": x.tolist()}


def short_error(exc: BaseException) -> str:
    """The first line of ``exc``'s message; a leading ``[/build/path/file.cc:129]`` becomes ``(file.cc:129)``.

    gloo prefixes its errors with the source location on the machine that built torch: a path that
    says nothing about the learner's machine.
    """
    lines = str(exc).splitlines()
    line = lines[0] if lines else type(exc).__name__
    hit = re.match(r"^\[([^\]]+)\]\s*(.*)$", line)
    if hit:
        line = f"{hit.group(2)} ({hit.group(1).rsplit('/', 1)[-1]})"
    return line[:300]


def blocking_ring(numel: int = 1, timeout_s: float = 5.0) -> dict[str, Any]:
    """Worker: run :func:`~lslm.collectives.deadlock.blocking_ring_exchange` with a ``timeout_s`` process group;
    report how it ended.

    Returns ``{"rank", "world_size", "numel", "completed", "seconds", "error"}``:
    ``completed`` is False and ``seconds`` is about ``timeout_s`` when the ring deadlocked.
    ``error`` is the first line of the exception (:func:`short_error`: without the path of the
    machine that built torch).
    """
    ctx = init_distributed(timeout_s=timeout_s)
    start = time.perf_counter()
    try:
        blocking_ring_exchange(ctx.comm, numel, device=ctx.device)
        completed, error = True, ""
    except RuntimeError as exc:
        completed, error = False, short_error(exc)
    result = {"rank": ctx.rank, "world_size": ctx.world_size, "numel": numel, "completed": completed,
              "seconds": time.perf_counter() - start, "error": error}
    # No barrier before tearing down: the timed-out sends leave the group unusable.
    dist.destroy_process_group()
    return result


def ordered_ring(numel: int = 1, timeout_s: float = 5.0, mode: str = "even_odd") -> dict[str, Any]:
    """Worker: run :func:`~lslm.collectives.deadlock.ordered_ring_exchange`; report that it completed and got the
    left neighbour's data.

    Returns ``{"rank", "world_size", "numel", "mode", "completed", "seconds", "correct"}``.
    """
    with init_distributed(timeout_s=timeout_s) as ctx:
        start = time.perf_counter()
        got = ordered_ring_exchange(ctx.comm, numel, mode=mode, device=ctx.device)
        seconds = time.perf_counter() - start
        left = (ctx.rank - 1) % ctx.world_size
        return {"rank": ctx.rank, "world_size": ctx.world_size, "numel": numel, "mode": mode, "completed": True,
                "seconds": seconds, "correct": bool(torch.all(got == left))}
