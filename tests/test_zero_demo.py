"""Notebook 08's in-process counts: lslm.demos.zero_demo.state_bytes_at_scale on the fake process group."""

from __future__ import annotations

import pytest

from lslm.demos.zero_demo import fake_world, state_bytes_at_scale


def test_bytes_at_eight_fake_ranks_are_the_formula_with_padding() -> None:
    for row in state_bytes_at_scale(worlds=(8,), stages=(1, 2, 3)):
        n, stage, numel, owned = row["world"], row["stage"], row["numel"], row["owned"]
        assert 0 < numel - row["psi"] < n * row["buckets"]  # width 60: the buckets need padding at 8 ranks
        assert row["bytes"] == {"parameters": 2 * (numel if stage < 3 else numel // n),
                                "gradients": 2 * (numel if stage == 1 else numel // n),
                                "master_weights": 4 * owned, "optimizer_states": 8 * owned + 4 * row["pieces"]}


def test_fake_world_refuses_a_second_process_group() -> None:
    with fake_world(0, 4), pytest.raises(RuntimeError, match="already initialised"), fake_world(1, 4):
        pass
