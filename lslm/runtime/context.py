"""ParallelContext: one explicit object with this rank's place in the grid and its groups.

Passed to every parallel component (no module-level singleton), so two contexts
can coexist in a test and a reader can see exactly which group each collective uses.

Groups. ``ctx.group(*axes)`` is the process group of any axis or combination of
axes: ``ctx.group("dp")`` for plain data parallelism, ``ctx.group("dp", "cp")`` to
reduce gradients when sequences are also split over context parallelism,
``ctx.group("tp", "pp")`` for a global gradient norm. All of them are created in
:meth:`ParallelContext.create`, eagerly, on every rank and in the same order, so
nothing later depends on ranks asking in the same order (creation is collective, and
ranks that create overlapping groups in different orders can deadlock). No group is
created twice: a combination is determined by its axes of size > 1
(``group("tp", "cp")`` *is* ``group("tp")`` when cp = 1), a combination spanning
every rank is ``dist.group.WORLD``, and the combinations of size-1 axes share one
single-rank group. With k axes of size > 1 that is at most 2^k - 1 distinct
partitions of the world, and this rank belongs to one group of each.

How they are created (:func:`create_groups`), cheapest first, each only what torch lets be safe:

* the single-rank group: by this rank alone (``use_local_synchronization=True``), not by
  a world-wide call per rank as before (``world_size`` calls at every start);
* on NCCL with a bound device (``init_distributed`` binds it): one ``split_group`` per
  partition (``ncclCommSplit`` from the world communicator), as torch's ``DeviceMesh`` does;
  ``new_group`` there would do one world-wide split per *group*, and member-only creation
  would hang, since a split needs every rank of the parent;
* otherwise (gloo): ``new_group`` for every group of a partition, called on every rank.
  Only members take part: a non-member's call returns before any store or network access
  (torch 2.13). Member-only creation (``use_local_synchronization=True``) is *not* used:
  its group names are a hash of the ranks and of the number of live groups, so a group
  destroyed by :meth:`ParallelContext.with_grid` and made again gets the same name, and
  gloo's rendezvous then reads the dead group's addresses from the store (measured: the
  first collective times out). torch's sequential names are never reused.

HSDP. A grid with ``dp_shard < dp`` (:mod:`lslm.runtime.grid`) also gets ``ctx.group("dp_shard")`` and
``ctx.group("dp_replicate")``, created after the others (every rank, same order) and named so in the
ledger; without the split they are the dp group and the single-rank one. ``ctx.dp_mesh`` is the 2-D
``DeviceMesh`` ``("dp_replicate", "dp_shard")`` over this rank's dp group, FSDP2's HSDP mesh.

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

from lslm.runtime.grid import AXES, DP_SUB_AXES, Coords, RankGrid, canonical_axes
from lslm.runtime.ledger import Comm

SELF_GROUP_NAME = "self"


def group_plan(grid: RankGrid) -> list[tuple[str, ...]]:
    """The distinct groupings :meth:`ParallelContext.create` makes, in creation order.

    Each entry is a tuple of axes of size > 1 (``()``: every rank alone, made only where
    some axis has size 1). Every combination of axes maps to the entry of its size > 1
    axes. The last entry is the grouping that spans the world (``dist.group.WORLD``, not created).
    """
    big = tuple(a for a in AXES if getattr(grid, a) > 1)
    return [combo for k in range(len(big) + 1) for combo in itertools.combinations(big, k)]


def _bound_device_split() -> bool:
    """True where torch can split groups from the world communicator (NCCL with a bound device)."""
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None and torch.accelerator.is_available()


def create_groups(grid: RankGrid, rank: int, timeout: timedelta | None = None) -> dict[tuple[str, ...], Any]:
    """This rank's group of every partition in :func:`group_plan` (the world one is ``dist.group.WORLD``).

    Collective: every rank calls it at the same point, and every rank walks the same
    partitions in the same order, so two ranks never wait on each other's groups in
    opposite orders. See the module doc for which torch call makes each group and why.
    """
    plan = group_plan(grid)
    mine: dict[tuple[str, ...], Any] = {plan[-1]: dist.group.WORLD}
    split = _bound_device_split()
    for axes in plan[:-1]:
        if not axes:  # every rank alone: a one-member group needs no peer
            if all(getattr(grid, a) > 1 for a in AXES):
                continue  # no combination of axes reduces to "self": nothing would use it
            mine[axes] = dist.new_group([rank], timeout=timeout, use_local_synchronization=True)
        elif split:
            mine[axes] = dist.split_group(split_ranks=grid.groups(*axes), timeout=timeout)
        else:
            for ranks in grid.groups(*axes):
                pg = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[axes] = pg
    if 1 < grid.dp_replicate < grid.dp:  # HSDP's two proper sub-groups of dp (otherwise they are dp or self)
        for sub in ("dp_shard", "dp_replicate"):
            if split:
                mine[(sub,)] = dist.split_group(split_ranks=grid.groups(sub), timeout=timeout)
                continue
            for ranks in grid.groups(sub):
                pg = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[(sub,)] = pg
    return mine


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
    #: The context the last :meth:`with_grid` call built (its groups are destroyed when another replaces it).
    _derived: ParallelContext | None = field(default=None, repr=False)
    _replaced: bool = field(default=False, repr=False)

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
        mine = create_groups(grid, rank, group_timeout)  # the world's entry is recorded as "world" by the Comm
        for axes, pg in mine.items():
            if pg is not dist.group.WORLD:
                comm.name_group(pg, group_name(axes))
        for k in range(1, len(AXES) + 1):
            for combo in itertools.combinations(AXES, k):
                ctx._groups[combo] = mine[tuple(a for a in combo if getattr(grid, a) > 1)]
        # HSDP's sub-axes: their own groups, or (one of them of size 1) the dp group and the single-rank one.
        for sub in DP_SUB_AXES:
            if (sub,) in mine:
                ctx._groups[(sub,)] = mine[(sub,)]
            else:
                whole = (sub == "dp_shard") == (grid.dp_shard == grid.dp)
                key = ctx._groups[("dp",)] if whole else mine.get(())
                if key is not None:  # no single-rank group exists when every axis has size > 1
                    ctx._groups[(sub,)] = key
        ctx.tp_group, ctx.cp_group = ctx._groups[("tp",)], ctx._groups[("cp",)]
        ctx.dp_group, ctx.pp_group = ctx._groups[("dp",)], ctx._groups[("pp",)]
        return ctx

    # -- groups --------------------------------------------------------------------
    def group(self, *axes: str) -> Any:
        """The process group of this rank over ``axes`` (any order; ``"dp,cp"`` strings accepted)."""
        if self._replaced:
            raise RuntimeError("this ParallelContext was replaced by a later with_grid() call on the context it came "
                               "from, and its groups were destroyed: use the context that call returned")
        if not self._groups:
            raise RuntimeError("this ParallelContext has no groups: build it with ParallelContext.create()")
        if len(axes) == 1 and axes[0] in DP_SUB_AXES:
            if (axes[0],) not in self._groups:
                raise ValueError(f"{axes[0]} has size 1 on this grid and every axis has size > 1, so no single-rank "
                                 "group was made: a size-1 group is never needed for communication")
            return self._groups[(axes[0],)]
        return self._groups[canonical_axes(axes)]

    def group_ranks(self, *axes: str) -> list[int]:
        """Global ranks of :meth:`group` ``(*axes)``, ascending (pure: from the grid; ``"dp_shard"`` too)."""
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

    @property
    def dp_mesh(self) -> Any:
        """A 2-D ``DeviceMesh`` ``("dp_replicate", "dp_shard")`` over this rank's dp group (HSDP's mesh, for
        ``fully_shard(model, mesh=ctx.dp_mesh)``); built from this context's groups, not collective."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks = self.group_ranks("dp")
        s = self.grid.dp_shard
        layout = [ranks[r * s:(r + 1) * s] for r in range(self.grid.dp_replicate)]
        return DeviceMesh.from_group([self.group("dp_replicate"), self.group("dp_shard")], self.device.type,
                                     mesh=layout, mesh_dim_names=DP_SUB_AXES)

    @property
    def dp_shard_size(self) -> int:
        """HSDP: ranks the model states are sharded over (``dp`` without HSDP)."""
        assert self.grid.dp_shard is not None
        return self.grid.dp_shard

    @property
    def dp_replicate_size(self) -> int:
        """HSDP: replicas of the sharded states (1 without HSDP)."""
        return self.grid.dp_replicate

    @property
    def dp_shard_rank(self) -> int:
        """Rank within the dp_shard group."""
        return self.grid.dp_coords(self.rank)["dp_shard"]

    @property
    def dp_replicate_rank(self) -> int:
        """Rank within the dp_replicate group."""
        return self.grid.dp_coords(self.rank)["dp_replicate"]

    def with_grid(self, **sizes: Any) -> ParallelContext:
        """A context over the same processes with another grid (``tp=2``, ``pp=2, dp=None``), sharing this ledger.

        ``self`` when the grid is already that one, and the context the previous call returned
        when it asked for the same grid. Otherwise the new grid's groups are created now, inside
        the existing process group, so every rank must call this at the same time (group
        creation is collective). The context a previous call returned is replaced: after a
        barrier (no rank may still be talking in them) its groups are destroyed, since NCCL
        communicators would otherwise pile up, one set per run; using it afterwards raises.
        Recipes use it to run with their own grid in a job launched with another (several runs
        in one launch). ``self``'s own groups are never touched.
        """
        grid = RankGrid.build(self.world_size, **sizes)
        if self.grid == grid:
            return self
        if self._derived is not None:
            if self._derived.grid == grid:
                return self._derived
            self._derived.release_groups()
            self._derived = None
        self._derived = ParallelContext.create(grid, rank=self.rank, local_rank=self.local_rank,
                                               node_rank=self.node_rank, device=self.device, backend=self.backend,
                                               timeout_s=self.timeout_s, comm=self.comm)
        return self._derived

    def release_groups(self) -> None:
        """Destroy this context's own process groups (never the world); collective, after a world barrier.

        Every rank calls it at the same point. The context cannot be used for communication
        afterwards (:meth:`group` raises). :meth:`with_grid` calls it on the context it replaces.
        """
        if self._derived is not None:
            self._derived.release_groups()
            self._derived = None
        dist.barrier()  # a fast rank must not destroy a group that a slow one still talks in
        seen: set[int] = set()
        for pg in self._groups.values():
            if pg is not dist.group.WORLD and id(pg) not in seen:
                seen.add(id(pg))
                self.comm.forget_group(pg)
                dist.destroy_process_group(pg)
        self._groups.clear()
        self._mesh = None
        self.tp_group = self.dp_group = self.pp_group = self.cp_group = None
        self._replaced = True

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
                **self.coords._asdict(), **{f"{a}_size": getattr(self.grid, a) for a in ("tp", "cp", "dp", "pp")},
                **({**self.grid.dp_coords(self.rank), "dp_shard_size": self.dp_shard_size}
                   if self.grid.hsdp else {})}

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
