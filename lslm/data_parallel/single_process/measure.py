"""Measurements of single-process DataParallel: bytes per step, the GIL, the cost of replicating.

* :func:`theory_step_bytes` - the hand formulas for every copy of one training step,
  which the ledger must match exactly (tests check it).
* :func:`measure_step` - one forward + backward through :class:`DataParallel`, with the
  ledger's byte counts and, on CUDA, each device's peak allocated memory.
* :func:`gil_benchmark` - serial vs threaded ``parallel_apply`` on Python-heavy and
  BLAS-heavy forwards: medians of interleaved repeats, so the ratios are fair.
* :func:`replicate_cost` - bytes broadcast and time spent by ``replicate`` per step,
  next to the forward time.
* :func:`busiest_device_bytes` - DataParallel's traffic through device 0 versus a
  ring all-reduce's per device: why DDP replaces it.

Timings are wall-clock medians on whatever machine runs them; quote ratios, not
absolute numbers. Byte counts are exact and machine-independent.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lslm.data_parallel.single_process.apply import parallel_apply
from lslm.data_parallel.single_process.comm import chunk_sizes
from lslm.data_parallel.single_process.data_parallel import DataParallel, gpt_token_loss, to_devices
from lslm.data_parallel.single_process.ledger import TransferLedger
from lslm.data_parallel.single_process.replicate import replicate
from lslm.runtime.startup import synchronize

__all__ = ["BlasForward", "LaunchAndWaitForward", "PythonLoopForward", "TinyOpsForward", "busiest_device_bytes",
           "gil_benchmark", "measure_step", "replicate_cost", "theory_step_bytes"]


def theory_step_bytes(*, param_bytes: int, batch: int, n: int, input_row_bytes: int, output_row_bytes: int,
                      target_row_bytes: int = 0, parallel_loss: bool = False,
                      loss_bytes: int = 4) -> dict[tuple[str, str], int]:
    """Bytes of every copy in one DataParallel step, when batch and output device are replica 0.

    ``input_row_bytes``/``target_row_bytes``/``output_row_bytes``: bytes of one row (sample)
    of the inputs, the targets (scattered with the inputs under a parallel criterion) and
    the module's output. With chunks ``b_0, ..., b_{n-1}`` (the first ``batch % n`` one larger):

    * forward scatter: ``(batch - b_0) x (input + target row)`` - chunk 0 stays put;
    * forward broadcast and backward reduce: ``(n - 1) x param_bytes`` each;
    * forward gather: ``batch x output_row`` (all of it lands in a fresh buffer on the
      output device), or ``n x loss_bytes`` with the parallel criterion;
    * backward scatter (of the output gradient): the same minus replica 0's share.

    Keys are ``(label, op)`` as in :meth:`TransferLedger.by_op`.
    """
    b0 = chunk_sizes(batch, n)[0]
    out: dict[tuple[str, str], int] = {
        ("forward", "scatter"): (batch - b0) * (input_row_bytes + (target_row_bytes if parallel_loss else 0)),
        ("forward", "broadcast"): (n - 1) * param_bytes,
        ("forward", "gather"): n * loss_bytes if parallel_loss else batch * output_row_bytes,
        ("backward", "scatter"): (n - 1) * loss_bytes if parallel_loss else (batch - b0) * output_row_bytes,
        ("backward", "reduce"): (n - 1) * param_bytes,
    }
    return out


def measure_step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                 devices: Sequence[torch.device | str], *, parallel_loss: bool,
                 output_device: torch.device | str | None = None) -> dict[str, Any]:
    """One forward + backward of ``model`` (a GPT) through DataParallel; grads are zeroed first and kept.

    Returns ``loss``, ``bytes`` (``{(label, op): bytes}`` from the ledger), ``gathered_bytes``
    (what the output device received from the gather, its own chunk included), and
    ``peak_bytes`` (``{device: max_memory_allocated}`` for each CUDA device, measured from
    a reset just before the step; empty on CPU).
    """
    devs = to_devices(devices)
    dp = DataParallel(model, devs, output_device, parallel_criterion=gpt_token_loss if parallel_loss else None)
    model.zero_grad(set_to_none=True)
    cuda = sorted({d for d in devs + [dp.output_device] if d.type == "cuda"}, key=str)
    synchronize(*cuda)
    for d in cuda:
        torch.cuda.reset_peak_memory_stats(d)
    if parallel_loss:
        loss = dp(idx, target=targets)
    else:
        logits, _ = dp(idx)
        loss = gpt_token_loss(logits, targets.to(logits.device))
    loss.backward()
    synchronize(*cuda)
    out_place = next((i for i, d in enumerate(devs) if d == dp.output_device), "out")
    return {
        "loss": loss.item(),
        "bytes": dp.ledger.by_op(),
        "gathered_bytes": dp.ledger.total("gather", "forward", dst=out_place),
        "peak_bytes": {str(d): torch.cuda.max_memory_allocated(d) for d in cuda},
    }


# --- the GIL ---------------------------------------------------------------------------


class PythonLoopForward(nn.Module):
    """Pure-Python work (an integer loop) then an identity: holds the GIL the whole time."""

    def __init__(self, iters: int = 200_000) -> None:
        super().__init__()
        self.iters = iters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = 0
        for i in range(self.iters):
            acc += i * i % 7
        return x + (acc % 2)


class TinyOpsForward(nn.Module):
    """Many tiny tensor ops: the time goes to Python and dispatch overhead, as in a small model's forward."""

    def __init__(self, ops: int = 1500) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = x * 1.0001 + 0.0001
        return x


