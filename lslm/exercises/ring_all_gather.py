"""Exercise of notebook 02: ring all-gather from point-to-point messages.

The learner writes ``ring_all_gather(output, input, rank, world_size)``: ``input``
holds this rank's M elements, ``output`` (n x M, flat) must end with every rank's
block in rank order, using only point-to-point calls (``dist.send/recv/isend/irecv``
or ``dist.batch_isend_irecv``). A step that sends to one neighbour and receives from
the other should post both in one ``batch_isend_irecv`` and wait on every returned
work: on 2 ranks both neighbours are the same peer, and separately posted
``isend``/``irecv`` to one peer can deadlock on NCCL for large messages.

The checker runs it on real processes, with torch's collectives disabled during the
call and every point-to-point call recorded: a ring means each rank sends only to its right
neighbour, ``(rank + 1) % n``, and receives only from its left one, so an answer that sends
its block straight to every rank (correct output, not a ring) is rejected; on 2 ranks both
neighbours are the same peer, so it is the 3-process case that tells them apart. Every rank's
input is a known function of (rank, M), so each rank judges its
own output without a collective of the checker's; a ring that deadlocks is stopped
after a few seconds and reported as a deadlock naming the ranks that never returned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from lslm.exercises.core import (
    DEADLOCK_ENV,
    Verdict,
    call_learner,
    check_each,
    collect_and_judge,
    report,
    run_check,
)
from lslm.exercises.recorded import collectives_recorded
from lslm.exercises.registry import Exercise, register
from lslm.runtime.records import CommLedger

CASES = ((1, torch.float32), (5, torch.float32), (1000, torch.float32), (7, torch.int64))
FILL = -999  # what output holds before the call: a block still equal to it was never written
DEADLOCK_S = 10.0  # a correct ring on these sizes takes milliseconds per call
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "broadcast",
                "all_to_all_single", "gather", "scatter", "reduce_scatter_tensor", "all_gather_object")


def reference_ring_all_gather(output: torch.Tensor, input: torch.Tensor, rank: int, world_size: int) -> None:
    """Our solution: n-1 steps; in step s send block (rank-s) right, receive block (rank-s-1) from the left."""
    n, m = world_size, input.numel()
    output[rank * m:(rank + 1) * m] = input
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):
        send_block, recv_block = (rank - s) % n, (rank - s - 1) % n
        ops = [dist.P2POp(dist.isend, output[send_block * m:(send_block + 1) * m], right),
               dist.P2POp(dist.irecv, output[recv_block * m:(recv_block + 1) * m], left)]
        for work in dist.batch_isend_irecv(ops):  # one batch: safe on NCCL even when left == right
            work.wait()


def _refuse(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"torch.distributed.{name} is off during this exercise: "
                           "use send/recv/isend/irecv or batch_isend_irecv")
    return refuse


@contextlib.contextmanager
def _collectives_disabled() -> Iterator[None]:
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    try:
        for name in saved:
            setattr(dist, name, _refuse(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _off_ring(log: list[tuple[str, Any]], rank: int, n: int) -> dict[str, Any] | None:
    """The first send not to ``rank + 1``, else the first receive not from ``rank - 1`` (mod n), else None."""
    want = {"send": (rank + 1) % n, "recv": (rank - 1) % n}
    for op in ("send", "recv"):
        for kind, peer in log:
            if kind == op and peer is not None and peer != want[kind]:
                return {"kind": "not_ring", "op": kind, "peer": peer, "neighbour": want[kind]}
    return None


def _input(rank: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input for M=``m``: host RNG seeded by (rank, m), so any rank can rebuild anyone's."""
    gen = torch.Generator().manual_seed(1000 * rank + m)
    return torch.randint(-50, 50, (m,), generator=gen).to(dtype)  # lslm: cpu-ok (checkers launch on gloo/CPU)


def _diagnose(got: torch.Tensor, rank: int, n: int, m: int, dtype: torch.dtype) -> dict[str, Any] | None:
    """None if ``got`` is the all-gather, else the first wrong block and what it holds instead."""
    inputs = [_input(r, m, dtype) for r in range(n)]
    for j in range(n):
        block = got[j * m:(j + 1) * m]
        if torch.equal(block, inputs[j]):
            continue
        bad = int((block != inputs[j]).nonzero()[0].item())
        holds = next((k for k in range(n) if k != j and torch.equal(block, inputs[k])), None)
        if j == rank:
            kind = "own_block"
        elif torch.all(block == FILL):
            kind = "never_written"
        elif holds is not None:
            kind = "wrong_block"
        else:
            kind = "wrong"
        return {"kind": kind, "block": j, "holds": holds, "index": j * m + bad,
                "expected": inputs[j][bad].item(), "got": block[bad].item()}
    return None


