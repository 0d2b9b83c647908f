"""Exercise of notebook 02: ring all-gather from point-to-point messages.

The learner writes ``ring_all_gather(output, input, rank, world_size)``: ``input``
holds this rank's M elements, ``output`` (n x M, flat) must end with every rank's
block in rank order, using only point-to-point calls (``dist.send/recv/isend/irecv``
or ``dist.batch_isend_irecv``). A step that sends to one neighbour and receives from
the other should post both in one ``batch_isend_irecv`` and wait on every returned
work: on 2 ranks both neighbours are the same peer, and separately posted
``isend``/``irecv`` to one peer can deadlock on NCCL for large messages. The checker runs
it on real processes against ``torch.distributed``'s all-gather, with torch's
collectives disabled during the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from lslm.exercises.core import Verdict, load_learner_function, report, run_check

CASES = ((1, torch.float32), (5, torch.float32), (1000, torch.float32), (7, torch.int64))
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "broadcast",
                "all_to_all_single", "gather", "scatter", "reduce_scatter_tensor", "all_gather_object")


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


def worker(module: str, name: str) -> dict[str, Any]:
    """Each rank runs the learner's function on every case; rank 0 reports the first mismatch."""
    from lslm.runtime import init_distributed

    fn = load_learner_function(module, name)
    # A deadlocked solution ends with a timeout error here instead of hanging the notebook.
    with init_distributed(timeout_s=20) as ctx:
        n, r = ctx.world_size, ctx.rank
        problems: list[dict[str, Any]] = []
        for m, dtype in CASES:
            gen = torch.Generator().manual_seed(1000 * r + m)  # host RNG: the same inputs on any device
            inp = torch.randint(-50, 50, (m,), generator=gen).to(ctx.device, dtype)  # lslm: cpu-ok (host RNG, moved)
            want = torch.empty(n * m, dtype=dtype, device=ctx.device)
            ctx.comm.all_gather_into_tensor(want, inp)
            got = torch.full((n * m,), -999, dtype=dtype, device=ctx.device)
            try:
                with _collectives_disabled():
                    fn(got, inp.clone(), r, n)
            except Exception as exc:  # noqa: BLE001 - the learner's error becomes the verdict
                problems.append({"m": m, "dtype": str(dtype), "error": f"{type(exc).__name__}: {exc}"})
                break
            if not torch.equal(got, want):
                bad = int((got != want).nonzero()[0].item())
                problems.append({"m": m, "dtype": str(dtype), "index": bad, "block": bad // m,
                                 "expected": want[bad].item(), "got": got[bad].item()})
                break
        everyone: list[Any] = [None] * n
        dist.all_gather_object(everyone, problems)
    for rank, probs in enumerate(everyone):
        if probs:
            p = probs[0]
            if "error" in p:
                return {"passed": False, "message": f"rank {rank} (M={p['m']}, {p['dtype']}): {p['error']}",
                        "hint": "only send/recv/isend/irecv/batch_isend_irecv are allowed; "
                                "post a send and a receive per step"}
            return {"passed": False,
                    "message": f"rank {rank}, M={p['m']} {p['dtype']}: output[{p['index']}] (block {p['block']}) "
                               f"expected {p['expected']}, got {p['got']}",
                    "hint": "block j of output must be rank j's input; in step s forward the block you received in "
                            "step s-1", "details": {"rank": rank, **p}}
    return {"passed": True, "message": "ok"}


def check_ring_all_gather(fn: Callable[..., Any], world_sizes: tuple[int, ...] = (2, 3)) -> Verdict:
    """Check the learner's ``ring_all_gather(output, input, rank, world_size)`` and print the verdict."""
    return report(run_check(fn, "lslm.exercises.ring_all_gather:worker", world_sizes, timeout=180))
