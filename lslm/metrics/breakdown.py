"""Bytes by owner (category) x device, resident and logical: :func:`memory_by_owner`.

Two sizes per storage, because ZeRO-3 and offloading make them differ:

* **resident** — ``storage.nbytes()`` now: the memory the storage really holds (the
  whole block, padding and unregistered parts included). A storage freed in place with
  ``t.untyped_storage().resize_(0)`` is 0; a ``meta`` tensor is 0.
* **logical** — the bytes the registered tensors address in it: a tensor at storage
  offset ``o`` addresses elements ``o .. o + e - 1`` with ``e = 1 + Σ (size_d - 1) ·
  stride_d`` (``= numel`` for a contiguous or transposed tensor), times the element
  size; overlapping ranges of views of one storage count once. So logical is
  ``numel · element_size`` for ordinary tensors, stays Ψ bytes for a freed ZeRO-3
  parameter, and may be below resident for a padded flat buffer of which only views
  are registered.

Each storage is counted once (identified by its ``StorageImpl``, which views and a
freed storage keep), on its device (``"cpu"``, ``"cuda:0"``, ...), in the first
category of :data:`~lslm.metrics.owners.CATEGORIES` it is registered under. A DTensor
is charged for its local shard. This is exact on every device; on CUDA,
:func:`~lslm.metrics.memory.memory_report` puts the allocator's own numbers next to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lslm.metrics.activations import ActivationMemory
from lslm.metrics.model_state import ModelStateBytes
from lslm.metrics.owners import CATEGORIES, check_category, collect_owned
from lslm.metrics.storage import storage_local

KINDS = ("resident", "logical")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per category and device, resident and logical (see the module doc for both).

    ``resident[category][device]`` and ``logical[category][device]``: every category of
    :data:`~lslm.metrics.owners.CATEGORIES` is a key (possibly with no devices).
    ``num_storages`` counts the distinct storages behind the registered tensors.
    ``print(breakdown)`` shows a table (category rows x device columns, MiB).
    """

    resident: dict[str, dict[str, int]]
    logical: dict[str, dict[str, int]]
    num_storages: int = 0

    @property
    def devices(self) -> list[str]:
        """Devices holding any counted bytes (resident or logical), sorted: ``cpu`` first, then ``cuda:i``."""
        found = {d for table in (self.resident, self.logical) for row in table.values() for d in row}
        return sorted(found, key=_device_order)

    def _table(self, kind: str) -> dict[str, dict[str, int]]:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return self.resident if kind == "resident" else self.logical

    def get(self, category: str, device: str | torch.device | None = None, kind: str = "resident") -> int:
        """Bytes of ``category`` on ``device`` (all devices when None)."""
        row = self._table(kind)[check_category(category)]
        if device is None:
            return sum(row.values())
        return row.get(str(torch.device(device)), 0)

    def total(self, device: str | torch.device | None = None, kind: str = "resident") -> int:
        """Bytes of every category on ``device`` (all devices when None)."""
        return sum(self.get(c, device, kind) for c in CATEGORIES)

    def model_states(self, device: str | torch.device | None = None, kind: str = "resident") -> ModelStateBytes:
        """The ZeRO view (§3.1): params, grads (+ main grads), optimizer states (+ master weights), buffers.

        Equal to :func:`~lslm.metrics.model_state.model_state_bytes` for a model and a
        torch optimizer (counts of elements and tensors are left 0).
        """
        def g(*cats: str) -> int:
            return sum(self.get(c, device, kind) for c in cats)

        return ModelStateBytes(params=g("parameters"), grads=g("gradients", "main_grads"),
                               optimizer_states=g("master_weights", "optimizer_states"), buffers=g("module_buffers"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"resident": {cat: {dev: bytes}}, "logical": ..., "total_resident", "total_logical",
        "num_storages"}``."""
        return {"resident": {c: dict(r) for c, r in self.resident.items()},
                "logical": {c: dict(r) for c, r in self.logical.items()},
                "total_resident": self.total(kind="resident"), "total_logical": self.total(kind="logical"),
                "num_storages": self.num_storages}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryBreakdown:
        """Rebuild from :meth:`to_dict` output (e.g. a worker's JSON result)."""
        return cls(resident={c: dict(d["resident"].get(c, {})) for c in CATEGORIES},
                   logical={c: dict(d["logical"].get(c, {})) for c in CATEGORIES},
                   num_storages=int(d.get("num_storages", 0)))

    def table(self, unit: str = "MiB", decimals: int | None = None, *, all_rows: bool = False) -> str:
        """Category rows x (device, resident/logical) columns, in ``unit`` (B, KiB, MiB, GiB).

        Rows that are zero everywhere are left out unless ``all_rows``; the last row is the total.
        """
        if unit not in _UNITS:
            raise ValueError(f"unit must be one of {tuple(_UNITS)}, got {unit!r}")
        scale = _UNITS[unit]
        decimals = (0 if unit == "B" else 2) if decimals is None else decimals
        devices = self.devices or ["cpu"]
        header = [f"category ({unit})"] + [f"{d} {k}" for d in devices for k in KINDS]
        rows = []
        for c in CATEGORIES:
            cells = [self.get(c, d, k) for d in devices for k in KINDS]
            if all_rows or any(cells):
                rows.append([c] + [f"{v / scale:.{decimals}f}" for v in cells])
        rows.append(["total"] + [f"{self.total(d, k) / scale:.{decimals}f}" for d in devices for k in KINDS])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                 for r in [header, *rows]]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _device_order(device: str) -> tuple[int, str, int]:
    d = torch.device(device)
    return (0 if d.type == "cpu" else 1, d.type, -1 if d.index is None else d.index)


def footprint(t: torch.Tensor) -> tuple[Any, str, int, tuple[int, int]]:
    """``(storage key, device, resident bytes, (start, end) byte range addressed)`` of one tensor.

    The key is the ``StorageImpl`` address, which views share and which survives
    ``resize_(0)``; the tensors are alive while we count, so it cannot be reused meanwhile.
    """
    t = storage_local(t)
    es = t.element_size()
    device = str(t.device)
    try:
        storage = t.untyped_storage()
        key: Any = ("storage", storage._cdata)
        resident = 0 if t.device.type == "meta" else storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        # Wrapper subclasses without a real storage: the tensor itself, no dedupe by storage.
        nbytes = t.numel() * es
        return ("id", id(t)), device, nbytes, (0, nbytes)
    extent = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = t.storage_offset() * es
    return key, device, resident, (start, start + extent * es)


def _union_bytes(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(ranges):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def count_by_owner(pairs: Iterable[tuple[str, torch.Tensor]]) -> MemoryBreakdown:
    """Count ``(category, tensor)`` pairs: each storage once, in its first category, on its device."""
    rank = {c: i for i, c in enumerate(CATEGORIES)}
    storages: dict[Any, dict[str, Any]] = {}
    for category, tensor in pairs:
        key, device, resident, span = footprint(tensor)
        s = storages.setdefault(key, {"category": category, "device": device, "resident": resident, "ranges": []})
        if rank[check_category(category)] < rank[s["category"]]:
            s["category"] = category
        s["ranges"].append(span)
    resident_t: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
    logical_t: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
    for s in storages.values():
        c, d = s["category"], s["device"]
        resident_t[c][d] = resident_t[c].get(d, 0) + s["resident"]
        logical_t[c][d] = logical_t[c].get(d, 0) + _union_bytes(s["ranges"])
    return MemoryBreakdown(resident=resident_t, logical=logical_t, num_storages=len(storages))


def memory_by_owner(model: nn.Module | None = None, optimizer: Any = None, *, owners: Iterable[Any] = (),
                    activations: ActivationMemory | None = None) -> MemoryBreakdown:
    """Bytes by category x device, resident and logical, of everything the arguments hold.

    ``model``, ``optimizer`` and ``owners`` are read as in
    :func:`~lslm.metrics.owners.collect_owned` (a DDP wrapper can be passed as the model,
    or as an owner next to its ``.module``); each storage is counted once, in the first
    category of :data:`~lslm.metrics.owners.CATEGORIES`. ``activations``: an
    :class:`~lslm.metrics.activations.ActivationMemory` that counted a forward; its
    per-device bytes become the ``activations`` row (resident = logical). That row is
    what the counted forward saved, a peak-time quantity, not a snapshot of now (after
    backward the saved tensors are gone); they are not deduplicated against the rest,
    which they cannot share storage with (parameters are excluded when it was given the
    model).

    Example::

        report = memory_by_owner(ddp, optimizer)   # ddp brings its bucket buffers
        print(report)                              # a table in MiB
        report.get("comm_buffers")                 # bytes, all devices
    """
    return add_activations(count_by_owner(collect_owned(model, optimizer, owners)), activations)


def add_activations(breakdown: MemoryBreakdown, activations: ActivationMemory | None) -> MemoryBreakdown:
    """A copy of ``breakdown`` with ``activations.bytes_by_device`` added to the ``activations`` row."""
    if activations is None:
        return breakdown
    resident = {c: dict(r) for c, r in breakdown.resident.items()}
    logical = {c: dict(r) for c, r in breakdown.logical.items()}
    for device, nbytes in activations.bytes_by_device.items():
        for table in (resident, logical):
            table["activations"][device] = table["activations"].get(device, 0) + nbytes
    return MemoryBreakdown(resident=resident, logical=logical, num_storages=breakdown.num_storages)
