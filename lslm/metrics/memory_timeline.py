"""The memory profiler's timeline: bytes by category over time, for one step (or a few) of any code.

PyTorch's memory profiler (``torch.profiler.profile(profile_memory=True, record_shapes=True,
with_stack=True)``; ``torch/profiler/_memory_profiler.py``) records every allocation and free of
PyTorch's allocator and sorts each tensor into a category by what it is used for: parameter,
optimizer state, input, temporary, activation, gradient, autograd detail, and ``unknown`` for
bytes it cannot place (a storage resized in place, a block it saw only being freed).
:func:`record_memory_timeline` runs a callable under it and returns a :class:`MemoryTimeline`:
the live bytes of each category after every allocation event, on the profiler's clock, plus the
``record_function`` ranges whose names start with the prefixes asked for (a schedule's actions,
a step's phases), so a figure can say what ran when. :func:`timeline_from_sizes` is the pure part
(the profiler's coalesced rows in, the dataclass out), tested on exact numbers.

Same reader as :mod:`lslm.metrics.step_memory` (which keeps only the peak): the timeline's API is
private to PyTorch (``Profile._memory_profile``, ``MemoryProfileTimeline._coalesce_timeline``).
Cost: the profiler records every op with its shapes and Python stack and builds a data-flow graph
afterwards, seconds for a small step: profile one step, not a run. On CPU the profiler misses the
free of a block allocated before it started (it warns): such bytes stay in the timeline until the
end, under the category of the tensor that held them.
:func:`lslm.plot.memory_timeline.plot_memory_timeline` draws the result as a stacked area.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lslm.metrics.step_memory import PROFILER_CATEGORIES

__all__ = ["MemoryTimeline", "record_memory_timeline", "timeline_from_profile", "timeline_from_sizes"]


@dataclass(frozen=True)
class MemoryTimeline:
    """Live bytes by category over time on one device.

    ``times_us``: sample times on the profiler's clock (microseconds, non-decreasing); ``bytes``: one row
    per sample, one column per :attr:`categories` (:data:`~lslm.metrics.step_memory.PROFILER_CATEGORIES`):
    the bytes held right after that sample's events. ``ranges``: ``(name, start_us, end_us)`` of the
    ``record_function`` ranges kept (same clock), in start order.
    """

    device: str
    times_us: tuple[int, ...]
    bytes: tuple[tuple[int, ...], ...]
    ranges: tuple[tuple[str, int, int], ...] = ()
    categories: tuple[str, ...] = PROFILER_CATEGORIES

    def __post_init__(self) -> None:
        assert len(self.times_us) == len(self.bytes), "one row of bytes per sample time"
        assert all(len(r) == len(self.categories) for r in self.bytes), "one column per category"

    @property
    def start_us(self) -> int:
        """The clock's zero for a figure: the first sample or range, whichever is earlier."""
        starts = list(self.times_us[:1]) + [a for _, a, _ in self.ranges]
        return min(starts) if starts else 0

    def totals(self) -> list[int]:
        """Bytes held at each sample, all categories together."""
        return [sum(r) for r in self.bytes]

    def peak_index(self) -> int:
        """The sample at which the total is largest (the first such; 0 for an empty timeline)."""
        totals = self.totals()
        return max(range(len(totals)), key=totals.__getitem__) if totals else 0

    def at(self, index: int) -> dict[str, int]:
        """Bytes by category at sample ``index``."""
        return dict(zip(self.categories, self.bytes[index], strict=True))

    def peak(self) -> dict[str, int]:
        """Bytes by category when the total peaks (all zero for an empty timeline)."""
        return self.at(self.peak_index()) if self.bytes else dict.fromkeys(self.categories, 0)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (what a launched worker returns); :meth:`from_dict` reads it back."""
        return {"device": self.device, "times_us": list(self.times_us), "bytes": [list(r) for r in self.bytes],
                "ranges": [list(r) for r in self.ranges], "categories": list(self.categories)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryTimeline:
        """The timeline :meth:`to_dict` wrote."""
        return cls(d["device"], tuple(d["times_us"]), tuple(tuple(r) for r in d["bytes"]),
                   tuple((str(n), int(a), int(b)) for n, a, b in d["ranges"]), tuple(d["categories"]))

    def category(self, name: str) -> list[int]:
        """One category's bytes at every sample."""
        if name not in self.categories:
            raise ValueError(f"no category {name!r}; the timeline has {list(self.categories)}")
        j = self.categories.index(name)
        return [r[j] for r in self.bytes]


def timeline_from_sizes(times_us: Sequence[int], sizes: Sequence[Sequence[int]], device: str | torch.device,
                        ranges: Iterable[tuple[str, int, int]] = ()) -> MemoryTimeline:
    """Build a :class:`MemoryTimeline` from ``MemoryProfileTimeline._coalesce_timeline``'s output.

    Each row of ``sizes`` has an unused column 0, then one column per profiler category in
    :data:`~lslm.metrics.step_memory.PROFILER_CATEGORIES` order (``unknown`` last); column 0 is dropped.
    Rows are sorted by time (stable: the profiler puts tensors that existed before it started at its
    earliest time, which can follow the first row). ``ranges`` are kept sorted by start.
    """
    if len(times_us) != len(sizes):
        raise ValueError(f"{len(times_us)} times but {len(sizes)} rows of sizes: the profiler's output is one row "
                         "per time")
    width = len(PROFILER_CATEGORIES) + 1
    for row in sizes:
        if len(row) != width:
            raise ValueError(f"a row of {len(row)} columns; the profiler's rows have {width} (column 0 unused, "
                             f"then {list(PROFILER_CATEGORIES)}): its categories changed")
    order = sorted(range(len(times_us)), key=lambda i: times_us[i])
    return MemoryTimeline(str(torch.device(device)), tuple(int(times_us[i]) for i in order),
                          tuple(tuple(int(v) for v in sizes[i][1:]) for i in order),
                          tuple(sorted(((str(n), int(a), int(b)) for n, a, b in ranges), key=lambda r: r[1])))


def _walk(events: Iterable[Any]) -> Iterator[Any]:
    for e in events:
        yield e
        yield from _walk(e.children)


def timeline_from_profile(prof: Any, device: str | torch.device,
                          range_prefixes: Sequence[str] = ()) -> MemoryTimeline:
    """The timeline of a finished ``torch.profiler.profile(profile_memory=True, record_shapes=True,
    with_stack=True)`` on ``device``, with its ``record_function`` ranges whose names start with any of
    ``range_prefixes`` (on the same microsecond clock as the samples)."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(str(torch.device(device)))
    ranges = []
    if range_prefixes:
        prefixes = tuple(range_prefixes)
        for e in _walk(prof.profiler.kineto_results.experimental_event_tree()):
            if e.name.startswith(prefixes):
                ranges.append((e.name, e.start_time_ns // 1000, e.end_time_ns // 1000))
    return timeline_from_sizes(times, sizes, device, ranges)


def record_memory_timeline(step: Callable[[], Any], device: str | torch.device, *,
                           range_prefixes: Sequence[str] = ()) -> tuple[MemoryTimeline, Any]:
    """Run ``step()`` once under the memory profiler; return its :class:`MemoryTimeline` on ``device`` and
    what ``step`` returned. ``range_prefixes``: which ``record_function`` ranges to keep (see
    :func:`timeline_from_profile`). Profile one step: the profiler costs seconds (module doc)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        result = step()
    return timeline_from_profile(prof, device, range_prefixes), result
