"""This process as one rank of a larger world on PyTorch's "fake" process-group backend (no data moves).

Sharding, buffers and the ledger's records are real; every collective returns at once without peers. The
calculator's cross-checks, ZeRO's bytes at 64 ranks, the tensor-parallel time model's compute and the
ledger's per-call cost all run this way in one process. The backend's store lives in torch's internal testing
package (``torch.testing._internal``: it may change without notice), so this is the one place that imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["fake_world"]


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Join a fake ``world_size``-rank process group as ``rank``; destroy it on exit.

    Raises ``RuntimeError`` if a process group is already up in this process.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():  # the code inside may have torn it down itself (exit_process)
            dist.destroy_process_group()
