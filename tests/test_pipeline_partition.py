"""Partitioning a GPT into pipeline stages (lslm.pipeline.partition): costs, optimal splits, stage modules."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.partition import GPTStage, partition_units, split_gpt, unit_costs, unit_names


def _model(n_layer: int = 8, **kw: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(n_layer=n_layer, block_size=16, **kw))


def _brute_force(costs: list[float], k: int) -> float:
    """Smallest largest-stage cost over every contiguous split into k non-empty stages."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


def _valid(ranges: list[tuple[int, int]], n: int, k: int) -> bool:
    return (len(ranges) == k and ranges[0][0] == 0 and ranges[-1][1] == n
            and all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in zip(ranges, ranges[1:])))


def test_partition_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [float(rng.choice([0, 1, 2, 3, 5, 8])) for _ in range(n)]
        ranges = partition_units(costs, k)
        assert _valid(ranges, n, k), (costs, k, ranges)
        assert max(sum(costs[a:b]) for a, b in ranges) == _brute_force(costs, k), (costs, k, ranges)


def test_partition_spreads_evenly_below_the_bottleneck() -> None:
    # bound is 4 (the single big unit); among the optimal splits the even one is chosen.
    assert partition_units([4, 1, 1, 1, 1], 3) == [(0, 1), (1, 3), (3, 5)]
    assert partition_units([1.0] * 6, 3) == [(0, 2), (2, 4), (4, 6)]


def test_partition_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="non-empty stages"):
        partition_units([1, 1], 3)
    with pytest.raises(ValueError, match="positive int"):
        partition_units([1, 1], 0)
    with pytest.raises(ValueError, match=">= 0"):
        partition_units([1, -1], 1)


def test_unit_costs_layers_and_params() -> None:
    model = _model()
    names = unit_names(model)
    assert names[0] == "embed" and names[-1] == "head" and names[1:-1] == [f"block.{i}" for i in range(8)]
    assert unit_costs(model, "layers") == [0.0] + [1.0] * 8 + [0.0]
    params = unit_costs(model, "params")
    assert sum(params) == model.num_parameters()
    c, v, t = 64, 1024, 16
    assert params[0] == v * c + t * c  # wte + wpe
    assert params[-1] == 2 * c + v * c  # ln_f + lm_head (no bias)
    with pytest.raises(ValueError, match="unknown partition method"):
        unit_costs(model, "flops")


def test_unit_costs_time_is_positive_and_leaves_grads_alone() -> None:
    model = _model(n_layer=2)
    times = unit_costs(model, "time", repeats=1)
    assert len(times) == 4 and all(t > 0 for t in times)
    assert all(p.grad is None for p in model.parameters())


def test_layers_split_puts_embed_first_and_head_last_and_shows_the_param_imbalance() -> None:
    model = _model()
    stages = split_gpt(model, 4, "layers")
    assert [s.units for s in stages] == [["embed", "block.0", "block.1"], ["block.2", "block.3"],
                                         ["block.4", "block.5"], ["block.6", "block.7", "head"]]
    assert [s.block_ids for s in stages] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, False), (False, False),
                                                         (False, True)]
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert counts[1] == counts[2] == 2 * block
    assert counts[0] > counts[1] and counts[3] > counts[1]  # embed / head ride on top of two blocks
    # Balancing parameters moves blocks away from the heavy ends.
    by_params = split_gpt(model, 4, "params")
    assert max(sum(p.numel() for p in s.parameters()) for s in by_params) < max(counts)
    assert len(by_params[0].block_ids) < len(by_params[1].block_ids)


@pytest.mark.parametrize("sequence_first", [False, True])
def test_stages_share_the_models_parameters_and_chain_to_its_forward_bit_for_bit(sequence_first: bool) -> None:
    model = _model()
    model.sequence_first = sequence_first  # (T, B, C) hidden states between the stages; logits (B, T, V) anyway
    x = torch.randint(0, 1024, (3, 16), generator=torch.Generator().manual_seed(1))
    expected, _ = model(x)
    named = dict(model.named_parameters())
    for k, method in [(1, "layers"), (3, "layers"), (4, "params"), (8, "layers")]:
        stages = split_gpt(model, k, method)
        assert all(isinstance(s, GPTStage) for s in stages)
        mine = [(n, p) for s in stages for n, p in s.model_names()]
        assert sorted(n for n, _ in mine) == sorted(named)  # every parameter exactly once
        assert all(p is named[n] for n, p in mine)  # the same objects, not copies
        h = x
        for s in stages:
            h = s(h)
        assert torch.equal(h, expected), (k, method)


def test_split_gpt_rejects_bad_requests() -> None:
    model = _model(n_layer=4)
    with pytest.raises(ValueError, match="only 4 blocks"):
        split_gpt(model, 5)
    with pytest.raises(ValueError, match="unknown partition method"):
        split_gpt(model, 2, "flops")
    with pytest.raises(ValueError, match="unknown partition method"):
        split_gpt(model, 2, "flops", boundaries=[(0, 3), (3, 6)])
    for bad in ([(0, 3)], [(0, 3), (4, 6)], [(0, 3), (3, 5)], [(0, 0), (0, 6)], [(1, 3), (3, 6)], "ab"):
        with pytest.raises(ValueError, match="boundaries"):
            split_gpt(model, 2, boundaries=bad)
    stages = split_gpt(model, 2, boundaries=[(0, 1), (1, 6)])  # the embedding alone is a valid stage
    assert stages[0].units == ["embed"] and stages[0].block_ids == []