def _check_one(fn: Callable[..., Any], ctx: Any) -> dict[str, Any] | None:
    n, r = ctx.world_size, ctx.rank
    problems: list[dict[str, Any]] = []
    for m, dtype in CASES:
        got = torch.full((n * m,), FILL, dtype=dtype, device=ctx.device)
        where = {"m": m, "dtype": str(dtype).removeprefix("torch.")}
        ledger = CommLedger()
        try:
            with _collectives_disabled(), collectives_recorded(ledger):
                call_learner(fn, got, _input(r, m, dtype).to(ctx.device), r, n, label=f"M={m}, {where['dtype']}")
        except Exception as exc:  # noqa: BLE001 - the learner's error becomes the verdict
            kind = "collective" if "is off during this exercise" in str(exc) else "error"
            problems.append({**where, "kind": kind, "error": f"{type(exc).__name__}: {exc}"})
            break
        log = [(rec.op, rec.peer) for rec in ledger.records if rec.op in ("send", "recv")]
        found = _diagnose(got.cpu(), r, n, m, dtype) or _off_ring(log, r, n)
        if found:
            problems.append({**where, **found})
            break
    return collect_and_judge(problems, _judge)


def worker(module: str, name: str | list[str]) -> Any:
    """Each rank runs the learner's function on every case and judges its own output; rank 0 reports."""
    # gloo's own timeout stays above the watchdog's: call_learner names a deadlock before gloo raises.
    return check_each(module, name, _check_one, timeout_s=3 * float(os.environ.get(DEADLOCK_ENV, DEADLOCK_S)))


HINTS = {
    "error": "run it by hand on one process first (world_size=1: output must equal input)",
    "collective": "only send/recv/isend/irecv/batch_isend_irecv are allowed; post one send and one receive per step",
    "never_written": "a block of output was never written: in n-1 steps each rank must receive n-1 blocks, one "
                     "per step, into the block's own slot",
    "own_block": "copy your own input into output[rank*M:(rank+1)*M] before the first step",
    "wrong_block": "a block landed in the wrong slot: in step s you receive from the left neighbour the block "
                   "(rank - s - 1) % world_size (the one it received in step s-1), and block j belongs at "
                   "output[j*M:(j+1)*M]",
    "wrong": "block j of output must be rank j's input; in step s forward the block you received in step s-1",
    "not_ring": "the output is right but it is not a ring: each rank may send only to its right neighbour "
                "(rank + 1) % world_size and receive only from its left one (rank - 1) % world_size; in step s "
                "forward the block you received in step s-1 (a ring keeps every link busy with one block at a "
                "time; sending your block to everyone puts n-1 messages on your own link)",
}


def _judge(everyone: list[list[dict[str, Any]]]) -> dict[str, Any]:
    for rank, probs in enumerate(everyone):
        if not probs:
            continue
        p = probs[0]
        case = f"M={p['m']}, {p['dtype']}"
        if "error" in p:
            msg = f"rank {rank} ({case}): {p['error']}"
        elif p["kind"] == "not_ring":
            verb, only, prep = ("sent", "sends", "to") if p["op"] == "send" else ("received", "receives", "from")
            msg = (f"rank {rank} ({case}): {verb} a block {prep} rank {p['peer']}; in a ring it {only} only "
                   f"{prep} rank {p['neighbour']}")
        elif p["kind"] == "wrong_block":
            msg = (f"rank {rank} ({case}): block {p['block']} of output holds rank {p['holds']}'s input "
                   f"(output[{p['index']}] expected {p['expected']}, got {p['got']})")
        else:
            msg = (f"rank {rank} ({case}): output[{p['index']}] (block {p['block']}) expected {p['expected']}, "
                   f"got {p['got']}" + (" (never written)" if p["kind"] == "never_written" else ""))
        return {"passed": False, "message": msg, "hint": HINTS[p["kind"]], "details": {"rank": rank, **p}}
    return {"passed": True, "message": "ok"}


def check_ring_all_gather(fn: Callable[..., Any], world_sizes: tuple[int, ...] = (2, 3),
                          deadlock_s: float = DEADLOCK_S) -> Verdict:
    """Check the learner's ``ring_all_gather(output, input, rank, world_size)`` and print the verdict.

    ``fn`` may be a tuple ``(ring_all_gather, helper, SomeClass, ...)`` of cell-defined objects it uses.
    A call still running after ``deadlock_s`` seconds is reported as a deadlock.
    """
    return report(run_check(fn, "lslm.exercises.ring_all_gather:worker", world_sizes, timeout=180,
                            exercise="ring_all_gather", deadlock_s=deadlock_s))


register(Exercise(
    name="ring_all_gather", notebook="02_collectives", reference=reference_ring_all_gather,
    check=check_ring_all_gather,
    hints=("copy your input into your own block, then take n-1 steps: in each, send one block to the right "
           "neighbour and receive one from the left; the block you receive is the one you forward next step",
           "in step s send block (rank - s) % n and receive block (rank - s - 1) % n; post the send and the "
           "receive together with dist.batch_isend_irecv([P2POp(dist.isend, ...), P2POp(dist.irecv, ...)]) and "
           "wait on every returned work: a blocking send on every rank first would deadlock")))
