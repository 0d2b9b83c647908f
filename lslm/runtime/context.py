"""ParallelContext: one explicit object with this rank's place in the grid and its groups.

Passed to every parallel component (no module-level singleton), so two contexts
can coexist in a test and a reader can see exactly which group each collective uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lslm.runtime.grid import Coords, RankGrid
from lslm.runtime.ledger import Comm


@dataclass
class ParallelContext:
    """This rank's coordinates, device, backend, process groups and comm ledger.

    Groups: ``tp_group`` (tensor parallel, consecutive ranks), ``dp_group`` (data
    parallel), ``pp_group`` (pipeline, ordered first stage to last) and
    ``world_group``. All communication should go through ``comm`` so the ledger
    sees it.
    """

    grid: RankGrid
    rank: int
    local_rank: int
    node_rank: int
    device: torch.device
    backend: str
    tp_group: Any = None
    dp_group: Any = None
    pp_group: Any = None
    world_group: Any = None
    comm: Comm = field(default_factory=Comm)
    timeout_s: float | None = None

    @classmethod
    def create(cls, grid: RankGrid, rank: int, local_rank: int, node_rank: int, device: torch.device,
               backend: str, timeout_s: float | None = None) -> ParallelContext:
        """Create every tp, dp and pp group (collectively: all ranks, same order) and keep ours.

        ``timeout_s`` is passed to every subgroup explicitly, so a hang inside a tp,
        dp or pp group ends within the same finite timeout as the world group
        whatever torch's defaulting rule for ``new_group`` is in a given release.
        """
        ctx = cls(grid=grid, rank=rank, local_rank=local_rank, node_rank=node_rank, device=device, backend=backend,
                  world_group=dist.group.WORLD, timeout_s=timeout_s)
        group_timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        # new_group is collective over the whole world: every rank must create every
        # group, in the same order, even the ones it is not in.
        for kind, groups in (("tp", grid.tp_groups()), ("dp", grid.dp_groups()), ("pp", grid.pp_groups())):
            for ranks in groups:
                pg = dist.new_group(ranks, timeout=group_timeout)
                if rank in ranks:
                    setattr(ctx, f"{kind}_group", pg)
        return ctx

    # -- coordinates -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.grid.world_size

    @property
    def coords(self) -> Coords:
        """``(pp, dp, tp)`` coordinates of this rank."""
        return self.grid.coords_of(self.rank)

    @property
    def tp_rank(self) -> int:
        """Rank within the tensor-parallel group."""
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        """Rank within the data-parallel group."""
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.coords.pp

    @property
    def tp_size(self) -> int:
        """Tensor-parallel degree."""
        return self.grid.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree."""
        return self.grid.dp

    @property
    def pp_size(self) -> int:
        """Number of pipeline stages."""
        return self.grid.pp

    @property
    def pp_prev_rank(self) -> int | None:
        """Global rank of the previous stage (None on the first)."""
        return self.grid.pp_prev_rank(self.rank)

    @property
    def pp_next_rank(self) -> int | None:
        """Global rank of the next stage (None on the last)."""
        return self.grid.pp_next_rank(self.rank)

    @property
    def is_first_stage(self) -> bool:
        """True on pipeline stage 0."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage."""
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary of this rank's place (for results and printing)."""
        return {"rank": self.rank, "local_rank": self.local_rank, "node_rank": self.node_rank,
                "world_size": self.world_size, "device": str(self.device), "backend": self.backend,
                **self.coords._asdict(), "tp_size": self.tp_size, "dp_size": self.dp_size, "pp_size": self.pp_size}

    # -- lifetime ----------------------------------------------------------------
    def barrier(self) -> None:
        """Barrier over the whole world (recorded in the ledger)."""
        self.comm.barrier()

    def destroy(self) -> None:
        """Barrier, then tear the process group down.

        The barrier matters: without it a fast rank can destroy its group while a
        slow one still talks to it (DTensor users then see aborts at exit).
        """
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.destroy()
        elif dist.is_initialized():
            # A failing rank must not wait in a barrier its peers may never reach.
            dist.destroy_process_group()
