"""Helpers every multi-process test uses: run workers on a backend, and a fake one-process world.

:func:`run_workers` is ``lslm.launch`` itself (free port, timeout, the failing rank's
traceback in the raised error), with quiet output and the repository root importable
so that test-only workers in ``tests/*_workers.py`` can be targets.

Backends: every multi-process test that exercises communication takes a ``backend``
parameter from :func:`backends`: gloo always, NCCL where at least ``nproc`` GPUs are
visible (skipped otherwise, with the reason). On a CPU machine the gloo case runs
exactly what ran before, so the suite's time does not grow.

:func:`fake_world` joins torch's "fake" process group (every collective returns at
once, nothing moves): enough to build a ParallelContext, its groups and its
DeviceMesh for any rank of any world size in one process, in milliseconds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lslm.launcher.launch import LaunchResults, launch
from lslm.runtime.fake_world import fake_world  # noqa: F401 (re-exported: the tests import it from here)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEVICE_OF = {"gloo": "cpu", "nccl": "cuda"}
#: the torch.cuda functions :func:`forbid_cuda_from_lslm` guards by default
GUARDED_CUDA = ("memory_allocated", "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats",
                "is_available", "device_count", "current_device", "synchronize", "get_device_name", "Event")


def forbid_cuda_from_lslm(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...] = GUARDED_CUDA) -> None:
    """Make each ``torch.cuda.<name>`` raise when lslm calls it; torch's own calls (and the tests') go through.

    torch probes CUDA itself on a machine with a GPU (``Adam.step`` calls ``torch.cuda.is_available()``
    to choose its kernels), which says nothing about lslm's CPU path: so the caller's module decides.
    A call from a module of the ``lslm`` package raises AssertionError; any other caller gets the real function.
    """

    def guard(name: str, real: Any) -> Any:
        def checked(*args: object, **kwargs: object) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == "lslm" or caller.startswith("lslm."):
                raise AssertionError(f"torch.cuda.{name} called from {caller} on the CPU path")
            return real(*args, **kwargs)

        return checked

    for name in names:
        monkeypatch.setattr(torch.cuda, name, guard(name, getattr(torch.cuda, name)))


def visible_gpus() -> int:
    """Number of CUDA devices this process sees (0 on a CPU build; does not initialise CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs_gpus(nproc: int) -> pytest.MarkDecorator:
    gpus = visible_gpus()
    return pytest.mark.skipif(gpus < nproc, reason=f"NCCL needs {nproc} GPUs (one per rank); {gpus} visible")


def backends(nproc: int) -> list[Any]:
    """``backend`` parameters for a test on ``nproc`` processes: gloo, and NCCL when ``nproc`` GPUs are visible."""
    return ["gloo", pytest.param("nccl", marks=_needs_gpus(nproc))]


def nproc_backends(*nprocs: int) -> list[Any]:
    """``(nproc, backend)`` parameters: every ``nproc`` on gloo, and on NCCL where ``nproc`` GPUs are visible."""
    return [param for n in nprocs for param in (pytest.param(n, "gloo", id=f"{n}-gloo"),
                                                  pytest.param(n, "nccl", marks=_needs_gpus(n), id=f"{n}-nccl"))]


def run_workers(target: str, nproc: int, *, backend: str = "gloo", timeout: float = 120.0, nnodes: int = 1,
                **kwargs: Any) -> LaunchResults:
    """Run ``target`` on ``nproc`` processes of ``backend`` (gloo on CPU, NCCL on one GPU per rank).

    Returns each rank's result; raises LaunchError on failure. The backend reaches the
    workers through LSLM_BACKEND / LSLM_DEVICE, so ``init_distributed()`` picks it up.
    """
    if backend not in DEVICE_OF:
        raise ValueError(f"backend must be one of {sorted(DEVICE_OF)}, got {backend!r}")
    return launch(target, nproc=nproc, nnodes=nnodes, timeout=timeout, output="none",
                  env={"LSLM_BACKEND": backend, "LSLM_DEVICE": DEVICE_OF[backend]}, pythonpath=[str(REPO_ROOT)],
                  **kwargs)
