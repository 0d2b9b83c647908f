"""The lslm GPT made tensor-parallel from outside: trains like one process (TP, SP, DP x TP), communicates exactly
what Megatron's analysis says, and keeps replicated parameters identical - unless the SP gradient sync is removed.

Tiny GPT (2 layers, width 64, 4 heads, vocabulary 250: padded to 252 at tp=4), 3 SGD
steps (lr 0.1, momentum 0.9) on 4 rows x 16 tokens, against the serial model from the
same seed (``tests.tp_model_workers``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.helpers import run_workers
from tests.tp_model_workers import ROWS, STEPS, T

# fp32 losses after 3 steps. Every parallel matmul sums its products in another order
# than the serial one (per-rank partial sums, then the all-reduce), so parameters
# differ by rounding after each step; the largest loss difference seen is 9.5e-7 (about
# 2 ulp of a loss near 5.5) and the largest logit difference 3.6e-7. A real bug (a
# missing all-reduce, a wrong qkv layout, a bias added t times) moves them by >= 1e-2.
LOSS_ATOL = 1e-5
LOGIT_ATOL = 1e-5
C, N_LAYER = 64, 2


@functools.cache
def _run(nproc: int, tp: int, cases: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    return tuple(run_workers("tests.tp_model_workers:suite", nproc, timeout=240, tp=tp, cases=list(cases)))


def _tp2() -> tuple[dict[str, Any], ...]:
    return _run(2, 2, ("tp", "sp", "async", "sp_without_grad_sync", "dropout", "sp_dropout"))


def _tp4() -> tuple[dict[str, Any], ...]:
    return _run(4, 4, ("tp", "sp"))


def _dp2_tp2() -> tuple[dict[str, Any], ...]:
    return _run(4, 2, ("tp", "sp"))


GRIDS = {"tp2": _tp2, "tp4": _tp4, "dp2xtp2": _dp2_tp2}


@pytest.mark.parametrize("grid, case", [("tp2", "tp"), ("tp2", "sp"), ("tp2", "async"), ("tp4", "tp"),
                                        ("tp4", "sp"), ("dp2xtp2", "tp"), ("dp2xtp2", "sp")])
def test_training_matches_one_process(grid: str, case: str) -> None:
    for res in GRIDS[grid]():
        got = res["cases"][case]
        diffs = [abs(a - b) for a, b in zip(got["losses"], res["ref_losses"])]
        assert max(diffs) <= LOSS_ATOL, (res["rank"], got["losses"], res["ref_losses"])
        assert got["logits_diff"] <= LOGIT_ATOL, (res["rank"], got["logits_diff"])
        assert got["drift"] == 0.0, (res["rank"], got["drift"])  # replicated parameters bitwise identical


def test_vocabulary_is_padded_where_tp_does_not_divide_it() -> None:
    assert _tp2()[0]["cases"]["tp"]["padded_vocab"] == 250
    assert _tp4()[0]["cases"]["tp"]["padded_vocab"] == 252


def test_without_the_sequence_parallel_grad_sync_replicas_drift_apart() -> None:
    ranks = _tp2()
    drift = max(r["cases"]["sp_without_grad_sync"]["drift"] for r in ranks)
    assert drift > 1e-4  # LayerNorm weights and row-parallel biases updated from half of the sequence each
    assert max(r["cases"]["sp"]["drift"] for r in ranks) == 0.0
    loss_gap = max(abs(a - b) for a, b in zip(ranks[0]["cases"]["sp_without_grad_sync"]["losses"],
                                              ranks[0]["ref_losses"]))
    assert loss_gap > 10 * LOSS_ATOL


def test_dropout_keeps_replicated_parameters_identical() -> None:
    # Attention dropout draws per-rank masks (sharded heads), the residual dropouts the shared
    # stream: LayerNorm weights and row-parallel biases must still agree bitwise on every TP rank.
    for res in _tp2():
        assert res["cases"]["dropout"]["drift"] == 0.0
        assert res["cases"]["sp_dropout"]["drift"] == 0.0
    a, b = (r["cases"]["dropout"]["losses"] for r in _tp2())
    assert a == b  # every TP rank computes the same loss


def _per_layer(ledger: list[list[Any]], layer: int) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for op, label, nbytes, _bus in ledger:
        if label.startswith(f"blocks.{layer}."):
            direction = label.rsplit(" ", 1)[1]
            out.setdefault((op, direction), []).append(nbytes)
    return out


@pytest.mark.parametrize("grid", ["tp2", "tp4"])
def test_two_all_reduces_forward_and_two_backward_per_layer(grid: str) -> None:
    # Megatron (Shoeybi et al. 2019, Figure 4): f and g around attention and around the MLP.
    ledger = GRIDS[grid]()[0]["cases"]["tp"]["ledger"]
    bsh = ROWS * T * C * 4  # fp32 bytes of one (batch, sequence, hidden) activation
    for layer in range(N_LAYER):
        assert _per_layer(ledger, layer) == {("all_reduce", "fwd"): [bsh, bsh], ("all_reduce", "bwd"): [bsh, bsh]}


@pytest.mark.parametrize("grid", ["tp2", "tp4"])
def test_sequence_parallel_moves_the_same_volume_as_all_gathers_and_reduce_scatters(grid: str) -> None:
    # Korthikanti et al. 2022, Section 4.2.2: each all-reduce becomes a reduce-scatter plus an
    # all-gather. Backward also re-gathers each column layer's input (saved as a slice):
    # two more all-gathers per layer, the price of 1/t activation memory.
    res = GRIDS[grid]()[0]
    t = 2 if grid == "tp2" else 4
    bsh = ROWS * T * C * 4
    for layer in range(N_LAYER):
        assert _per_layer(res["cases"]["sp"]["ledger"], layer) == {
            ("all_gather", "fwd"): [bsh, bsh], ("reduce_scatter", "fwd"): [bsh, bsh],
            ("all_gather", "bwd"): [bsh, bsh, bsh, bsh], ("reduce_scatter", "bwd"): [bsh, bsh]}
        tp_bus = sum(b for op, label, _, b in res["cases"]["tp"]["ledger"] if label.startswith(f"blocks.{layer}."))
        sp_bus = sum(b for op, label, _, b in res["cases"]["sp"]["ledger"]
                     if label.startswith(f"blocks.{layer}.") and "regather" not in label)
        assert tp_bus == sp_bus == 4 * 2 * (t - 1) / t * bsh


def test_the_overlap_log_times_every_input_gradient_collective() -> None:
    # The log asks the ledger for completion times (ledger.timed() around the async all-reduce), so every
    # one of them, in every step, enters the overlap summary; without them none would (completion unknown).
    for res in _tp2():
        case = res["cases"]["async"]
        column_bwd = [r for r in case["ledger"] if r[0] == "all_reduce" and r[1].endswith(" bwd")]
        assert len(column_bwd) == 2 * N_LAYER + 1  # attention's qkv and the MLP's first linear per layer, lm_head
        assert case["overlap"]["collectives"] == STEPS * len(column_bwd)
