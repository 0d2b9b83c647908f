"""Process-group start-up: read torchrun's environment, choose device and backend, seed.

``init_distributed()`` is the first line of every lslm worker. It returns a
:class:`~lslm.runtime.context.ParallelContext`; nothing is stored in module globals
beyond what ``torch.distributed`` itself keeps.
"""

from __future__ import annotations

import atexit
import os
import random
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid

DEFAULT_TIMEOUT_S = 300.0
_BACKENDS = ("gloo", "nccl", "mpi")


@dataclass(frozen=True)
class RankEnv:
    """What torchrun tells a worker through its environment."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    node_rank: int  # GROUP_RANK: which node (agent) this worker belongs to

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> RankEnv | None:
        """Parse torchrun's variables; ``None`` when they are absent (a plain ``python`` process)."""
        env = os.environ if environ is None else environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        world = int(env["WORLD_SIZE"])
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            world_size=world,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            node_rank=int(env.get("GROUP_RANK", "0")),
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def choose_device_and_backend(local_rank: int, local_world_size: int, backend: str | None = None,
                              device: str | torch.device | None = None) -> tuple[torch.device, str]:
    """Pick ``(device, backend)`` for this rank.

    Explicit arguments win, then ``LSLM_DEVICE``/``LSLM_BACKEND``. Otherwise CUDA + NCCL
    when there is one GPU per local rank, else CPU + gloo. NCCL cannot put two ranks
    on one GPU, so a node with fewer GPUs than local ranks falls back to CPU + gloo
    with a warning instead of failing: every notebook runs on every machine.
    """
    backend = backend or os.environ.get("LSLM_BACKEND") or None
    device = device or os.environ.get("LSLM_DEVICE") or None
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
        return dev, backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend in (None, "nccl") and torch.cuda.is_available():
        n_gpus = torch.cuda.device_count()
        if n_gpus >= local_world_size:
            return torch.device("cuda", local_rank), backend or "nccl"
        if local_rank == 0:
            warnings.warn(
                f"{local_world_size} local ranks but only {n_gpus} GPU(s): NCCL needs one GPU per rank, "
                f"so this run uses CPU + gloo", stacklevel=2)
        return torch.device("cpu"), "gloo"
    if backend == "nccl":
        raise ValueError("backend='nccl' needs CUDA GPUs, and none is available; use backend='gloo'")
    return torch.device("cpu"), backend or "gloo"


def synchronize(*devices: torch.device) -> None:
    """Wait until the queued work of every CUDA device among ``devices`` is done (no-op on CPU).

    Host timers around asynchronous CUDA kernels need it; CPU ops are synchronous, so
    the CPU path never touches ``torch.cuda``.
    """
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (if present) and torch (all devices) with ``seed``."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device, without touching CUDA when absent
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass


def init_distributed(tp: int = 1, pp: int = 1, dp: int | None = None, *, backend: str | None = None,
                     device: str | torch.device | None = None, timeout_s: float | None = None,
                     seed: int = 0) -> ParallelContext:
    """Join the process group torchrun set up and return this rank's :class:`ParallelContext`.

    * Reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT. Outside
      torchrun it starts a one-process world, so the same code runs in a notebook.
    * Validates ``tp x pp x dp == WORLD_SIZE`` before touching the network.
    * Chooses device and backend (:func:`choose_device_and_backend`).
    * Sets a finite collective timeout (``timeout_s``, else ``LSLM_TIMEOUT_S``, else
      300 s), so a mismatched collective ends with an error instead of hanging.
    * Seeds every rank with ``seed`` (identical weights everywhere unless a caller
      offsets it on purpose).
    """
    env = RankEnv.from_environ()
    if env is None:
        port = free_port()
        env = RankEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1",
                      master_port=port, node_rank=0)
        init_method = f"tcp://127.0.0.1:{port}"
    else:
        init_method = "env://"
    grid = RankGrid.build(env.world_size, tp=tp, pp=pp, dp=dp)
    dev, be = choose_device_and_backend(env.local_rank, env.local_world_size, backend, device)
    timeout = float(timeout_s if timeout_s is not None else os.environ.get("LSLM_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call ctx.destroy() first")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend=be, init_method=init_method, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout))
    seed_everything(seed)
    ctx = ParallelContext.create(grid, rank=env.rank, local_rank=env.local_rank, node_rank=env.node_rank,
                                 device=dev, backend=be, timeout_s=timeout)
    atexit.register(_destroy_quietly)
    return ctx


def _destroy_quietly() -> None:
    # At interpreter exit, after an uncaught error or a forgotten ctx.destroy(): no
    # barrier here (a crashed peer would make it wait for the full timeout).
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
