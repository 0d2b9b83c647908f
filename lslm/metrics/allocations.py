"""Bytes a piece of code allocates, op by op, counted exactly on any device (the CPU included).

``torch.cuda.memory_allocated`` exists only on GPUs. :func:`count_allocations` instead watches
every aten op under a ``TorchDispatchMode`` and charges an op the bytes of each output whose
storage is new: not a view of an input, not an in-place result. Copies show up by name
(``aten.clone``, ``aten.copy_`` into a fresh ``empty``, ``aten._to_copy``), which is what the
tensor-parallel notebook and tests use to count the copies a communication layout costs.
Ops that run inside a collective's C++ (gloo, NCCL) are not aten ops and are not seen: the
count is of what PyTorch code allocates around the communication.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["AllocationCount", "COPY_OPS", "LiveBytes", "count_allocations", "note_storage_resize", "track_live_bytes"]

#: aten ops whose output is a copy of an input (their bytes are the "copies" of :class:`AllocationCount`).
COPY_OPS = ("aten.clone", "aten._to_copy", "aten.contiguous", "aten._unsafe_view_copy")


@dataclass
class AllocationCount:
    """New-storage bytes per op name (``by_op``) and their total; ``copies`` counts the :data:`COPY_OPS`."""

    by_op: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        """Every new byte."""
        return sum(self.by_op.values())

    @property
    def copy_bytes(self) -> int:
        """Bytes of the copy ops."""
        return sum(n for op, n in self.by_op.items() if op.startswith(COPY_OPS))

    @property
    def copies(self) -> int:
        """How many copy ops ran."""
        return sum(n for op, n in self.calls.items() if op.startswith(COPY_OPS))


def _storages(tree: Any) -> set[int]:
    leaves, _ = tree_flatten(tree)
    return {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor) and t.numel() > 0}


class _Counter(TorchDispatchMode):
    def __init__(self, count: AllocationCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = _storages((args, kwargs))
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        name = name if name.startswith("aten") else f"aten.{name}"
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)  # two outputs on one new storage count once
                    self.count.by_op[name] += t.untyped_storage().nbytes()
                    self.count.calls[name] += 1
        return out


@contextmanager
def count_allocations() -> Iterator[AllocationCount]:
    """``with count_allocations() as c:`` ... ``c.total``, ``c.copy_bytes``, ``c.by_op``: what the block allocated.

    Forward and backward alike (autograd's backward ops dispatch through the mode too, when
    ``backward()`` is called inside the block).
    """
    count = AllocationCount()
    with _Counter(count):
        yield count


@dataclass
class LiveBytes:
    """Bytes of the storages allocated inside :func:`track_live_bytes` and still alive (``current``), and the
    most that were alive at once (``peak``), per device type (``"cpu"``, ``"cuda"``); meta tensors own no bytes."""

    current: Counter = field(default_factory=Counter)
    peak: Counter = field(default_factory=Counter)

    def _grow(self, device: str, nbytes: int) -> None:
        self.current[device] += nbytes
        self.peak[device] = max(self.peak[device], self.current[device])

    def _shrink(self, device: str, nbytes: int) -> None:
        self.current[device] -= nbytes


class _LiveTracker(TorchDispatchMode):
    def __init__(self, live: LiveBytes) -> None:
        super().__init__()
        self.live = live
        # Keyed by the storage object (its C++ address, stable across a resize), not by the data pointer, which a
        # resize changes: storage -> [device type, bytes charged now].
        self.alive: dict[int, list[Any]] = {}

    def _freed(self, key: int) -> None:
        entry = self.alive.pop(key, None)
        if entry is not None:
            self.live._shrink(entry[0], entry[1])

    def _track(self, storage: Any, device: str, nbytes: int) -> None:
        self.alive[storage._cdata] = [device, nbytes]
        self.live._grow(device, nbytes)
        # Storages keep their Python object while any tensor uses them: the finalizer runs at the free.
        weakref.finalize(storage, self._freed, storage._cdata)

    def resized(self, storage: Any, device: str, nbytes: int) -> None:
        """``storage`` now holds ``nbytes``: a re-growth inside the block is an allocation, a shrink of one made
        inside the block a free (storages from before the block stay uncounted, as with every other tensor)."""
        entry = self.alive.get(storage._cdata)
        if entry is None:
            if nbytes:
                self._track(storage, device, nbytes)
            return
        if nbytes >= entry[1]:
            self.live._grow(device, nbytes - entry[1])
        else:
            self.live._shrink(device, entry[1] - nbytes)
        entry[1] = nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten((args, kwargs))
        seen = {t.untyped_storage()._cdata for t in leaves if isinstance(t, torch.Tensor) and not t.is_meta}
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if not isinstance(t, torch.Tensor) or t.is_meta or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage._cdata in seen or storage._cdata in self.alive:
                continue
            self._track(storage, t.device.type, storage.nbytes())
        return out


#: The trackers of the :func:`track_live_bytes` blocks now open (innermost last).
_TRACKERS: list[_LiveTracker] = []


def note_storage_resize(storage: Any, device: str, nbytes: int) -> None:
    """Tell the open :func:`track_live_bytes` blocks that ``storage`` (an ``UntypedStorage``) now holds ``nbytes``.

    A storage's ``resize_`` (how ZeRO-3 frees and re-grows a gathered unit, :mod:`lslm.zero.gather`) runs
    below the dispatcher, where a dispatch mode cannot see it: code that resizes storages calls this.
    Nothing happens when no block is open.
    """
    for tracker in _TRACKERS:
        tracker.resized(storage, device, nbytes)


@contextmanager
def track_live_bytes() -> Iterator[LiveBytes]:
    """``with track_live_bytes() as live:`` ... ``live.peak["cpu"]``: the most bytes the block's own allocations
    held at once, exact, on any device (the CPU included, where ``torch.cuda.max_memory_allocated`` has no
    counterpart).

    Each new storage an aten op creates inside the block is counted from its allocation to its
    free (a finalizer on the storage); storages that existed before the block are not counted,
    nor are buffers allocated inside C++ collectives. A storage resized by ``resize_`` is counted when its
    owner reports it (:func:`note_storage_resize`; ZeRO-3's gathered units do). Used to measure what
    building a model costs a rank at start (:mod:`lslm.models.deferred_init`).
    """
    live = LiveBytes()
    tracker = _LiveTracker(live)
    _TRACKERS.append(tracker)
    try:
        with tracker:
            yield live
    finally:
        _TRACKERS.remove(tracker)
