"""Process-group start-up: read torchrun's environment, choose device and backend, seed.

``init_distributed()`` is the first line of every lslm worker. It returns a
:class:`~lslm.runtime.context.ParallelContext`; nothing is stored in module globals
beyond what ``torch.distributed`` itself keeps.

Where gloo and NCCL differ (and what lslm relies on)
-----------------------------------------------------
* **Devices.** gloo communicates CPU tensors (it can also take CUDA tensors by
  staging them through the host); NCCL only CUDA tensors, one GPU per rank. So every
  tensor lslm allocates for communication (agreement checks, barrier bytes, flags,
  receive buffers) is created on the data's device or on ``ctx.device``
  (``Comm.default_device``); ``tests/test_backend_static.py`` checks the source.
* **Point to point.** A send and a receive between the same two ranks must be
  posted together with ``batch_isend_irecv`` (one NCCL group) and every returned
  work waited on: NCCL runs separately posted p2p kernels of one pair of ranks in
  order on one stream, so two ranks that each post a receive before their send wait
  for each other forever once messages are too large for NCCL's eager buffers.
  gloo matches them in any order. ``lslm.collectives.p2p.exchange`` does this.
  NCCL also wants ``torch.cuda.set_device`` before the first p2p call and, for a
  group without an eagerly created communicator, all of its ranks in its first call;
  ``init_distributed`` sets the device and binds it (``device_id``) so NCCL creates
  communicators eagerly, and every lslm collective starts with an agreement check
  that all ranks of the group take part in.
* **Asynchrony.** gloo collectives complete on the host; a NCCL call returns once
  the kernel is queued on a CUDA stream. Host timers must synchronise
  (:func:`synchronize`) or use CUDA events (the ledger does, see
  :mod:`lslm.runtime.completion`).
* **Timeouts and failures.** On gloo a collective or p2p wait that exceeds the
  group's timeout *raises* a ``RuntimeError`` in the calling thread; lslm turns it
  into a ``CollectiveError`` naming the peer, and the tests rely on that. On NCCL
  the timeout is enforced by a watchdog thread: with the default
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` ("SkipCleanUp" in torch's ProcessGroupNCCL.hpp)
  it *tears the process down* without aborting the communicators first (1 aborts them
  and then tears down; no Python exception to catch either way;
  ``TORCH_NCCL_BLOCKING_WAIT=1`` would make
  ``wait()`` raise instead, at a cost). lslm relies on that process death there: the
  launcher sees a rank die and fails the whole job with a ``LaunchError``. So the
  "clear error" tests for timeouts and deadlocks run on gloo only.

Seeding: which random streams are identical where
--------------------------------------------------
:func:`seed_everything` seeds Python's ``random``, NumPy and torch (CPU and every
CUDA device) with the *same* seed on every rank. So after ``init_distributed`` every
random stream is identical on all ranks: models built from it have identical
weights everywhere (what data parallelism needs, and what lets a parallel run start
from exactly the serial run's weights), and dropout draws the same masks everywhere.
What must differ across ranks is derived explicitly: the per-rank samplers
(``lslm.data.sampler``) share one epoch permutation (same seed everywhere) and give
each data-parallel rank its own positions of it. Tensor-parallel chapters must additionally give each tp rank its own
stream for dropout inside sharded regions while keeping the stream shared for
replicated regions (the "RNG tracker" of Megatron-LM, which comes with tensor
parallelism); pipeline stages build only their own layers, so they must build
full weights from the one seed and slice, not re-seed per stage.
"""

from __future__ import annotations

import atexit
import os
import random
import socket
import sys
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid

DEFAULT_TIMEOUT_S = 300.0
#: Set once this process has started a gloo process group: its threads outlive destroy_process_group (exit_process).
_gloo_started = False
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
                              device: str | torch.device | None = None, *,
                              environ: Mapping[str, str] | None = None) -> tuple[torch.device, str]:
    """Pick ``(device, backend)`` for this rank.

    Explicit arguments win, then ``LSLM_DEVICE``/``LSLM_BACKEND`` (from ``environ``, default
    ``os.environ``; the launcher passes the workers' environment). Otherwise CUDA + NCCL
    when there is one GPU per local rank, else CPU + gloo. NCCL cannot put two ranks
    on one GPU, so a node with fewer GPUs than local ranks falls back to CPU + gloo
    with a warning instead of failing: every notebook runs on every machine.

    An explicit request this machine cannot honour (a CUDA device or NCCL without
    CUDA, a GPU index past the last GPU, NCCL on CPU tensors, NCCL with fewer GPUs
    than local ranks) is a ``ValueError`` saying so, raised before any CUDA call.
    """
    source_b = "backend argument" if backend else "LSLM_BACKEND"
    source_d = "device argument" if device else "LSLM_DEVICE"
    env = os.environ if environ is None else environ
    backend = backend or env.get("LSLM_BACKEND") or None
    device = device or env.get("LSLM_DEVICE") or None
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r} ({source_b})")
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r} ({source_d})") from exc
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={str(device)!r} ({source_d}) but no CUDA device is available; "
                                 "use device='cpu' (with gloo), or unset LSLM_DEVICE to choose automatically")
            if dev.index is None:
                dev = torch.device("cuda", local_rank)
            if dev.index >= torch.cuda.device_count():
                raise ValueError(f"device {dev} ({source_d}) does not exist: this machine has "
                                 f"{torch.cuda.device_count()} GPU(s), numbered from 0")
        elif backend == "nccl":
            raise ValueError(f"backend='nccl' ({source_b}) communicates CUDA tensors only, but device={str(device)!r} "
                             f"({source_d}); use backend='gloo' on CPU")
        return dev, backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(f"backend='nccl' ({source_b}) needs CUDA GPUs, but no CUDA device is available; "
                         "use backend='gloo'")
    if backend in (None, "nccl") and torch.cuda.is_available():
        n_gpus = torch.cuda.device_count()
        if n_gpus >= local_world_size:
            return torch.device("cuda", local_rank), backend or "nccl"
        if backend == "nccl":
            raise ValueError(f"backend='nccl' ({source_b}) needs one GPU per local rank: {local_world_size} local "
                             f"ranks but {n_gpus} GPU(s); start fewer processes per node, or use backend='gloo'")
        if local_rank == 0:
            warnings.warn(
                f"{local_world_size} local ranks but only {n_gpus} GPU(s): NCCL needs one GPU per rank, "
                f"so this run uses CPU + gloo", stacklevel=2)
        return torch.device("cpu"), "gloo"
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
    """Seed Python, NumPy (if present) and torch (all devices) with ``seed``.

    Called with the same seed on every rank, it makes every random stream identical
    across ranks (see the module doc for what parallel chapters must add).
    """
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device, without touching CUDA when absent
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass


