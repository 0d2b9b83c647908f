"""Activation memory of a pipeline rank, counted in bytes (deterministic: storages, not RSS).

A micro-batch's forward on a stage leaves memory behind until that micro-batch's
backward: what autograd saved for the backward (counted with
``torch.autograd.graph.saved_tensors_hooks``), the stage's input (a receive buffer, or
the token ids), its output until it is sent and deallocated, and after a split ``I``
what the ``W`` still needs (:class:`~lslm.pipeline.split_backward.WeightGradStore`).
How many micro-batches a schedule keeps in flight at once is what sets its activation
memory: GPipe keeps all ``m``, 1F1B at most ``p - rank`` (Narayanan et al. 2021,
section 2.2), so the counts here make the schedules' memory difference exact.

Counting rule (as :mod:`lslm.metrics.storage`): a tensor is charged its whole storage,
each storage once (views and aliases deduplicate, also across micro-batches and stages),
parameters never. The rank's *held* bytes are the union over its live (stage,
micro-batch) entries; the *peak* is their maximum over the step, read at action
boundaries (before each compute action, after the previous action's communication was
posted and its output deallocated) and right after a rematerialised forward.

Beside the count, on the CPU, the same boundaries read glibc's allocator
(:func:`~lslm.metrics.malloc.malloc_in_use_bytes`): ``allocator_peak_bytes`` is the most it had handed
out at a boundary over what it had at the step's start, nothing registered. It includes what the count
leaves out by design (gradients created by the step's first backwards, receive buffers in flight,
transient outputs, autograd's own records, gloo's buffers), so it reads above the count.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lslm.metrics.malloc import malloc_in_use_bytes
from lslm.metrics.storage import storage_of

__all__ = ["PipelineMemory"]

Key = tuple[int, int]  # (stage, micro-batch)


class PipelineMemory:
    """Activation bytes held by one rank's stages, per ``(stage, micro-batch)``, and the step's peak."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        self._excluded: set[Hashable] = {storage_of(p)[0] for p in params}
        # glibc's figure describes host memory: read it only when the stages live there
        self._on_cpu = all(p.device.type == "cpu" for p in params)
        self.entries: dict[Key, dict[Hashable, int]] = {}
        self.reset()

    def reset(self) -> None:
        """Start a new step."""
        self.entries = {}
        self.peak_bytes = 0
        self._malloc_start = malloc_in_use_bytes() if self._on_cpu else None
        #: The most glibc's allocator held at a boundary over the step's start (``None`` off glibc or off the CPU).
        self.allocator_peak_bytes: int | None = None if self._malloc_start is None else 0
        #: Bytes of each (stage, mb) at the first boundary after its forward (output already deallocated).
        self.per_mb_bytes: dict[Key, int] = {}
        #: Bytes autograd saved in each (stage, mb)'s forward (the re-run's, with rematerialisation).
        self.saved_bytes: dict[Key, int] = {}
        self.output_bytes: dict[Key, int] = {}
        self.freed_by_deallocation = 0
        self.remat_forwards = 0
        self.remat_seconds = 0.0
        #: Bytes of the gradients the rank's stages hold at the step's end (:meth:`note_gradients`).
        self.gradient_bytes = 0

    # -- filling entries -------------------------------------------------------------
    def _add(self, key: Key, t: torch.Tensor) -> int:
        skey, nbytes, _ = storage_of(t)
        if skey in self._excluded:
            return 0
        entry = self.entries.setdefault(key, {})
        if skey in entry:
            return 0
        entry[skey] = nbytes
        return nbytes

    @contextmanager
    def saving(self, key: Key) -> Iterator[None]:
        """Inside: every tensor autograd saves for backward is charged to ``key``."""
        counted = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal counted
            counted += self._add(key, t)
            return t  # as is: the backward sees exactly what it saved

        self.entries.setdefault(key, {})
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
        self.saved_bytes[key] = self.saved_bytes.get(key, 0) + counted

    def hold(self, key: Key, *tensors: torch.Tensor | None) -> None:
        """Charge ``tensors`` (an input, an output) to ``key``."""
        for t in tensors:
            if t is not None:
                self._add(key, t)

    def drop(self, key: Key, t: torch.Tensor) -> int:
        """``t``'s storage leaves ``key`` (an output deallocated after its send); returns its bytes."""
        freed = self.entries.get(key, {}).pop(storage_of(t)[0], 0)
        self.freed_by_deallocation += freed
        return freed

    def release(self, key: Key, keep: Iterable[torch.Tensor] = ()) -> None:
        """``key``'s backward ran: its entry now holds only ``keep`` (what a deferred ``W`` still needs)."""
        self.entries.pop(key, None)
        for t in keep:
            self._add(key, t)
        if key in self.entries and not self.entries[key]:
            del self.entries[key]

    def note_remat(self, seconds: float) -> None:
        """One rematerialised forward took ``seconds``."""
        self.remat_forwards += 1
        self.remat_seconds += seconds

    def note_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """The step's end: charge the gradients ``params`` hold (``.grad`` and ``main_grad``, each storage once) to
        ``gradient_bytes``: not activations, but what the allocator's figure includes once a backward made them."""
        seen: dict[Hashable, int] = {}
        for p in params:
            for g in (p.grad, getattr(p, "main_grad", None)):
                if g is not None:
                    key, nbytes, _ = storage_of(g)
                    seen[key] = nbytes
        self.gradient_bytes = sum(seen.values())

    # -- reading -----------------------------------------------------------------------
    def held(self) -> int:
        """Bytes held now: the union of every live entry's storages."""
        union: dict[Hashable, int] = {}
        for entry in self.entries.values():
            union.update(entry)
        return sum(union.values())

    def observe(self) -> int:
        """An action boundary: update the peak, and note new entries' per-micro-batch bytes; returns held bytes."""
        for key, entry in self.entries.items():
            if key not in self.per_mb_bytes:
                self.per_mb_bytes[key] = sum(entry.values())
        now = self.held()
        self.peak_bytes = max(self.peak_bytes, now)
        if self._malloc_start is not None:
            self.allocator_peak_bytes = max(self.allocator_peak_bytes or 0,
                                            (malloc_in_use_bytes() or 0) - self._malloc_start)
        return now

    def summary(self) -> dict[str, Any]:
        """JSON-ready: ``peak_bytes``, and per stage (string keys) lists over micro-batches of
        ``per_mb_bytes``, ``saved_bytes``, ``output_bytes``; ``freed_by_deallocation``, ``remat_forwards``,
        ``remat_seconds``, ``allocator_peak_bytes``, ``gradient_bytes``."""
        def by_stage(values: dict[Key, int]) -> dict[str, list[int]]:
            out: dict[str, list[int]] = {}
            for (s, mb), v in sorted(values.items()):
                row = out.setdefault(str(s), [])
                row.extend([0] * (mb + 1 - len(row)))
                row[mb] = v
            return out

        return {"peak_bytes": self.peak_bytes, "per_mb_bytes": by_stage(self.per_mb_bytes),
                "saved_bytes": by_stage(self.saved_bytes), "output_bytes": by_stage(self.output_bytes),
                "freed_by_deallocation": self.freed_by_deallocation, "remat_forwards": self.remat_forwards,
                "remat_seconds": self.remat_seconds, "allocator_peak_bytes": self.allocator_peak_bytes,
                "gradient_bytes": self.gradient_bytes}


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t

