"""Per-rank samplers for data parallelism: torch's ``DistributedSampler``, or one that follows the serial order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

SAMPLERS = ("baseline", "torch")


class BaselineOrderSampler(DistributedSampler):
    """``DistributedSampler`` whose epoch permutation is the serial baseline's.

    Identical to torch's sampler (same ``drop_last`` cut or padding, same striding:
    rank ``r`` takes positions ``r, r + n, r + 2n, ...`` of the epoch order, same
    ``set_epoch``), except that with ``shuffle=True`` the epoch order is
    ``numpy.random.default_rng([seed, epoch]).permutation(len(dataset))``, the order
    :func:`lslm.data.dataset.batches` uses, instead of ``torch.randperm`` seeded
    with ``seed + epoch``. With a per-rank batch of ``b`` rows, global batch ``i``
    is then the rows ``order[i*n*b:(i+1)*n*b]``, the serial run's batch ``i``.
    """

    def __iter__(self) -> Iterator[int]:
        # Ask torch's sampler, unshuffled, which *positions* this rank takes...
        shuffle, self.shuffle = self.shuffle, False
        try:
            positions = list(super().__iter__())
        finally:
            self.shuffle = shuffle
        n = len(self.dataset)  # type: ignore[arg-type]
        # ...and map them through this epoch's permutation.
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
        return iter(order[positions].tolist())


def make_sampler(dataset: Any, kind: str, *, rank: int, world_size: int, seed: int = 0) -> DistributedSampler:
    """The sampler of ``kind`` (``"baseline"`` or ``"torch"``) for ``rank`` of ``world_size``; drops the tail."""
    if kind not in SAMPLERS:
        raise ValueError(f"unknown sampler {kind!r}; expected one of {SAMPLERS}")
    cls = BaselineOrderSampler if kind == "baseline" else DistributedSampler
    return cls(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
