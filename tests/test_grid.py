"""The rank grid is a pure function: check layouts without starting processes."""

from __future__ import annotations

import itertools

import pytest

from lslm.runtime.grid import Coords, RankGrid, resolve_sizes


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 2), (8, 2, 2), (8, 4, 1),
                                         (8, 1, 4), (12, 2, 3), (16, 4, 2), (6, 3, 1), (64, 8, 4)])
def test_grid_partitions_every_rank_once(world: int, tp: int, pp: int) -> None:
    g = RankGrid.build(world, tp=tp, pp=pp)
    assert g.dp == world // (tp * pp)
    for groups, size, count in ((g.tp_groups(), tp, world // tp), (g.dp_groups(), g.dp, world // g.dp),
                                (g.pp_groups(), pp, world // pp)):
        assert len(groups) == count
        assert all(len(grp) == size for grp in groups)
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(world))
    for r in range(world):
        assert g.rank_of(g.coords_of(r)) == r


def test_tensor_parallel_is_innermost() -> None:
    g = RankGrid.build(8, tp=2, pp=2)
    assert g.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.coords_of(5) == Coords(pp=1, dp=0, tp=1)
    assert g.pp_prev_rank(5) == 1 and g.pp_next_rank(5) is None
    assert g.pp_prev_rank(1) is None and g.pp_next_rank(1) == 5


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
    assert g.table()[3] == {"rank": 3, "pp": 0, "dp": 3, "tp": 0}
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


def test_coords_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside"):
        RankGrid.build(4).coords_of(4)
