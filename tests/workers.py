"""Worker functions used only by the tests (launched through tests.helpers.run_workers)."""

from __future__ import annotations

import os
import signal
import time

from lslm.runtime import init_distributed


def kill_rank(rank: int = 1, sig: int = int(signal.SIGKILL)) -> None:
    """Rank ``rank`` sends itself ``sig`` (as the out-of-memory killer would) while its peers wait in a
    barrier; the peers then fail with "connection closed by peer", a consequence, not the cause."""
    with init_distributed() as ctx:
        if ctx.rank == rank:
            print("about to die", flush=True)
            time.sleep(0.2)  # let the peers reach the barrier
            os.kill(os.getpid(), sig)
            time.sleep(60)  # a signal that does not kill: the launcher's timeout ends it
        ctx.barrier()


def needs_steps(steps: int, lr: float = 0.1) -> int:
    """A worker with a required argument (only its signature matters: the launch is refused before starting)."""
    return steps


def gather_objects() -> dict:
    """``ctx.comm.all_gather_object`` of objects of different sizes: what came back, and what the ledger saw."""
    import pickle

    ctx = init_distributed()
    mine = {"rank": ctx.rank, "payload": "x" * (10 * ctx.rank)}
    got = ctx.comm.all_gather_object(mine, label="objects")
    recs = ctx.comm.ledger.select(label="objects")
    return {"got": got, "ops": [r.op for r in recs], "nbytes": [r.nbytes for r in recs],
            "pickled": [len(pickle.dumps(o)) for o in got]}


#: What a launched rank is told by its launcher: torchrun's variables, compared between the two launchers.
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
              "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
              "LSLM_BACKEND", "LSLM_DEVICE", "LSLM_TEST_MARK")


def describe_rank() -> dict:
    """This rank's launch environment, directory, threads and import path, after an all-reduce of its rank."""
    import sys

    import torch

    with init_distributed() as ctx:
        x = torch.tensor([float(ctx.rank)])
        ctx.comm.all_reduce(x)
        return {"env": {k: os.environ.get(k) for k in LAUNCH_ENV}, "cwd": os.getcwd(), "sum": x.item(),
                "threads": torch.get_num_threads(), "path": sys.path[:4], "pid": os.getpid(), "ppid": os.getppid()}
