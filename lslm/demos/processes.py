"""Workers for notebook 01 (multiprocessing): the GIL, start methods, mp.spawn, init methods.

Nothing heavy is imported at module level: the process-pool measurements start
fresh interpreters that import this module, and we want to time Python, not
``import torch``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any


def busy_sum(n: int) -> int:
    """Pure-Python CPU work: holds the GIL for the whole loop."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def _noop() -> None:
    return None


def measure_gil(n: int = 3_000_000, workers: int = 2, repeats: int = 3) -> dict[str, Any]:
    """Time ``workers`` copies of :func:`busy_sum` run serially, on threads, and on processes.

    Pools are started (and warmed up) before timing, so the numbers compare
    execution only; process start-up is reported separately. Medians of ``repeats``.
    """
    jobs = [n] * workers
    serial, threads, procs = [], [], []
    spawn = mp.get_context("spawn")
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as ppool, \
            ThreadPoolExecutor(max_workers=workers) as tpool:
        list(ppool.map(_noop_arg, range(workers)))  # start and warm every process
        pool_start_s = time.perf_counter() - t0
        for _ in range(repeats):
            t = time.perf_counter()
            [busy_sum(j) for j in jobs]
            serial.append(time.perf_counter() - t)
            t = time.perf_counter()
            list(tpool.map(busy_sum, jobs))
            threads.append(time.perf_counter() - t)
            t = time.perf_counter()
            list(ppool.map(busy_sum, jobs))
            procs.append(time.perf_counter() - t)
    med = statistics.median
    return {"n": n, "workers": workers, "repeats": repeats, "serial_s": med(serial), "threads_s": med(threads),
            "processes_s": med(procs), "process_pool_start_s": pool_start_s, "cpu_count": os.cpu_count()}


def _noop_arg(_: int) -> None:
    return None


def measure_start_methods(repeats: int = 5) -> dict[str, float]:
    """Median seconds to start and join one process that does nothing, per start method available here."""
    out = {}
    for method in mp.get_all_start_methods():
        starter = mp.get_context(method)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            p = starter.Process(target=_noop)
            p.start()
            p.join()
            times.append(time.perf_counter() - t)
        out[method] = statistics.median(times)
    return out


def spawn_worker(rank: int, world_size: int, port: int, result_dir: str) -> None:
    """Body of a ``torch.multiprocessing.spawn`` job: mp.spawn passes the index as ``rank``.

    No torchrun here, so the worker sets up the rendezvous itself (tcp:// on ``port``),
    all-reduces its rank, and writes what it saw to ``result_dir/rank<r>.json``.
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    x = torch.tensor([float(rank)])  # lslm: cpu-ok (this demo always uses gloo)
    dist.all_reduce(x)
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "pid": os.getpid(), "sum_of_ranks": x.item(), "RANK_env": os.environ.get("RANK")}))
    dist.barrier()
    dist.destroy_process_group()


def init_method_demo(method: str, file_path: str | None = None) -> dict[str, Any]:
    """Join the group torchrun prepared using one of three init methods, then all-reduce.

    * ``env``  - read MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE from the environment;
    * ``tcp``  - the same rendezvous spelled as a URL ``tcp://addr:port`` plus explicit rank/size;
    * ``file`` - a file on a filesystem every rank can see (``file_path``); no network for the
      rendezvous itself.
    """
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if method == "env":
        init_method = "env://"
    elif method == "tcp":
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    elif method == "file":
        if not file_path:
            raise ValueError("method='file' needs file_path, a path every rank can see")
        init_method = f"file://{file_path}"
    else:
        raise ValueError(f"method must be 'env', 'tcp' or 'file', got {method!r}")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    x = torch.tensor([rank + 1.0])  # lslm: cpu-ok (this demo always uses gloo)
    dist.all_reduce(x)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "init_method": init_method, "sum": x.item()}


def rank_environment() -> dict[str, Any]:
    """What torchrun tells one worker: the variables every distributed program reads."""
    keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID")
    return {"pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}