class BlasForward(nn.Module):
    """A few large matrix products: BLAS releases the GIL, so threads can run them at once."""

    def __init__(self, size: int = 384, reps: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size, size, generator=torch.Generator().manual_seed(0)) / size**0.5)
        self.reps = reps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.reps):
            x = x @ self.weight
        return x


class LaunchAndWaitForward(nn.Module):
    """A GPU step in miniature: a little Python (the kernel launches, GIL held), then a wait with the GIL released.

    ``time.sleep`` stands in for waiting on a device: the thread blocks without the GIL
    and without using a core, as in ``torch.cuda.synchronize``. Threads overlap the waits
    whatever the number of free cores; the Python part still runs one thread at a time.
    """

    def __init__(self, iters: int = 20_000, wait_s: float = 0.01) -> None:
        super().__init__()
        self.iters, self.wait_s = iters, wait_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = 0
        for i in range(self.iters):
            acc += i * i % 7
        time.sleep(self.wait_s)
        return x + (acc % 2)


def _default_workloads() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    return {
        "pure Python loop": (PythonLoopForward(), torch.ones(4)),
        "tiny tensor ops": (TinyOpsForward(), torch.ones(8)),
        "BLAS matmuls": (BlasForward(), torch.randn(384, 384, generator=torch.Generator().manual_seed(1))),
        "launch + wait": (LaunchAndWaitForward(), torch.ones(4)),
    }


