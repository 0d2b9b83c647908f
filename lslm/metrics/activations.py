"""Activation bytes: what autograd saves for backward, counted through saved-tensor hooks."""

from __future__ import annotations

from collections.abc import Hashable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lslm.metrics.storage import StorageWeakRef, format_bytes, storage_local, storage_of


class ActivationMemory:
    """Context manager counting bytes that autograd saves for backward.

    Usage::

        with ActivationMemory(model) as act:
            loss = model(x).sum()
        loss.backward()
        act.bytes, act.num_tensors

    Attributes: ``bytes`` (sum of unique saved storages, full storage size),
    ``bytes_by_device`` (the same split by device, e.g. ``{"cpu": ...}``),
    ``num_tensors`` (saved tensors counted, including repeats of one storage),
    ``num_storages`` (unique storages). When ``model`` is given, storages of
    its parameters and buffers are excluded: they are model states, not
    activations (``nn.Linear`` saves its weight). They are snapshotted on
    entry, so parameters re-materialised during the forward (ZeRO-3 gathers)
    would count as activations.

    The pack hook returns the tensor unchanged, so backward and gradients are
    exactly as without the hook. ``checkpoint(use_reentrant=False)`` installs
    its own inner hooks: only what it keeps (each region's inputs) reaches this
    counter. Everything saved inside the block is summed, so two
    forward/backward passes give twice the bytes of one; a storage freed and its
    address reused counts again.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        """Prepare a counter; ``model``'s parameters and buffers are not counted."""
        self.model = model
        self.bytes = 0
        self.bytes_by_device: dict[str, int] = {}
        self.num_tensors = 0
        self.num_storages = 0
        self._seen: dict[Hashable, Any] = {}
        self._excluded: set[Hashable] = set()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> ActivationMemory:
        if self._hooks is not None:
            raise RuntimeError("ActivationMemory is already active; use a new instance to nest")
        self.bytes = self.num_tensors = self.num_storages = 0
        self.bytes_by_device = {}
        self._seen = {}
        self._excluded = set()
        if self.model is not None:
            for t in (*self.model.parameters(), *self.model.buffers()):
                self._excluded.add(storage_of(t)[0])
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key, nbytes, storage = storage_of(t)
        if key in self._excluded:
            return t
        self.num_tensors += 1
        if key in self._seen:
            ref = self._seen[key]
            # Same address and the earlier storage still alive: the same memory.
            if ref is None or not ref.expired():
                return t
        self._seen[key] = (
            StorageWeakRef(storage) if storage is not None and StorageWeakRef is not None else None
        )
        self.bytes += nbytes
        device = str(storage_local(t).device)
        self.bytes_by_device[device] = self.bytes_by_device.get(device, 0) + nbytes
        self.num_storages += 1
        return t  # returned as is, so autograd gets the very tensor it saved

    def __repr__(self) -> str:
        return (
            f"ActivationMemory(bytes={self.bytes} ({format_bytes(self.bytes)}), "
            f"num_tensors={self.num_tensors}, num_storages={self.num_storages})"
        )


def _unpack(t: torch.Tensor) -> torch.Tensor:
    """Unpack hook: the pack hook stored the tensor itself."""
    return t

