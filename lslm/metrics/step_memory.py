"""One training step measured by the allocator itself: live bytes before it, the peak during it, after it.

:func:`measure_step_memory` reads the memory the step's tensors really take, from the allocator that
hands it out, and needs nothing registered. Which source measures what, and what it costs:

* **CUDA** (``device.type == "cuda"``): PyTorch's caching allocator. ``before``/``after`` are
  ``torch.cuda.memory_allocated``; ``peak`` is ``max_memory_allocated`` after
  ``reset_peak_memory_stats``: the exact peak of live tensor bytes (block-rounded to 512 B), at no
  cost beyond a synchronize at each end. It resets the device's peak counter.
* **CPU, glibc** (:mod:`lslm.metrics.malloc`): ``before``/``after`` are ``mallinfo2``'s in-use bytes
  after ``gc.collect()``; ``peak`` is their maximum sampled after every aten op the step runs (a
  ``TorchDispatchMode``: autograd's backward ops and the collectives included), so it can miss only a
  peak inside one op (a kernel's own scratch). The reading counts everything the process mallocs
  (Python objects, gloo's threads) and chunk headers: read it around code whose tensors dominate.
  Overhead: one ``mallinfo2`` per op, microseconds each (it walks the free lists of every arena).
* **The profiler** (``categories=True``, any device): ``torch.profiler.profile(profile_memory=True,
  record_shapes=True, with_stack=True)`` records every allocation and free of PyTorch's allocator
  and its memory profiler (``torch/profiler/_memory_profiler.py``: ``MemoryProfile``,
  ``MemoryProfileTimeline``) sorts each tensor into a ``Category`` (parameter, optimizer state,
  input, temporary, activation, gradient, autograd detail; ``unknown`` for bytes it cannot place,
  e.g. a storage resized in place). :attr:`StepMemory.categories` are those bytes at the moment
  their total peaks. ``peak`` stays the allocator's (glibc sampled per op, or CUDA's): on CPU the
  profiler misses the free of a block allocated before any profiling began (it warns so), which
  would inflate a peak taken from its events; glibc's then also counts the profiler's own records
  (hundreds of kB for a small step). Overhead: the profiler traces every op and Python call,
  seconds for a small step, and builds its data-flow graph afterwards; measure one step with it,
  not a training run. The
  timeline's API is private to PyTorch (``Profile._memory_profile``, ``_coalesce_timeline``): this
  module is lslm's one reader of it.

No second model of the allocator is written here: :func:`lslm.metrics.allocations.track_live_bytes`
is lslm's count of the storages it sees; this module is what the allocator says.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lslm.metrics.malloc import malloc_in_use_bytes

__all__ = ["PROFILER_CATEGORIES", "MallocPeak", "StepMemory", "malloc_peak", "measure_step_memory"]

#: The memory profiler's categories, lower-cased, in its order; ``unknown`` holds what it could not place.
PROFILER_CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
                       "autograd_detail", "unknown")


@dataclass
class StepMemory:
    """What :func:`measure_step_memory` read, in bytes; ``source`` says where from (``"cuda"`` or ``"malloc"``,
    ``"+profiler"`` with categories; see the module doc).

    ``before``/``peak``/``after``: the allocator's live bytes (``None`` on a CPU without glibc and without the
    profiler). ``categories``: bytes by :data:`PROFILER_CATEGORIES` when their total peaked (profiler only),
    ``profiled_peak`` that total: the tensors the profiler saw, those that existed before the step and were
    touched by it included. ``categories_error``: why there are none although asked for (the profiler's own
    consistency check failed on its trace, which happens now and then with gloo's threads: measure another step).
    ``result``: what ``step`` returned.
    """

    source: str
    before: int | None
    peak: int | None
    after: int | None
    categories: dict[str, int] | None = None
    profiled_peak: int | None = None
    categories_error: str | None = None
    result: Any = field(default=None, repr=False)

    @property
    def step_peak(self) -> int | None:
        """The most the step held on top of what it found (``peak - before``)."""
        return None if self.peak is None or self.before is None else self.peak - self.before


class MallocPeak(TorchDispatchMode):
    """The most bytes glibc had handed out, sampled after every aten op run under it (``peak``, running)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = malloc_in_use_bytes() or 0

    def sample(self) -> int:
        """Read the allocator now (also from a hook), raising the running peak; 0 without glibc."""
        now = malloc_in_use_bytes() or 0
        self.peak = max(self.peak, now)
        return now

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


@contextmanager
def malloc_peak() -> Iterator[MallocPeak]:
    """``with malloc_peak() as p: ...``: ``p.peak`` is the most glibc held at any op's end inside the block."""
    with MallocPeak() as mode:
        yield mode


def _profiler_categories(prof: Any, device: torch.device) -> tuple[dict[str, int], int]:
    """Bytes by category when their total peaked, and that total."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    _times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(str(device))
    if not sizes:
        return dict.fromkeys(PROFILER_CATEGORIES, 0), 0
    # Column 0 is unused; the rest follow the profiler's category order, ``None`` (unknown) last.
    totals = [sum(row[1:]) for row in sizes]
    at = max(range(len(totals)), key=totals.__getitem__)
    row = sizes[at][1:]
    assert len(row) == len(PROFILER_CATEGORIES), f"the profiler's categories changed: {len(row)} columns"
    return dict(zip(PROFILER_CATEGORIES, row, strict=True)), totals[at]


def measure_step_memory(step: Callable[[], Any], device: torch.device | str, *,
                        categories: bool = False) -> StepMemory:
    """Run ``step()`` once and read the allocator of ``device`` before, during and after it.

    CUDA: ``torch.cuda``'s allocated bytes and their reset peak. CPU: glibc's in-use bytes, the peak
    sampled after every op (:class:`MallocPeak`). ``categories=True`` also runs the step under PyTorch's
    memory profiler and returns its bytes by category when the profiled tensors peaked (the peak stays
    the allocator's; see the module doc for what each source measures and costs). Garbage is collected
    before each reading, so ``before`` and ``after`` are what is really held; what ``step`` returns is
    kept (in :attr:`StepMemory.result`) and so counts in ``after``.
    """
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"measure_step_memory reads the CPU's or CUDA's allocator, not {device.type!r}")
    cuda = device.type == "cuda"
    gc.collect()

    def read() -> int | None:
        if cuda:
            torch.cuda.synchronize(device)
            return int(torch.cuda.memory_allocated(device))
        return malloc_in_use_bytes()

    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = read()
    cats = profiled = None
    sampler: MallocPeak | None = None
    with contextlib.ExitStack() as stack:
        if categories:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            prof = stack.enter_context(profile(activities=activities, profile_memory=True, record_shapes=True,
                                               with_stack=True))
        if not cuda:
            sampler = stack.enter_context(malloc_peak())
        result = step()
        if cuda:
            torch.cuda.synchronize(device)
    error = None
    if categories:
        try:
            cats, profiled = _profiler_categories(prof, device)
        except AssertionError as exc:  # the profiler's own data-flow check (seen with gloo's threads): no categories
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
        del prof  # its records are malloc'ed too: gone before ``after`` is read
    gc.collect()
    after = read()
    if cuda:
        peak: int | None = int(torch.cuda.max_memory_allocated(device))
    elif before is None or after is None or sampler is None:
        peak = None
    else:
        peak = max(sampler.peak, before, after)
    source = ("cuda" if cuda else "malloc") + ("+profiler" if categories else "")
    return StepMemory(source, before, peak, after, cats, profiled, error, result)
