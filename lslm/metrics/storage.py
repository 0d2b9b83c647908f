"""Storage-level byte counting shared by the memory tools.

The counting rule: a tensor is charged the full ``nbytes`` of the storage it
views, because that whole block stays allocated while the tensor lives; a storage
is charged once, identified by its device and data pointer. DTensors are charged
for their local shard.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import torch

try:  # A weak reference to a storage tells a freed-and-reused address from a live one.
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover - present in every torch this package supports
    StorageWeakRef = None  # type: ignore[assignment,misc]


def format_bytes(n: float) -> str:
    """Format a byte count with binary units, e.g. ``1536 -> '1.50 KiB'``.

    Negative values (differences between two measurements) keep their sign.
    """
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{sign}{value:.2f} {unit}"


def storage_local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank actually holds (local shard for a DTensor)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        # Read the shard directly: to_local() is an autograd op, unwelcome inside a pack hook.
        return local
    if hasattr(t, "to_local"):
        with torch.no_grad():
            return t.to_local()
    return t


def storage_of(t: torch.Tensor) -> tuple[Hashable, int, Any]:
    """Return ``(key, nbytes, storage_or_None)`` for the storage behind ``t``.

    The key identifies the storage so that views and aliases deduplicate.
    """
    t = storage_local(t)  # DTensor: the memory on this rank is the local shard
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        nbytes = storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        # Wrapper subclasses without a real storage: best effort, no dedupe possible.
        return ("id", id(t)), t.numel() * t.element_size(), None
    if ptr == 0:
        # Meta tensors and freed (resize_(0)) storages share address 0; they cannot
        # be told apart by address, so key on the tensor object instead.
        return ("id", id(t)), nbytes, None
    return (t.device, ptr), nbytes, storage


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside nested dicts/lists/tuples (optimizer state layout)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)