def init_distributed(tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1, *, dp_shard: int | None = None,
                     backend: str | None = None,
                     device: str | torch.device | None = None, timeout_s: float | None = None,
                     seed: int = 0) -> ParallelContext:
    """Join the process group torchrun set up and return this rank's :class:`ParallelContext`.

    * Reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT. Outside
      torchrun it starts a one-process world, so the same code runs in a notebook.
    * Validates ``pp x dp x cp x tp == WORLD_SIZE`` before touching the network
      (``dp=None``: whatever is left).
    * Chooses device and backend (:func:`choose_device_and_backend`).
    * Sets a finite collective timeout (``timeout_s``, else ``LSLM_TIMEOUT_S``, else
      300 s), so a mismatched collective ends with an error instead of hanging.
    * Seeds every rank with ``seed`` (identical random streams everywhere: see the
      module doc).
    * Creates every process group of every axis combination (:class:`ParallelContext`).
    """
    env = RankEnv.from_environ()
    if env is None:
        port = free_port()
        env = RankEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1",
                      master_port=port, node_rank=0)
        init_method = f"tcp://127.0.0.1:{port}"
    else:
        init_method = "env://"
    grid = RankGrid.build(env.world_size, tp=tp, pp=pp, dp=dp, cp=cp, dp_shard=dp_shard)
    dev, be = choose_device_and_backend(env.local_rank, env.local_world_size, backend, device)
    timeout = float(timeout_s if timeout_s is not None else os.environ.get("LSLM_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call ctx.destroy() first")
    extra = {}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if be == "nccl":
        # Binding the device makes NCCL create communicators eagerly (subgroups too), so
        # a group's first p2p call need not involve all its ranks, and barriers know their GPU.
        extra["device_id"] = dev
    dist.init_process_group(backend=be, init_method=init_method, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout), **extra)
    if "gloo" in str(be):
        global _gloo_started
        _gloo_started = True
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


def _gloo_in_use() -> bool:
    """True if this process has run gloo: started by :func:`init_distributed`, or a live gloo group now."""
    if _gloo_started:
        return True
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:  # a gloo group inside another backend's job (the exercises' checker groups): torch's group registry
        registered = [str(backend) for backend, _store in dist.distributed_c10d._world.pg_map.values()]
    except (AttributeError, TypeError, ValueError):
        return True  # torch moved its registry: keep the exit that is safe with gloo
    return any("gloo" in b for b in registered)


def exit_process(code: int) -> NoReturn:
    """End this process now with ``code``: tear the process group down, flush, and exit.

    Where gloo ran in this process, the interpreter's finalization is skipped (``os._exit``):
    gloo's threads can still hold Python objects when the interpreter finalizes (the
    callbacks of completed works' futures, tensors), and touching them then aborts the
    process ("terminate called without an active exception", SIGABRT) in a small fraction
    of runs, after every result was written (pytorch PR 179291 describes the mechanism;
    here about 1 run in 15, commit bb1b4c8). Elsewhere (NCCL, or no process group) the
    process exits normally (``sys.exit``), so ``atexit`` handlers, loggers and profilers
    still flush: that abort is gloo's, and skipping finalization there would cost them
    for nothing. Launched workers and recipes started by torchrun end here once their
    results are safe.
    """
    gloo = _gloo_in_use()  # asked before the teardown: after it no group is registered
    try:
        _destroy_quietly()
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stream: nothing more can be said on it
        if gloo:
            os._exit(code)
    sys.exit(code)


def run_then_exit(main: Callable[[], Any]) -> NoReturn:
    """``main()``, then :func:`exit_process`: 0, a ``SystemExit``'s code, or 1 after printing an error's traceback."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported, then the process ends like any failed program
        traceback.print_exc()
        code = 1
    exit_process(code)
