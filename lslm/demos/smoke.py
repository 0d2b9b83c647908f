"""A tiny distributed job that proves the set-up works: every rank joins, all-reduces, reports.

Used by ``lslm doctor`` and by the tests of ``lslm.launch``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from lslm.runtime import init_distributed, rank_print


def worker(numel: int = 1024, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """Join the group, all-reduce ``ones(numel)`` and check every element equals the world size.

    Returns this rank's place in the grid, what torchrun told it, and its comm ledger.
    """
    t0 = time.perf_counter()
    with init_distributed(tp=tp, pp=pp) as ctx:
        init_s = time.perf_counter() - t0
        x = torch.ones(numel, device=ctx.device)
        ctx.comm.all_reduce(x)
        ok = bool(torch.all(x == ctx.world_size))
        verdict = "ok" if ok else "WRONG"
        rank_print(f"all_reduce of {numel} ones over {ctx.world_size} ranks -> {x[0].item():g} ({verdict})")
        return {
            **ctx.describe(),
            "ok": ok,
            "init_s": init_s,
            "pid": os.getpid(),
            "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                   "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")},
            "ledger": ctx.comm.ledger.summary(),
        }


def fail_on_rank(rank: int = 1, message: str = "deliberate failure") -> None:
    """Raise ``RuntimeError(message)`` on global rank ``rank`` while the others wait in a barrier.

    Shows (and tests) that one failing rank brings the whole job down quickly.
    """
    with init_distributed() as ctx:
        if ctx.rank == rank:
            raise RuntimeError(f"{message} on rank {rank}")
        ctx.barrier()  # the healthy ranks block here until the launcher kills them


def sleep_forever(seconds: float = 3600.0) -> None:
    """Sleep (used to test launch timeouts and that no process survives them)."""
    rank_print(f"sleeping {seconds} s", ranks=None)
    time.sleep(seconds)


def echo(**kwargs: Any) -> dict[str, Any]:
    """Return the arguments and the torchrun environment, without joining a process group."""
    return {"args": kwargs, "rank": int(os.environ["RANK"]), "pid": os.getpid()}
