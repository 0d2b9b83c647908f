"""Memory accounting: one API that reads the same on a laptop CPU and on a GPU.

Four questions, four tools:

* **Model states** (:func:`model_state_bytes`): exact bytes held by parameters,
  gradients and optimizer states, counted as *unique storages* so that tied
  weights and views of one flat buffer count once. Device independent, so it
  is the number to compare with the ZeRO formulas
  (:func:`theory_model_state_bytes`) on any machine.
* **Activations** (:class:`ActivationMemory`): bytes of tensors that autograd
  saves for backward during a forward pass, read through
  ``torch.autograd.graph.saved_tensors_hooks``.
* **Everything, by owner** (:func:`memory_by_owner`): bytes per category
  (parameters, gradients, master weights, main grads, optimizer states, module
  buffers, communication buffers, activations) x device, resident and logical,
  collected from the model, the optimizer and wrappers that register what they own
  (``memory_owners()``, :class:`MemoryRegistry`).
* **The process** (:func:`memory_report`): ``torch.cuda`` allocator statistics
  on CUDA, resident set size (RSS) of the process everywhere, with the model
  states and the breakdown by owner.

Model states and activations are counted by one rule (:mod:`lslm.metrics.storage`):
a tensor is charged the full ``nbytes`` of the storage it views, once per storage.
Each tool has its module (``model_state``, ``activations``, ``owners`` and
``breakdown``); this one adds the process-level view and re-exports the rest, so
``lslm.metrics`` is the one API.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch import nn

# The three tools live in their own modules; importing them here keeps this the one entry point.
from lslm.metrics.activations import ActivationMemory
from lslm.metrics.breakdown import MemoryBreakdown, add_activations, count_by_owner, memory_by_owner
from lslm.metrics.model_state import ModelStateBytes, model_state_bytes, theory_model_state_bytes
from lslm.metrics.owners import CATEGORIES, MemoryOwner, MemoryRegistry, collect_owned
from lslm.metrics.storage import format_bytes

__all__ = ["CATEGORIES", "ActivationMemory", "MemoryBreakdown", "MemoryOwner", "MemoryRegistry", "MemoryReport",
           "ModelStateBytes", "format_bytes", "memory_by_owner", "memory_report", "model_state_bytes",
           "peak_rss_bytes", "process_rss_bytes", "reset_peak_memory", "theory_model_state_bytes"]

_MIB = 1024**2


def process_rss_bytes() -> int:
    """Current resident set size of this process, in bytes (psutil)."""
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process in bytes, or None where unknown.

    Reads ``getrusage(RUSAGE_SELF).ru_maxrss``: KiB on Linux, bytes on macOS;
    the ``resource`` module does not exist on Windows. It cannot be reset.
    The result is at least the current RSS.
    """
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = int(peak) if sys.platform == "darwin" else int(peak) * 1024
    # Linux keeps RSS in lazily synchronised per-thread counters, so ru_maxrss can
    # trail psutil's current RSS by a few hundred KiB; a peak below "now" is never right.
    return max(peak, process_rss_bytes())


@dataclass(frozen=True)
class MemoryReport:
    """A snapshot of memory, same fields on every device; inapplicable ones are None.

    ``allocated``/``peak_allocated``/``reserved`` come from the CUDA caching
    allocator and are None off CUDA. ``rss``/``peak_rss`` describe the host
    process on every device. ``model_state`` is None when no model was given.
    ``by_owner`` (:class:`MemoryBreakdown`) is None when nothing to count was given.
    ``allocated_untracked`` (CUDA only, with ``by_owner``): allocated bytes on this
    device that no owner accounts for - temporaries, live activations nobody
    registered, the allocator's rounding of each block.
    """

    device: str
    allocated: int | None = None
    peak_allocated: int | None = None
    reserved: int | None = None
    rss: int | None = None
    peak_rss: int | None = None
    model_state: ModelStateBytes | None = None
    by_owner: MemoryBreakdown | None = None
    allocated_untracked: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``model_state`` and ``by_owner`` become nested dicts (or None)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["model_state"] = self.model_state.to_dict() if self.model_state is not None else None
        d["by_owner"] = self.by_owner.to_dict() if self.by_owner is not None else None
        return d

    def __str__(self) -> str:
        def mib(n: int | None) -> str:
            return "n/a" if n is None else f"{n / _MIB:.1f} MiB"

        parts = [self.device]
        if self.allocated is not None:
            parts.append(
                f"allocated {mib(self.allocated)} (peak {mib(self.peak_allocated)}), "
                f"reserved {mib(self.reserved)}"
            )
        if self.model_state is not None:
            parts.append(f"model states: {self.model_state}")
        parts.append(f"RSS {mib(self.rss)} (peak {mib(self.peak_rss)})")
        return " | ".join(parts)


def memory_report(
    device: torch.device | str,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    owners: Iterable[MemoryOwner] = (),
    activations: ActivationMemory | None = None,
) -> MemoryReport:
    """Snapshot memory on ``device``: CUDA allocator stats on CUDA, host RSS always.

    ``torch.cuda`` is called only when ``device.type == "cuda"``, so this runs on
    machines without CUDA. With ``model`` (and ``optimizer``), exact model-state
    bytes from :func:`model_state_bytes` are included on every device. With any of
    ``model``, ``optimizer``, ``owners`` (wrappers such as a DDP wrapper) or
    ``activations``, ``by_owner`` holds :func:`memory_by_owner`'s breakdown, and on
    CUDA ``allocated_untracked`` what the allocator holds beyond it.
    """
    device = torch.device(device)
    allocated = peak_allocated = reserved = None
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        peak_allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
    owners = list(owners)
    by_owner = untracked = None
    if model is not None or optimizer is not None or owners or activations is not None:
        counted = count_by_owner(collect_owned(model, optimizer, owners))
        if allocated is not None:  # activations are a forward-time count, not live now: not subtracted
            untracked = allocated - counted.total(device)
        by_owner = add_activations(counted, activations)
    rss = process_rss_bytes()
    peak_rss = peak_rss_bytes()  # read after rss, and clamped to it, so peak >= rss
    return MemoryReport(
        device=str(device),
        allocated=allocated,
        peak_allocated=peak_allocated,
        reserved=reserved,
        rss=rss,
        peak_rss=None if peak_rss is None else max(peak_rss, rss),
        model_state=model_state_bytes(model, optimizer) if model is not None else None,
        by_owner=by_owner,
        allocated_untracked=untracked,
    )


def reset_peak_memory(device: torch.device | str) -> None:
    """Reset the peak counter where one can be reset (CUDA); a no-op elsewhere.

    The host's peak RSS (``ru_maxrss``) cannot be reset from inside a process.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