def _pinned(module: nn.Module, intra_op_threads: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module`` called with PyTorch's intra-op thread count set on the *calling* thread.

    OpenMP keeps that count per thread: ``torch.set_num_threads(1)`` in the notebook's
    thread leaves a fresh replica thread at the default (all cores), and two replica
    threads would then run 2 x cores BLAS threads and slow each other down.
    """
    if intra_op_threads is None:
        return module

    def call(x: torch.Tensor) -> torch.Tensor:
        torch.set_num_threads(intra_op_threads)
        return module(x)

    return call


def gil_benchmark(workloads: dict[str, tuple[nn.Module, torch.Tensor]] | None = None,
                  replicas: Sequence[int] = (1, 2), repeats: int = 5,
                  intra_op_threads: int | None = 1) -> list[dict[str, Any]]:
    """Time ``parallel_apply`` over ``k`` copies of each workload, serial vs one thread per replica.

    Each replica does the same work on its own input, so ideal threading keeps the time
    of ``k`` replicas equal to that of one, and ``speedup = serial / threaded`` equals
    ``k``. Serial and threaded runs alternate inside every repeat (side by side, same
    machine load); the medians are reported. ``intra_op_threads=1`` pins PyTorch's own
    intra-op pool to one thread in every thread that runs a replica, so the replica
    threads are the only parallelism (otherwise one BLAS call already uses every core);
    ``None`` leaves it alone.

    Returns one dict per (workload, k): ``workload``, ``replicas``, ``serial_ms``,
    ``threaded_ms``, ``speedup``.
    """
    work = workloads if workloads is not None else _default_workloads()
    saved = torch.get_num_threads()
    if intra_op_threads is not None:
        torch.set_num_threads(intra_op_threads)
    rows = []
    try:
        with torch.no_grad():
            for name, (module, x) in work.items():
                for k in replicas:
                    mods, inputs = [_pinned(module, intra_op_threads)] * k, [(x.clone(),) for _ in range(k)]
                    parallel_apply(mods, inputs, threads=True)  # warm-up
                    times: dict[bool, list[float]] = {False: [], True: []}
                    for _ in range(repeats):
                        for threaded in (False, True):
                            t0 = time.perf_counter()
                            parallel_apply(mods, inputs, threads=threaded)
                            times[threaded].append(time.perf_counter() - t0)
                    serial, threaded_t = (statistics.median(times[b]) for b in (False, True))
                    rows.append({"workload": name, "replicas": k, "serial_ms": 1e3 * serial,
                                 "threaded_ms": 1e3 * threaded_t, "speedup": serial / threaded_t})
    finally:
        torch.set_num_threads(saved)
    return rows


# --- the cost of replicating every step ---------------------------------------------------


def _median_time(fn: Callable[[], Any], devices: Sequence[torch.device], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(*devices)
        t0 = time.perf_counter()
        fn()
        synchronize(*devices)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def replicate_cost(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                   devices: Sequence[torch.device | str], *, repeats: int = 5) -> dict[str, Any]:
    """What rebuilding the replicas costs each step, next to the rest of the step.

    Returns ``param_bytes``, ``broadcast_bytes`` (from the ledger of one ``replicate``; equals
    ``(n-1) x param_bytes``), and median seconds of ``replicate`` alone (``replicate_s``),
    of the plain model's forward + backward on the whole batch (``model_step_s``) and of a
    DataParallel forward + backward with the parallel loss (``dp_step_s``).
    """
    devs = to_devices(devices)
    ledger = TransferLedger()
    replicate(model, devs, ledger=ledger)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dp = DataParallel(model, devs, parallel_criterion=gpt_token_loss)

    def model_step() -> None:
        model.zero_grad(set_to_none=True)
        model(idx, targets)[1].backward()

    def dp_step() -> None:
        model.zero_grad(set_to_none=True)
        dp(idx, target=targets).backward()

    return {
        "param_bytes": param_bytes,
        "broadcast_bytes": ledger.total("broadcast", "forward"),
        "replicate_s": _median_time(lambda: replicate(model, devs), devs, repeats),
        "model_step_s": _median_time(model_step, devs, repeats),
        "dp_step_s": _median_time(dp_step, devs, repeats),
    }


def busiest_device_bytes(param_bytes: int, n: int) -> dict[str, float]:
    """Parameter/gradient bytes through the busiest device per step: DataParallel vs ring all-reduce.

    Counted as bytes sent + received. DataParallel: device 0 sends ``(n-1) P`` (broadcast)
    and receives ``(n-1) P`` (reduce), ``2(n-1) P`` in all, growing with ``n``. Ring
    all-reduce of the gradients (DDP): every device sends ``2(n-1)/n P`` and receives as
    much, ``4(n-1)/n P < 4P`` whatever ``n`` - and the parameters never move, because each
    process keeps its replica. The two are equal at ``n = 2``; beyond, DataParallel's
    busiest device carries ``n/2`` times more.
    """
    return {"data_parallel": 2.0 * (n - 1) * param_bytes, "ring_all_reduce": 4.0 * (n - 1) / n * param_bytes}
