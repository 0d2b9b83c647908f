"""ParallelContext groups and mesh; the ledger on real processes (its unit tests: tests/test_ledger.py).

Most checks run in torch's fake process group (milliseconds, any rank of any world
size in this process). Real processes run twice per backend: one 4-rank launch checks
several grid shapes (every axis combination's members as the processes see them, mesh
coordinates) and the exact ledger volumes, axes and times; one 2-rank launch checks
the ledger at n = 2.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lslm.runtime import AXES, ParallelContext, RankGrid
from lslm.runtime.context import group_plan
from tests.helpers import backends, fake_world, run_workers

COMBOS = [c for k in range(1, len(AXES) + 1) for c in itertools.combinations(AXES, k)]
SHAPES_4 = [{"tp": 2, "pp": 2}, {"pp": 4}, {"tp": 4}, {"dp": 2, "cp": 2}, {"cp": 2, "tp": 2}]
SHAPES_FAKE = [{}, {"tp": 2}, {"tp": 2, "pp": 2, "cp": 2}, {"dp": 2, "cp": 2, "tp": 2}, {"pp": 2, "cp": 4},
               {"dp": 8}]


def _ctx(grid: RankGrid, rank: int) -> ParallelContext:
    return ParallelContext.create(grid, rank=rank, local_rank=rank, node_rank=0, device=torch.device("cpu"),
                                  backend="fake", timeout_s=5)


# -- groups and mesh in the fake process group ----------------------------------------------
@pytest.mark.parametrize("shape", SHAPES_FAKE, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()) or "dp")
def test_every_axis_combination_has_the_grid_members_and_mesh_coordinates(shape: dict[str, int]) -> None:
    world = 8
    grid = RankGrid.build(world, **shape)
    for rank in range(world):
        with fake_world(rank, world):
            ctx = _ctx(grid, rank)
            for combo in COMBOS:
                pg = ctx.group(*combo)
                assert dist.get_process_group_ranks(pg) == grid.group_of(rank, *combo) == ctx.group_ranks(*combo)
                # Order and spelling do not matter; a combination spanning the world is WORLD itself.
                assert ctx.group(*reversed(combo)) is pg and ctx.group(",".join(combo)) is pg
                big = [a for a in combo if getattr(grid, a) > 1]
                assert (pg is dist.group.WORLD) == (grid.groups(*combo) == [list(range(world))])
                if pg is not dist.group.WORLD:
                    assert ctx.comm.group_name(pg) == (",".join(big) or "self")
            assert (ctx.pp_group, ctx.dp_group, ctx.cp_group, ctx.tp_group) == tuple(ctx.group(a) for a in AXES)
            mesh = ctx.mesh
            assert mesh is ctx.mesh and mesh.mesh_dim_names == AXES
            assert tuple(mesh.get_coordinate()) == tuple(ctx.coords)
            assert mesh.mesh.tolist() == grid.layout() and tuple(mesh.shape) == tuple(grid.sizes.values())
            for axis in AXES:
                assert dist.get_process_group_ranks(mesh.get_group(axis)) == grid.group_of(rank, axis)


def _spy_creation(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], bool]]:
    """Record every ``dist.new_group`` call as ``(ranks, member-only)``."""
    made: list[tuple[tuple[int, ...], bool]] = []
    real = dist.new_group

    def spy(ranks: list[int], **kwargs: Any) -> Any:
        made.append((tuple(ranks), bool(kwargs.get("use_local_synchronization"))))
        return real(ranks, **kwargs)

    monkeypatch.setattr(dist, "new_group", spy)
    return made


def test_groups_are_created_once_in_a_fixed_order(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _spy_creation(monkeypatch)
    for shape, expected in (({"tp": 2, "pp": 2}, 2 + 2), ({"dp": 4}, 0), ({"tp": 4}, 0),
                            ({"dp": 2, "cp": 2}, 2 + 2)):
        grid = RankGrid.build(4, **shape)
        orders = []
        for rank in range(4):
            made.clear()
            with fake_world(rank, 4):
                _ctx(grid, rank)
            # this rank's single-rank group, made by this rank alone and first; no other rank's
            assert made[0] == ((rank,), True) and all(len(r) > 1 and not local for r, local in made[1:])
            orders.append(made[1:])
        # then every group of each grouping of the size > 1 axes, the same calls in the same order
        # on every rank (torch's sequential names stay in step); never the world, never twice
        assert all(o == orders[0] for o in orders) and len(orders[0]) == expected
        assert len(set(orders[0])) == expected and (tuple(range(4)), False) not in orders[0]
    assert group_plan(RankGrid.build(16, tp=2, cp=2, dp=2, pp=2))[-1] == AXES
    assert len(group_plan(RankGrid.build(16, tp=2, cp=2, dp=2, pp=2))) == 16  # 2^4 groupings, () included


@pytest.mark.parametrize(("world", "shape", "world_wide", "member_only"), [
    # Before this count (issue 19): 26 world-wide calls at dp=2, tp=2, pp=2 (8 single-rank groups + 18),
    # 764 at 512 ranks with tp=8, pp=4, dp=16 (512 + 252), 512 for plain dp=512, 1214 for tp8 cp2 pp4 dp8.
    (8, {"dp": 2, "tp": 2, "pp": 2}, 18, 1),
    (512, {"tp": 8, "pp": 4, "dp": 16}, 252, 1),
    (512, {"dp": 512}, 0, 1),
    (512, {"tp": 8, "cp": 2, "pp": 4, "dp": 8}, 702, 0),  # no size-1 axis: no single-rank group at all
])
def test_group_creation_calls_per_rank(monkeypatch: pytest.MonkeyPatch, world: int, shape: dict[str, int],
                                       world_wide: int, member_only: int) -> None:
    made = _spy_creation(monkeypatch)
    grid = RankGrid.build(world, **shape)
    rank = world - 3
    with fake_world(rank, world):
        ctx = _ctx(grid, rank)
        assert sum(not local for _, local in made) == world_wide
        assert sum(local for _, local in made) == member_only
        # this rank joins one group per grouping that is not the world
        joined = {id(ctx.group(*c)) for c in COMBOS if ctx.group(*c) is not dist.group.WORLD}
        assert len(joined) == len(group_plan(grid)) - 1 - (member_only == 0)


def test_with_grid_destroys_the_groups_of_the_context_it_replaces(monkeypatch: pytest.MonkeyPatch) -> None:
    destroyed: list[Any] = []
    real = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: (destroyed.append(group), real(group)))
    world, rank = 8, 5
    with fake_world(rank, world):
        ctx = _ctx(RankGrid.build(world), rank)
        own = {id(ctx.group(*c)) for c in COMBOS}
        tp = ctx.with_grid(tp=2)
        assert ctx.with_grid(tp=2) is tp and destroyed == []  # the same grid again: the same groups
        tp_groups = {id(tp.group(*c)): tp.group(*c) for c in COMBOS if tp.group(*c) is not dist.group.WORLD}
        pp = ctx.with_grid(pp=2, tp=2)
        assert {id(g) for g in destroyed} == set(tp_groups) and len(destroyed) == len(tp_groups) == 3
        assert not own & {id(g) for g in destroyed}  # the parent's groups live on
        assert all(ctx.comm.group_name(g) == "" for g in tp_groups.values())  # the ledger let them go
        with pytest.raises(RuntimeError, match="replaced by a later with_grid"):
            tp.group("tp")
        assert dist.get_process_group_ranks(pp.group("pp", "tp")) == pp.grid.group_of(rank, "pp", "tp")
        assert ctx.with_grid() is ctx and ctx.group("dp") is dist.group.WORLD


def test_a_one_rank_world_is_its_own_group_everywhere() -> None:
    with fake_world(0, 1):
        ctx = _ctx(RankGrid.build(1), 0)
        assert all(ctx.group(*c) is dist.group.WORLD for c in COMBOS)
        assert ctx.comm.group_name(ctx.tp_group) == "world" and tuple(ctx.mesh.get_coordinate()) == (0, 0, 0, 0)
        assert ctx.describe()["cp_size"] == 1 and ctx.cp_rank == 0


def test_init_distributed_takes_cp_and_validates_it_before_joining() -> None:
    from lslm.runtime import init_distributed

    with pytest.raises(ValueError, match=r"tp=1 x cp=2 x pp=1 = 2 does not divide world_size=1"):
        init_distributed(cp=2)  # outside torchrun: a one-process world
    with pytest.raises(ValueError, match="cp must be a positive integer, got True"):
        init_distributed(cp=True)  # type: ignore[arg-type]
    assert not dist.is_initialized()


def test_group_rejects_unknown_axes() -> None:
    with fake_world(0, 2):
        ctx = _ctx(RankGrid.build(2, tp=2), 0)
        for bad in (("ep",), ("tp", "tp"), ()):
            with pytest.raises(ValueError):
                ctx.group(*bad)


# -- real processes: one 4-rank launch (several shapes), one 2-rank launch -------------------
@pytest.fixture(scope="module", params=backends(4))
def four_ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """One 4-rank launch per backend: ledger volumes on the default grid, groups and mesh for SHAPES_4."""
    return run_workers("tests.context_workers:context_checks", 4, backend=request.param, numel=1000, shapes=SHAPES_4)


@pytest.mark.parametrize("i", range(len(SHAPES_4)), ids=[str(s) for s in SHAPES_4])
def test_groups_and_mesh_on_four_processes_match_the_grid(four_ranks: list[dict[str, Any]], i: int) -> None:
    grid = RankGrid.build(4, **SHAPES_4[i])
    for rank, res in enumerate(four_ranks):
        r = res["shapes"][i]
        assert r["rank"] == rank and [r[a] for a in AXES] == list(grid.coords_of(rank))
        assert r["pp_prev"] == grid.pp_prev_rank(rank) and r["pp_next"] == grid.pp_next_rank(rank)
        for combo in COMBOS:
            assert r["members"][",".join(combo)] == grid.group_of(rank, *combo), combo
        for combo in COMBOS:
            spans_world = len(grid.group_of(rank, *combo)) == 4
            name = ",".join(a for a in combo if getattr(grid, a) > 1) or "self"
            assert r["names"][",".join(combo)] == ("world" if spans_world else name), combo
        assert r["mesh_coords"] == [r[a] for a in AXES] and r["mesh_dims"] == list(AXES)
        assert r["mesh_shape"] == [getattr(grid, a) for a in AXES]
        assert r["mesh_groups"] == {a: grid.group_of(rank, a) for a in AXES}


CYCLE = [{"tp": 2}, {"pp": 2}, {"tp": 2}, {"tp": 2, "pp": 2}, {"pp": 2}]


def test_with_grid_destroys_and_remakes_groups_on_four_processes() -> None:
    # Groups destroyed by with_grid and made again (the same ranks, a grid seen before) still
    # connect: member-only creation would reuse the dead group's name and time out here.
    res = run_workers("tests.context_workers:with_grid_cycle", 4, grids=CYCLE, timeout=120)
    for r in res:
        for sizes, members in zip(CYCLE, r["members"]):
            grid = RankGrid.build(4, **sizes)
            assert members == {",".join(c): grid.group_of(r["rank"], *c) for c in COMBOS}


@pytest.fixture(scope="module", params=backends(2))
def two_ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """One 2-rank launch per backend: ledger volumes only."""
    return run_workers("tests.context_workers:context_checks", 2, backend=request.param, numel=1000)


def test_ledger_records_exact_bytes_axes_and_times_on_two_processes(two_ranks: list[dict[str, Any]]) -> None:
    _check_ledger(two_ranks, 2)


def test_ledger_records_exact_bytes_axes_and_times_on_four_processes(four_ranks: list[dict[str, Any]]) -> None:
    _check_ledger(four_ranks, 4)


def _check_ledger(res: list[dict[str, Any]], n: int) -> None:
    numel = 1000
    b = numel * 4  # fp32
    for rank, r in enumerate(res):
        assert all(r["ok"].values()), r["ok"]
        s = r["summary"]
        assert s["all_reduce"] == {"calls": 2, "bytes": 2 * b, "bus_bytes": pytest.approx(2 * 2 * (n - 1) / n * b)}
        assert s["broadcast"] == {"calls": 1, "bytes": b, "bus_bytes": b}
        assert s["all_gather"] == {"calls": 1, "bytes": n * b, "bus_bytes": pytest.approx((n - 1) * b)}
        assert s["reduce_scatter"] == {"calls": 1, "bytes": n * b, "bus_bytes": pytest.approx((n - 1) * b)}
        assert s["all_to_all"] == {"calls": 1, "bytes": n * b, "bus_bytes": pytest.approx((n - 1) * b)}
        assert s["send"]["bytes"] == b and s["recv"]["bytes"] == b
        # the final barrier of ctx.destroy() is not recorded (it happens after the summary)
        recs = r["records"]
        sends = [rec for rec in recs if rec["op"] == "send"]
        recvs = [rec for rec in recs if rec["op"] == "recv"]
        assert sends[0]["peer"] == (rank + 1) % n and recvs[0]["peer"] == (rank - 1) % n
        assert all(rec["group_size"] == n for rec in recs if rec["op"] not in ("send", "recv"))
        # group=None is "world", and so is the default grid's dp group: it spans the world
        assert [rec["axis"] for rec in recs] == ["world"] * 8
        assert [rec["label"] for rec in recs][-3:] == ["ring", "ring", "async"]
        assert all(rec["completion_s"] is not None and rec["issue_s"] <= rec["completion_s"] for rec in recs)
        blocking = recs[:5]  # one call after the other: each ends before the next is issued
        assert all(a["completion_s"] <= c["issue_s"] for a, c in zip(blocking, blocking[1:]))


def test_with_grid_reuses_the_context_or_builds_the_new_grid_sharing_the_ledger() -> None:
    """A recipe's own grid inside a job launched with another: same ranks, same ledger, the new groups."""
    world, rank = 4, 3
    with fake_world(rank, world):
        ctx = _ctx(RankGrid.build(world), rank)  # every rank data-parallel
        assert ctx.with_grid(dp=4) is ctx
        pp = ctx.with_grid(pp=2, dp=None)
        assert pp is not ctx and pp.comm is ctx.comm and pp.rank == rank
        assert (pp.pp_size, pp.dp_size, pp.pp_rank) == (2, 2, 1)
        assert dist.get_process_group_ranks(pp.pp_group) == pp.grid.group_of(rank, "pp")
        with pytest.raises(ValueError):
            ctx.with_grid(tp=3)
