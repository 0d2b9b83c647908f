"""ParallelContext: one explicit object with this rank's place in the grid and its groups.

Passed to every parallel component (no module-level singleton), so two contexts
can coexist in a test and a reader can see exactly which group each collective uses.

Groups. ``ctx.group(*axes)`` is the process group of any axis or combination of
axes: ``ctx.group("dp")`` for plain data parallelism, ``ctx.group("dp", "cp")`` to
reduce gradients when sequences are also split over context parallelism,
``ctx.group("tp", "pp")`` for a global gradient norm. All of them are created in
:meth:`ParallelContext.create`, eagerly, on every rank and in the same order
(``new_group`` is collective over the whole world), so nothing later depends on
ranks asking in the same order. No group is created twice: a combination is
determined by its axes of size > 1 (``group("tp", "cp")`` *is* ``group("tp")``
when cp = 1), a combination spanning every rank is ``dist.group.WORLD``, and the
combinations of size-1 axes share one single-rank group. With k axes of size > 1
that is at most 2^k - 1 distinct partitions of the world.

``ctx.mesh`` is a torch ``DeviceMesh`` with dims ``("pp", "dp", "cp", "tp")`` over
the same ranks (size-1 dims included, so ``ctx.mesh["dp"]`` always exists), for
DTensor / FSDP2 / pipelining side-by-sides. It is built on first access from the
groups above (``DeviceMesh.from_group``), which is *not* collective: a rank may
touch it or not. (Flattening mesh dims later, ``mesh["dp", "cp"]._flatten()``, does
create groups collectively; that is torch's API and its rule.)

Ledger names. Every group is registered with ``ctx.comm`` under the axes along
which its members differ ("dp", "dp,cp", "pp,tp"; "self" for the single-rank group),
so ledger records say which axis each byte travelled on. A combination that spans
every rank is the world group and is recorded as "world" (in a pure data-parallel
run, ``ctx.dp_group`` is the world: select ``axis="world"`` there, or by label).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lslm.runtime.grid import AXES, Coords, RankGrid, canonical_axes
from lslm.runtime.ledger import Comm

SELF_GROUP_NAME = "self"


def group_plan(grid: RankGrid) -> list[tuple[str, ...]]:
    """The distinct groupings :meth:`ParallelContext.create` makes, in creation order.

    Each entry is a tuple of axes of size > 1 (``()``: every rank alone). Every
    combination of axes maps to the entry of its size > 1 axes. The last entry is
    the grouping that spans the world (``dist.group.WORLD``, not created).
    """
    big = tuple(a for a in AXES if getattr(grid, a) > 1)
    return [combo for k in range(len(big) + 1) for combo in itertools.combinations(big, k)]


def group_name(axes: tuple[str, ...]) -> str:
    """The ledger name of the group over ``axes`` of size > 1 (``"dp,cp"``; ``"self"`` for none)."""
    return ",".join(axes) if axes else SELF_GROUP_NAME


@dataclass
class ParallelContext:
    """This rank's coordinates, device, backend, process groups and comm ledger.

    Groups: ``ctx.group(*axes)`` for any combination (see the module doc), and the
    shortcuts ``tp_group`` (tensor parallel, consecutive ranks), ``cp_group``
    (context parallel), ``dp_group`` (data parallel), ``pp_group`` (pipeline,
    ordered first stage to last) and ``world_group``. All communication should go
    through ``comm`` so the ledger sees it.
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
    cp_group: Any = None
    world_group: Any = None
    comm: Comm = field(default_factory=Comm)
    timeout_s: float | None = None
    #: Model-parallel RNG streams (a :class:`lslm.tensor_parallel.random.RNGStatesTracker`), set by
    #: :func:`lslm.tensor_parallel.random.model_parallel_seed`; ``None`` until a technique needs them.
    rng: Any = None
    _groups: dict[tuple[str, ...], Any] = field(default_factory=dict, repr=False)
    _mesh: Any = field(default=None, repr=False)

    @classmethod
    def create(cls, grid: RankGrid, rank: int, local_rank: int, node_rank: int, device: torch.device,
               backend: str, timeout_s: float | None = None, comm: Comm | None = None) -> ParallelContext:
        """Create every group of every axis combination (collectively: all ranks, same order); keep ours.

        ``timeout_s`` is passed to every subgroup explicitly, so a hang inside any
        group ends within the same finite timeout as the world group whatever torch's
        defaulting rule for ``new_group`` is in a given release. ``comm`` (default: a
        new one on ``device``) gets every group's ledger name.
        """
        comm = comm if comm is not None else Comm(device=device)
        if comm.device is None:
            comm.device = device
        ctx = cls(grid=grid, rank=rank, local_rank=local_rank, node_rank=node_rank, device=device, backend=backend,
                  world_group=dist.group.WORLD, timeout_s=timeout_s, comm=comm)
        group_timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        plan = group_plan(grid)
        mine: dict[tuple[str, ...], Any] = {}
        for axes in plan[:-1]:
            # new_group is collective over the whole world: every rank creates every
            # group of this grouping, in the same order, even the ones it is not in.
            members = grid.groups(*axes) if axes else [[r] for r in range(grid.world_size)]
            for ranks in members:
                pg = dist.new_group(ranks, timeout=group_timeout)
                if rank in ranks:
                    mine[axes] = pg
        mine[plan[-1]] = dist.group.WORLD  # recorded as "world" by the Comm
        for axes, pg in mine.items():
            if pg is not dist.group.WORLD:
                comm.name_group(pg, group_name(axes))
        for k in range(1, len(AXES) + 1):
            for combo in itertools.combinations(AXES, k):
                ctx._groups[combo] = mine[tuple(a for a in combo if getattr(grid, a) > 1)]
        ctx.tp_group, ctx.cp_group = ctx._groups[("tp",)], ctx._groups[("cp",)]
        ctx.dp_group, ctx.pp_group = ctx._groups[("dp",)], ctx._groups[("pp",)]
        return ctx

    # -- groups --------------------------------------------------------------------
    def group(self, *axes: str) -> Any:
        """The process group of this rank over ``axes`` (any order; ``"dp,cp"`` strings accepted)."""
        if not self._groups:
            raise RuntimeError("this ParallelContext has no groups: build it with ParallelContext.create()")
        return self._groups[canonical_axes(axes)]

    def group_ranks(self, *axes: str) -> list[int]:
        """Global ranks of :meth:`group` ``(*axes)``, ascending (pure: from the grid)."""
        return self.grid.group_of(self.rank, *axes)

    @property
    def mesh(self) -> Any:
        """A ``DeviceMesh`` with dims ``("pp", "dp", "cp", "tp")`` over this grid (built on first access).

        Built with ``DeviceMesh.from_group`` from this context's groups, so it is not
        collective and creates no process group; ``mesh.get_coordinate()`` equals
        ``ctx.coords``.
        """
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group([self.group(a) for a in AXES], self.device.type,
                                               mesh=self.grid.layout(), mesh_dim_names=AXES)
        return self._mesh

    def with_grid(self, **sizes: Any) -> ParallelContext:
        """A context over the same processes with another grid (``tp=2``, ``pp=2, dp=None``), sharing this ledger.

        ``self`` when the grid is already that one; otherwise the new grid's groups are created
        now, inside the existing process group, so every rank must call this at the same time
        (``new_group`` is collective). Recipes use it to run with their own grid in a job launched
        with another (several runs in one launch).
        """
        grid = RankGrid.build(self.world_size, **sizes)
        if self.grid.sizes == grid.sizes:
            return self
        return ParallelContext.create(grid, rank=self.rank, local_rank=self.local_rank, node_rank=self.node_rank,
                                      device=self.device, backend=self.backend, timeout_s=self.timeout_s,
                                      comm=self.comm)

    # -- coordinates -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.grid.world_size

    @property
    def coords(self) -> Coords:
        """``(pp, dp, cp, tp)`` coordinates of this rank."""
        return self.grid.coords_of(self.rank)

    @property
    def tp_rank(self) -> int:
        """Rank within the tensor-parallel group."""
        return self.coords.tp

    @property
    def cp_rank(self) -> int:
        """Rank within the context-parallel group."""
        return self.coords.cp

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
    def cp_size(self) -> int:
        """Context-parallel degree."""
        return self.grid.cp

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
                **self.coords._asdict(), **{f"{a}_size": getattr(self.grid, a) for a in ("tp", "cp", "dp", "pp")}}

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
