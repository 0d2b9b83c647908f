"""``parallel_apply``: run every replica on its own input, one Python thread per replica.

This is how nn.DataParallel drives several GPUs from one process
(``torch/nn/parallel/parallel_apply.py``). Threads help only while a thread is
outside the Python interpreter: a CUDA kernel launch returns at once and BLAS
releases the GIL, but every line of Python in a forward (module calls, hooks,
shape logic, the dispatcher's Python side) runs one thread at a time under the
GIL. ``lslm.data_parallel.single_process.measure.gil_benchmark`` measures the difference.

Two details a thread must copy from its caller, because they are thread-local
in PyTorch: whether gradients are enabled, and the autocast state. On CUDA each
thread also selects its replica's device, so allocations and kernels land there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

__all__ = ["ReplicaError", "parallel_apply"]


class ReplicaError(RuntimeError):
    """A replica's forward raised; ``replica`` and ``device`` say which, ``__cause__`` holds the original."""

    def __init__(self, replica: int, device: torch.device, exc: BaseException) -> None:
        super().__init__(f"replica {replica} on device {device} raised {type(exc).__name__}: {exc}")
        self.replica, self.device = replica, device


def _run(fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device, grad_enabled: bool,
         autocast: tuple[bool, torch.dtype] | None) -> Any:
    with ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad_enabled))
        if autocast is not None:
            stack.enter_context(torch.autocast(device.type, enabled=autocast[0], dtype=autocast[1]))
        if device.type == "cuda":  # never touch torch.cuda on the CPU path
            stack.enter_context(torch.cuda.device(device))
        return fn(*args, **kwargs)


def parallel_apply(modules: Sequence[nn.Module | Callable[..., Any]], inputs: Sequence[tuple],
                   kwargs: Sequence[dict] | None = None, devices: Sequence[torch.device] | None = None, *,
                   threads: bool = True) -> list[Any]:
    """Call ``modules[i](*inputs[i], **kwargs[i])`` for every ``i`` and return the results in order.

    ``threads=True`` starts one thread per replica and joins them all (nn.DataParallel's
    way); ``threads=False`` calls them one after the other in the caller's thread
    (the serial baseline of the GIL measurement). A single replica runs in the
    caller's thread either way. If replica ``i`` raises, a :class:`ReplicaError`
    naming ``i`` and its device is raised here, chained to the original exception;
    with several failures the lowest replica index is reported.
    """
    n = len(modules)
    if n == 0:
        raise ValueError("parallel_apply: no modules given")
    if len(inputs) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(inputs)} inputs")
    kwargs = list(kwargs) if kwargs is not None else [{} for _ in range(n)]
    if len(kwargs) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(kwargs)} kwargs")
    devices = [torch.device(d) for d in devices] if devices is not None else [torch.device("cpu")] * n
    if len(devices) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(devices)} devices")
    grad_enabled = torch.is_grad_enabled()
    autocasts = [(torch.is_autocast_enabled(d.type), torch.get_autocast_dtype(d.type))
                 if torch.is_autocast_enabled(d.type) else None for d in devices]
    results: list[Any] = [None] * n
    errors: dict[int, BaseException] = {}

    def work(i: int) -> None:
        try:
            args = inputs[i] if isinstance(inputs[i], tuple) else (inputs[i],)
            results[i] = _run(modules[i], args, kwargs[i], devices[i], grad_enabled, autocasts[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller below
            errors[i] = exc

    if threads and n > 1:
        pool = [threading.Thread(target=work, args=(i,), name=f"lslm-replica-{i}") for i in range(n)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    else:
        for i in range(n):
            work(i)
    if errors:
        first = min(errors)
        raise ReplicaError(first, devices[first], errors[first]) from errors[first]
    return results
