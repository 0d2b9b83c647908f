"""A step timer that reads true times on CPU and on GPU.

Timing a training step with ``time.perf_counter()`` alone is right on CPU, where every
op has finished when it returns, and wrong on CUDA, where ops are *queued*: the host
reaches "after backward" long before the GPU does, and an NCCL all-reduce that the
compute stream waits for costs the host nothing. A DDP step timed that way reads ~0
exposed communication. :class:`StepTimer` therefore has three modes:

* ``"host"`` - ``perf_counter`` only (the CPU default; never touches ``torch.cuda``);
* ``"events"`` - one CUDA event per mark, recorded on the device's current stream
  (the CUDA default). An event completes when the stream reaches it, so the time
  between two marks is what the *stream* spent there, including its waits on
  communication streams (``Work.wait()`` on NCCL makes the compute stream wait);
  the host never blocks until :meth:`StepTimer.stop`;
* ``"sync"`` - ``torch.cuda.synchronize`` before every reading: simple and exact, but
  it serialises the host with the GPU (and a device-wide sync also waits for
  communication streams, so it hides overlap).

Marks are reported as host-clock seconds (``perf_counter`` scale) in every mode, so
they line up with other host timestamps (e.g. DDP bucket events): in ``"events"``
mode the device is synchronised at :meth:`StepTimer.start`, which anchors the first
event to the host clock, and every later mark is ``start + elapsed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lslm.metrics.trace import mark_range
from lslm.runtime.startup import synchronize

__all__ = ["Marks", "StepTimer", "timer_mode"]

_MODES = ("auto", "host", "sync", "events")


@dataclass(frozen=True)
class Marks:
    """The named points in time of one step, in seconds on the host clock: ``"start"``, ..., ``"end"``."""

    times: dict[str, float]

    def __getitem__(self, name: str) -> float:
        return self.times[name]

    def span(self, a: str = "start", b: str = "end") -> float:
        """Seconds from mark ``a`` to mark ``b``."""
        return self.times[b] - self.times[a]

    @property
    def total(self) -> float:
        """Seconds from ``start`` to ``end``: the whole step."""
        return self.span()


def timer_mode(device: torch.device | str, mode: str = "auto") -> str:
    """The mode ``"auto"`` resolves to on ``device``: ``"events"`` on CUDA, ``"host"`` elsewhere."""
    if mode not in _MODES:
        raise ValueError(f"timer mode must be one of {_MODES}, got {mode!r}")
    is_cuda = torch.device(device).type == "cuda"
    if mode == "auto":
        return "events" if is_cuda else "host"
    if mode in ("events", "sync") and not is_cuda:
        return "host"  # CPU ops are synchronous: nothing to wait for, and torch.cuda must not be touched
    return mode


class StepTimer:
    """Marks inside a step: ``start()``, ``mark(name)`` any number of times, ``stop()`` -> :class:`Marks`.

    ``clock`` is the host clock (``time.perf_counter``); tests pass a fake one. Marking
    the same name twice keeps the later time (e.g. "forward_end" of the last micro-batch).
    """

    def __init__(self, device: torch.device | str = "cpu", *, mode: str = "auto",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = torch.device(device)
        self.mode = timer_mode(self.device, mode)
        self.clock = clock
        self._host: dict[str, float] = {}
        self._events: dict[str, Any] = {}
        self._running = False

    def _now(self, name: str) -> None:
        mark_range(name)  # a zero-length ``lslm.mark:<name>`` range while a profiler traces the step
        if self.mode == "events":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._events[name] = event
            return
        if self.mode == "sync":
            synchronize(self.device)
        self._host[name] = self.clock()

    def start(self) -> None:
        """Begin a step (forgets the previous one's marks)."""
        self._host, self._events = {}, {}
        if self.mode == "events":
            synchronize(self.device)  # anchor: the stream is idle, so the start event fires "now"
            self._host["start"] = self.clock()
        self._now("start")
        self._running = True

    def mark(self, name: str) -> None:
        """Record the point ``name`` (on the device's stream in ``"events"`` mode)."""
        if not self._running:
            raise RuntimeError("StepTimer.mark() before start()")
        if name in ("start", "end"):
            raise ValueError("'start' and 'end' are set by start() and stop(); pick another mark name")
        self._now(name)

    def stop(self, name: str = "end") -> Marks:
        """End the step at mark ``name`` and return every mark (waits for the device in ``"events"`` mode)."""
        if not self._running:
            raise RuntimeError("StepTimer.stop() before start()")
        self._now(name)
        self._running = False
        if self.mode != "events":
            return Marks(dict(self._host))
        self._events[name].synchronize()
        first = self._events["start"]
        t0 = self._host["start"]
        return Marks({k: t0 + first.elapsed_time(ev) / 1e3 for k, ev in self._events.items()})
