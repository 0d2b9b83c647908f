"""What glibc's allocator says a block of code left behind, and what a graph keeps for backward.

:func:`~lslm.metrics.malloc.malloc_in_use_bytes` read around a block of code, after ``gc.collect()`` at both ends
(:class:`MallocDelta`), is the allocator's figure for whatever the block still holds at its end: model states it
built, activations autograd saved, buffers nobody registered. :func:`saved_by_allocator` applies it to one forward:
it keeps only the outputs' ``grad_fn`` alive, so the bytes left are those the graph holds for backward (its saved
tensors, whole storages, plus the graph's own nodes and the allocator's chunk headers), with the outputs themselves
freed unless a node saved them. These are the figures the notebooks print beside their counted and formula ones.

Off glibc (macOS, musl) every figure is ``None`` and callers skip the comparison.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from lslm.metrics.malloc import malloc_in_use_bytes

__all__ = ["MallocDelta", "saved_by_allocator"]


class MallocDelta:
    """Context manager: ``bytes`` is what glibc's allocator had handed out more at exit than at entry.

    Both readings follow a ``gc.collect()``, so Python garbage does not count; anything else the process
    allocates meanwhile (another thread) does, which is why the block should be one whose tensors dominate.
    ``bytes`` is ``None`` off glibc.
    """

    def __init__(self) -> None:
        """Prepare a reading; nothing is read until ``with``."""
        self.before: int | None = None
        self.bytes: int | None = None

    def __enter__(self) -> MallocDelta:
        gc.collect()
        self.before = malloc_in_use_bytes()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        gc.collect()
        after = malloc_in_use_bytes()
        self.bytes = None if after is None or self.before is None else after - self.before


def saved_by_allocator(forward: Callable[[], Any], repeats: int = 1) -> tuple[int | None, list[Any]]:
    """The allocator's bytes for what ``forward()``'s graph keeps for backward, and the kept ``grad_fn`` nodes.

    ``forward`` returns a tensor or a tuple of tensors (``None`` entries allowed). Its outputs are dropped and
    only their ``grad_fn`` kept, so the figure is the saved tensors (each storage whole, an input included when
    ``forward`` made that input itself, e.g. by a clone) plus the graph's nodes and the chunk headers of each
    allocation. With ``repeats > 1`` the forward runs that many times, each graph freed before the next, and
    the median reading counts: another thread (a notebook kernel's, gloo's) may allocate or free during one
    reading, rarely during most of them.
    Hold the returned nodes (the last run's) as long as the graph must live; ``None`` bytes off glibc.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    readings: list[int] = []
    nodes: list[Any] = []
    for _ in range(repeats):
        nodes = []  # the previous graph goes before the next reading starts
        with MallocDelta() as delta:
            out = forward()
            outs = out if isinstance(out, tuple) else (out,)
            nodes = [t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            del out, outs
        if delta.bytes is None:
            return None, nodes
        readings.append(delta.bytes)
    return sorted(readings)[len(readings) // 2], nodes
