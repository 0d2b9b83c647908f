"""lslm tensor parallelism against PyTorch's own: the DTensor GPT (lslm.tensor_parallel.dtensor_reference).

One launch per world size (tp = 2 and 4, gloo) runs every case (``tests.tp_dtensor_workers:suite``):

* the DTensor GPT, SP off and on, trained 3 SGD-momentum steps equals the serial GPT;
* lslm's vocab-parallel cross-entropy equals DTensor ``loss_parallel``'s, loss and gradient,
  on the same logit shards;
* the collectives each version issues for one forward + backward, per layer and outside
  the layers, as counted by ``CommDebugMode`` and by lslm's ledger;
* the package's side-by-side that notebook 05 launches (``compare_with_serial``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.helpers import run_workers

# fp32 throughout. Parallel sums run in another order than the serial matmuls (partial
# products per rank, then the collective), so results differ by rounding: after 3 steps
# the largest differences seen are 1.2e-7 in a weight (lr 0.1, momentum 0.9, weights
# ~0.02-1) and 3.3e-7 in a logit (|logits| ~ 1); the two losses agree exactly. 1e-5 is
# ~30x that, and far below what a real bug gives (q/k/v rows not permuted, a missing
# all-reduce, a partial LayerNorm gradient used unsummed: all O(1e-3) or more).
ATOL = 1e-5
# The loss comparison is on random logits of scale ~3 over 256 classes: one fp32 log-sum-exp
# computed in two orders (max, exp-sums per shard), so a few ulp of a loss ~6 (~1e-6).
LOSS_ATOL = 5e-6

B, T, C, N_LAYER, BLOCK = 4, 16, 64, 2, 64  # tests.tp_dtensor_workers: ROWS x T tokens; GPTConfig.tiny's sizes
BTC = B * T * C


@functools.cache
def _suite(nproc: int) -> tuple[dict[str, Any], ...]:
    return tuple(run_workers("tests.tp_dtensor_workers:suite", nproc, timeout=240))


@pytest.mark.parametrize("nproc", [2, 4])
def test_dtensor_gpt_trains_like_the_serial_gpt(nproc: int) -> None:
    for rank, res in enumerate(_suite(nproc)):
        assert res["tp"] == nproc
        for case, diffs in res["training"].items():
            bad = {k: v for k, v in diffs.items() if k != "losses" and not v <= ATOL}
            assert not bad, (rank, case, bad)


@pytest.mark.parametrize("nproc", [2, 4])
def test_lslm_vocab_parallel_loss_equals_dtensor_loss_parallel(nproc: int) -> None:
    for rank, res in enumerate(_suite(nproc)):
        bad = {k: v for k, v in res["losses"].items() if not v <= LOSS_ATOL}
        assert not bad, (rank, bad)


@pytest.mark.parametrize("nproc", [2, 4])
def test_without_sp_each_layer_all_reduces_twice_forward_and_twice_backward_in_both(nproc: int) -> None:
    counts = _suite(nproc)[0]["counts"]
    dt, ours = counts["dtensor sp=False"], counts["lslm sp=False"]
    assert dt["per_layer"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    for i in range(N_LAYER):
        assert dt["elements"][f"blocks.{i}"] == {"forward": {"all_reduce": [BTC, BTC]},
                                                 "backward": {"all_reduce": [BTC, BTC]}}
        assert ours["by_owner"][f"blocks.{i}"] == {"all_reduce|fwd": 2, "all_reduce|bwd": 2}
        assert ours["elements"][f"blocks.{i}"] == [BTC] * 4
    # Outside the layers: the embedding's output all-reduce and the head's input-gradient
    # all-reduce agree; the loss differs: loss_parallel all-reduces max, sum of exps and
    # target logit separately (3 x N), lslm sends the last two stacked (N + 2N).
    assert dt["elements"]["wte"] == {"forward": {"all_reduce": [BTC]}}
    assert dt["elements"]["lm_head"] == {"backward": {"all_reduce": [BTC]}}
    assert dt["elements"]["model"] == {"forward": {"all_reduce": [B * T] * 3}}
    assert dt["total"] == {"all_reduce": 4 * N_LAYER + 5}
    assert ours["elements"]["wte"] == [BTC] and ours["elements"]["lm_head"] == [BTC]
    assert ours["elements"]["vocab-parallel-ce max"] == [B * T]
    assert ours["elements"]["vocab-parallel-ce target+sumexp"] == [2 * B * T]


@pytest.mark.parametrize("nproc", [2, 4])
def test_with_sp_layers_agree_once_lslm_keeps_the_gathered_input(nproc: int) -> None:
    counts = _suite(nproc)[0]["counts"]
    dt = counts["dtensor sp=True"]
    layer = {"all_gather": 2, "reduce_scatter": 2}
    assert dt["per_layer"] == {"forward": layer, "backward": layer}
    for i in range(N_LAYER):
        assert dt["elements"][f"blocks.{i}"] == {"forward": {"all_gather": [BTC] * 2, "reduce_scatter": [BTC] * 2},
                                                 "backward": {"all_gather": [BTC] * 2, "reduce_scatter": [BTC] * 2}}
        # lslm by default re-gathers each column-parallel input in backward (2 more all-gathers
        # per layer) instead of keeping it; with regather_input=False the layers match DTensor's.
        assert counts["lslm sp=True"]["by_owner"][f"blocks.{i}"] == {
            "all_gather|fwd": 2, "reduce_scatter|fwd": 2, "all_gather|bwd": 2, "reduce_scatter|bwd": 2,
            "all_gather|regather bwd": 2}
        assert counts["lslm sp=True regather=False"]["by_owner"][f"blocks.{i}"] == {
            "all_gather|fwd": 2, "reduce_scatter|fwd": 2, "all_gather|bwd": 2, "reduce_scatter|bwd": 2}
    # Replicated parameters with partial gradients: lslm sums them in one flat all-reduce
    # (wpe's whole BLOCK x C table, every LayerNorm's 2C, every row-parallel bias C); DTensor all-gathers wpe's
    # output gradient in backward, leaves the LayerNorm gradients Partial and all-reduces each
    # one (C elements) in the optimizer step, and needs nothing for the row-parallel biases.
    n_norms = 2 * N_LAYER + 1
    assert dt["elements"]["wpe"] == {"backward": {"all_gather": [T * C]}}
    assert dt["elements"]["optimizer"] == {"optimizer": {"all_reduce": [C] * 2 * n_norms}}
    assert counts["lslm sp=True"]["elements"]["sp-grad-sync"] == [BLOCK * C + 2 * C * n_norms + 2 * N_LAYER * C]
    assert dt["elements"]["wte"] == {"forward": {"reduce_scatter": [BTC]}, "backward": {"all_gather": [BTC]}}
    assert dt["elements"]["lm_head"] == {"forward": {"all_gather": [BTC]}, "backward": {"reduce_scatter": [BTC]}}


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_notebook_comparison_reports_equality_and_per_layer_counts(nproc: int) -> None:
    res = _suite(nproc)[0]["notebook"]
    assert res["tp"] == nproc
    for sp in ("off", "on"):
        diffs = {k: v for k, v in res[sp].items() if not k.endswith("_layer")}
        assert all(v <= ATOL for v in diffs.values()), (sp, diffs)
    assert res["off"]["lslm_layer"] == res["off"]["dtensor_layer"] == {"all_reduce bwd": 2, "all_reduce fwd": 2}
    sp_layer = {"all_gather bwd": 2, "all_gather fwd": 2, "reduce_scatter bwd": 2, "reduce_scatter fwd": 2}
    assert res["on"]["dtensor_layer"] == sp_layer
    assert res["on"]["lslm_layer"] == {**sp_layer, "all_gather regather bwd": 2}
