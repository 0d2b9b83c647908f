"""The rank grid is a pure function: check layouts without starting processes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lslm.runtime.grid import AXES, Coords, RankGrid, canonical_axes, resolve_sizes

COMBOS = [c for k in range(1, len(AXES) + 1) for c in itertools.combinations(AXES, k)]
SHAPES = [(1, {}), (2, {"tp": 2}), (2, {"pp": 2}), (2, {"cp": 2}), (4, {"tp": 2, "pp": 2}), (8, {"tp": 2, "pp": 2}),
          (8, {"tp": 4}), (8, {"pp": 4}), (12, {"tp": 2, "pp": 3}), (16, {"tp": 4, "pp": 2}), (6, {"tp": 3}),
          (64, {"tp": 8, "pp": 4}), (8, {"cp": 2, "tp": 2}), (16, {"tp": 2, "cp": 2, "pp": 2}),
          (24, {"tp": 2, "cp": 3, "pp": 2}), (12, {"cp": 3, "dp": 2, "tp": 2}), (8, {"cp": 8})]


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 2), (8, 2, 2), (8, 4, 1),
                                         (8, 1, 4), (12, 2, 3), (16, 4, 2), (6, 3, 1), (64, 8, 4)])
def test_grid_partitions_every_rank_once(world: int, tp: int, pp: int) -> None:
    g = RankGrid.build(world, tp=tp, pp=pp)
    assert g.dp == world // (tp * pp) and g.cp == 1
    for groups, size, count in ((g.tp_groups(), tp, world // tp), (g.dp_groups(), g.dp, world // g.dp),
                                (g.pp_groups(), pp, world // pp)):
        assert len(groups) == count
        assert all(len(grp) == size for grp in groups)
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(world))
    for r in range(world):
        assert g.rank_of(g.coords_of(r)) == r


@pytest.mark.parametrize("world,shape", SHAPES)
def test_rank_formula_and_every_axis_combination_partition_the_world(world: int, shape: dict[str, int]) -> None:
    g = RankGrid.build(world, **shape)
    assert math.prod(g.sizes.values()) == world and list(g.sizes) == list(AXES)
    for r in range(world):
        c = g.coords_of(r)
        assert r == ((c.pp * g.dp + c.dp) * g.cp + c.cp) * g.tp + c.tp  # pp outermost, tp innermost
        assert g.rank_of(**c._asdict()) == g.rank_of(c) == r
    for combo in COMBOS:
        groups = g.groups(*combo)
        size = math.prod(getattr(g, a) for a in combo)
        assert len(groups) == world // size and all(len(grp) == size for grp in groups), combo
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(world)), combo
        for grp in groups:
            assert grp == sorted(grp)
            fixed = [a for a in AXES if a not in combo]
            # members differ only in the combination's axes
            assert len({tuple(getattr(g.coords_of(r), a) for a in fixed) for r in grp}) == 1
            assert all(g.group_of(r, *combo) == grp for r in grp)
    assert g.layout() == np.arange(world).reshape([g.pp, g.dp, g.cp, g.tp]).tolist()


def test_tensor_parallel_is_innermost() -> None:
    g = RankGrid.build(8, tp=2, pp=2)
    assert g.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.coords_of(5) == Coords(pp=1, dp=0, tp=1)
    assert g.pp_prev_rank(5) == 1 and g.pp_next_rank(5) is None
    assert g.pp_prev_rank(1) is None and g.pp_next_rank(1) == 5


def test_context_parallel_sits_between_data_and_tensor() -> None:
    g = RankGrid.build(16, tp=2, cp=2, pp=2)
    assert g.dp == 2 and g.coords_of(13) == Coords(pp=1, dp=1, cp=0, tp=1)
    assert g.cp_groups()[:3] == [[0, 2], [1, 3], [4, 6]]
    assert g.groups("dp", "cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.groups("cp", "dp") == g.groups("dp,cp") == g.groups("dp", "cp")
    assert g.group_of(9, "tp", "pp") == [0, 1, 8, 9] and g.group_of(3, "tp", "pp") == [2, 3, 10, 11]
    # ring neighbours along cp wrap around; pipeline neighbours do not
    assert g.shift(2, "cp", 1, wrap=True) == 0 and g.shift(2, "cp", 1) is None
    assert g.shift(0, "pp", 1) == 8 and g.shift(8, "pp", -1) == 0 and g.shift(8, "pp", 1) is None


def test_pipeline_neighbours_chain_stages() -> None:
    g = RankGrid.build(8, tp=1, pp=4)
    assert g.pp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    chain = [0]
    while (nxt := g.pp_next_rank(chain[-1])) is not None:
        chain.append(nxt)
    assert chain == [0, 2, 4, 6]
    assert [g.pp_prev_rank(r) for r in chain] == [None, 0, 2, 4]


def test_explicit_dp_and_table() -> None:
    g = RankGrid.build(4, tp=1, pp=1, dp=4)
    assert g.dp_groups() == [[0, 1, 2, 3]]
    assert g.table()[3] == {"rank": 3, "pp": 0, "dp": 3, "cp": 0, "tp": 0}
    assert g.group_of(2, "dp") == [0, 1, 2, 3]


@pytest.mark.parametrize("world,tp,pp,dp,needle", [
    (4, 3, 1, None, "tp=3 x pp=1 = 3 does not divide world_size=4"),
    (6, 2, 2, None, "does not divide world_size=6"),
    (8, 2, 2, 3, "tp=2 x pp=2 x dp=3 = 12 but world_size=8"),
    (4, 0, 1, None, "tp must be a positive integer"),
    (0, 1, 1, None, "world_size must be a positive integer"),
])
def test_sizes_that_do_not_divide_name_the_sizes(world: int, tp: int, pp: int, dp: int | None, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        resolve_sizes(world, tp=tp, pp=pp, dp=dp)


@pytest.mark.parametrize("kwargs,needle", [
    ({"tp": True}, "tp must be a positive integer, got True"),
    ({"pp": False}, "pp must be a positive integer, got False"),
    ({"cp": True}, "cp must be a positive integer, got True"),
    ({"dp": True}, "dp must be a positive integer, got True"),
    ({"tp": "2"}, "tp must be a positive integer, got '2'"),
    ({"tp": 2.0}, "tp must be a positive integer, got 2.0"),
    ({"dp": 1.5}, "dp must be a positive integer, got 1.5"),
    ({"cp": -2}, "cp must be a positive integer, got -2"),
    ({"cp": 3}, "tp=1 x cp=3 x pp=1 = 3 does not divide world_size=4"),
    ({"cp": 2, "tp": 2, "dp": 2}, "tp=2 x cp=2 x pp=1 x dp=2 = 8 but world_size=4"),
])
def test_bad_sizes_are_value_errors_bools_included(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        resolve_sizes(4, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        RankGrid.build(4, **kwargs)  # type: ignore[arg-type]


def test_world_size_and_direct_construction_are_validated() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive integer, got True"):
        resolve_sizes(True, tp=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must multiply"):
        RankGrid(world_size=4, tp=2, pp=1, dp=1)
    with pytest.raises(ValueError, match="tp must be a positive integer, got True"):
        RankGrid(world_size=2, tp=True, pp=1, dp=2)  # type: ignore[arg-type]


def test_numpy_integers_are_sizes_and_become_ints() -> None:
    g = RankGrid.build(np.int64(8), tp=np.int64(2), cp=np.int32(2))  # type: ignore[arg-type]
    assert g.dp == 2 and all(type(v) is int for v in g.sizes.values())
    assert resolve_sizes(8, tp=2, cp=2) == {"pp": 1, "dp": 2, "cp": 2, "tp": 2}


def test_coordinates_and_axes_are_checked() -> None:
    g = RankGrid.build(4, tp=2, pp=2)
    for bad in (4, -1, True, 1.0):
        with pytest.raises(ValueError, match="outside"):
            g.coords_of(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tp coordinate 2 is outside"):
        g.rank_of(tp=2)
    with pytest.raises(ValueError, match="cp coordinate 1 is outside"):
        g.rank_of(cp=1)
    with pytest.raises(ValueError, match="unknown axis 'ep'"):
        g.rank_of(ep=0)
    with pytest.raises(ValueError, match="unknown axis 'ep'"):
        g.groups("ep")
    with pytest.raises(ValueError, match="axis named twice"):
        canonical_axes(("dp", "dp"))
    with pytest.raises(ValueError, match="name at least one axis"):
        g.group_of(0)
    assert canonical_axes(("tp", "pp,dp")) == ("pp", "dp", "tp")
    assert g.rank_of(pp=1) == 2 and g.rank_of(Coords(pp=1, tp=1)) == 3
