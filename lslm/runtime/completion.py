"""When did a communication call finish? Completion times for ledger records.

A record's *issue* time is ``time.perf_counter()`` when lslm made the call. Its
*completion* time is stamped only when asked for (the ledger's ``record_completion``,
or ``with ledger.timed():``, see :class:`~lslm.runtime.records.CommLedger`: timelines
read it, byte counts do not), and then set once, from whichever thread learns it first:

* blocking calls on the CPU (gloo): right after the call returns;
* asynchronous calls (``async_op=True``, ``isend``/``irecv``, ``batch_isend_irecv``):
  from the work's future (gloo collectives run the callback on gloo's own thread
  as soon as the operation ends), else when ``wait()`` (or a true ``is_completed()``)
  returns - gloo's point-to-point works have no future in torch 2.13;
* CUDA (NCCL): a ``torch.cuda.Event`` recorded on the current stream after the
  operation (after it returns for a blocking call, in the future's callback or after
  ``wait()`` for an asynchronous one - in each case that stream is ordered after the
  collective). Events are converted to the ``perf_counter`` clock lazily, when the
  time is read, through one anchor event per device recorded while the device was
  idle (one ``synchronize`` at the first CUDA communication of the process). Until
  the event has happened, the completion time reads ``None``.

The CPU path never calls ``torch.cuda``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch


class Completion:
    """A completion time set at most once (the first setter wins), safe to set and read from any thread."""

    __slots__ = ("_device", "_event", "_lock", "_time")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._time: float | None = None
        self._event: Any = None
        self._device: torch.device | None = None

    def set(self, t: float) -> None:
        """Record ``t`` (a ``perf_counter`` time) unless a time or an event was recorded before."""
        with self._lock:
            if self._time is None and self._event is None:
                self._time = t

    def set_event(self, event: Any, device: torch.device) -> None:
        """Record a CUDA event that fires when the operation is done (resolved when read)."""
        with self._lock:
            if self._time is None and self._event is None:
                self._event, self._device = event, device

    def time(self) -> float | None:
        """The completion time, or None while unknown (not finished, or the call failed)."""
        with self._lock:
            if self._time is not None or self._event is None:
                return self._time
            event, device = self._event, self._device
        if not event.query():
            return None
        t = _CLOCK.host_time(event, device)
        with self._lock:
            self._time = t
            return t


class _CudaClock:
    """Maps CUDA events to ``perf_counter`` time through one anchor event per device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._anchors: dict[int, tuple[Any, float]] = {}

    def ensure_anchor(self, device: torch.device) -> None:
        """Record this device's anchor if it has none (synchronizes the device once)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index in self._anchors:
                return
            torch.cuda.synchronize(index)  # idle device: the anchor runs at once
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(index))
            event.synchronize()
            self._anchors[index] = (event, time.perf_counter())

    def host_time(self, event: Any, device: torch.device) -> float:
        """``perf_counter`` time at which ``event`` (already complete) happened on ``device``."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        anchor, host = self._anchors[index]
        return host + anchor.elapsed_time(event) / 1e3


_CLOCK = _CudaClock()


def prepare(device: torch.device | None) -> None:
    """Call before a CUDA operation is issued, on the issuing thread (creates the device's clock anchor)."""
    if device is not None and device.type == "cuda":
        _CLOCK.ensure_anchor(device)


def stamp(completions: Sequence[Completion], device: torch.device | None) -> None:
    """Mark ``completions`` done now: the host clock on the CPU, an event on the current stream on CUDA."""
    if device is not None and device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        for c in completions:
            c.set_event(event, device)
        return
    now = time.perf_counter()
    for c in completions:
        c.set(now)


def mark(device: torch.device | None) -> Completion:
    """A completion stamped now: the host clock on the CPU, an event on the current stream on CUDA.

    For timelines of work that runs on a device: on CUDA the host reaches a line of code when
    it *enqueues* the kernels before it, so a host clock there times launches, not the work;
    the event fires when the stream really gets there. Read it with :meth:`Completion.time`.
    """
    c = Completion()
    prepare(device)
    stamp([c], device)
    return c


def resolve(value: Any) -> Any:
    """``value.time()`` for a :class:`Completion` (None until its event happened), else ``value`` itself."""
    return value.time() if isinstance(value, Completion) else value


class WorkWrapper:
    """A ``torch.distributed`` work handle wrapped to add something around ``wait()``: ``is_completed``,
    ``get_future`` (DDP communication hooks need it), ``work`` and any other attribute reach the wrapped work.
    Subclasses (:class:`TimedWork`, :class:`lslm.runtime.comm_trace.TracedWork`) override what they add to."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """As ``Work.wait``."""
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        """As ``Work.is_completed``."""
        return bool(self._work.is_completed())

    def get_future(self) -> Any:
        """The wrapped work's future (for DDP communication hooks)."""
        return self._work.get_future()

    @property
    def work(self) -> Any:
        """The wrapped work."""
        return self._work

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class TimedWork(WorkWrapper):
    """A ``torch.distributed`` work handle that stamps its records' completion time.

    Behaves like the wrapped work (``wait``, ``is_completed``, ``get_future`` and
    anything else are forwarded). The time comes from the work's future when the
    backend offers one, else from the return of ``wait()``.
    """

    def __init__(self, work: Any, completions: Sequence[Completion], device: torch.device | None,
                 p2p: bool = False) -> None:
        super().__init__(work)
        self._completions = list(completions)
        self._device = device
        future = None
        # gloo's send/recv works have no future ("getFuture not implemented"), and asking
        # costs a C++ exception with a backtrace (~75 us, measured): 12 per ring all-reduce
        # on 4 ranks. So p2p off CUDA goes straight to the wait() stamp.
        if not p2p or (device is not None and device.type == "cuda"):
            try:
                future = work.get_future()
            except RuntimeError:
                future = None
        if future is not None:
            future.then(self._on_done)

    def _on_done(self, _future: Any) -> None:
        stamp(self._completions, self._device)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """Wait for the operation (as ``Work.wait``), then stamp the completion if nothing did earlier."""
        out = self._work.wait(*args, **kwargs)
        stamp(self._completions, self._device)
        return out

    def is_completed(self) -> bool:
        """As ``Work.is_completed``; a True answer stamps the completion if nothing did earlier."""
        done = bool(self._work.is_completed())
        if done:
            stamp(self._completions, self._device)
        return done
