"""lslm.tensor_parallel layers: outputs and input/weight/bias gradients equal torch's, communication counted exactly.

Each layer runs at tp = 2 and 4 (gloo) against ``nn.Linear`` / ``nn.Embedding`` /
``F.cross_entropy`` built from the same seed on every rank (``tests.tp_layers_workers``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from lslm.tensor_parallel.qkv import qkv_permutation, qkv_rows
from lslm.tensor_parallel.vocab import pad_vocab_size, vocab_range
from tests.helpers import run_workers
from tests.tp_layers_workers import B, C, T

# fp32, |values| <= ~10: the parallel sums run in another order than torch's single
# matmul (partial sums per rank, then the all-reduce), so results differ by rounding.
# The largest difference seen is 1.9e-6 (a bias gradient of magnitude ~4 summed over
# 16 rows on 4 ranks: a few ulp). 1e-5 is far below any real bug (a missing all-reduce or
# a bias added t times is off by O(1)).
ATOL = 1e-5


@functools.cache
def _suite(nproc: int) -> tuple[dict[str, Any], ...]:
    return tuple(run_workers("tests.tp_layers_workers:suite", nproc, timeout=180))


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_layer_matches_torch(nproc: int) -> None:
    bad = [(rank, case, what, diff) for rank, res in enumerate(_suite(nproc)) for case, diffs in res["diffs"].items()
           for what, diff in diffs.items() if not diff <= ATOL]
    assert not bad, bad


@pytest.mark.parametrize("nproc", [2, 4])
def test_each_layer_communicates_exactly_what_megatron_does(nproc: int) -> None:
    ledger = _suite(nproc)[0]["ledger"]
    assert ledger["column"] == {"all_reduce|col bwd": 1}  # f: only the input gradient
    assert ledger["column_async"] == {"all_reduce|col bwd": 1}  # the same volume, overlapped
    assert ledger["column_sp"] == {"all_gather|col fwd": 1, "reduce_scatter|col bwd": 1,
                                   "all_gather|col regather bwd": 1}
    assert ledger["column_sp_saved"] == {"all_gather|col fwd": 1, "reduce_scatter|col bwd": 1}
    assert ledger["row"] == {"all_reduce|row fwd": 1}  # g: only the output
    assert ledger["row_sp"] == {"reduce_scatter|row fwd": 1, "all_gather|row bwd": 1}
    assert ledger["embedding"] == {"all_reduce|emb fwd": 1}
    assert ledger["embedding_sp"] == {"reduce_scatter|emb fwd": 1, "all_gather|emb bwd": 1}
    for case in ("column_sp", "row_sp", "embedding_sp"):  # batch-first: the same collectives
        assert ledger[f"{case}_batch_first"] == ledger[case]
    # Three sums over the vocabulary in two all-reduces (max, then target logit and sum of exps together).
    assert ledger["cross_entropy"] == {"all_reduce|vocab-parallel-ce max": 1,
                                       "all_reduce|vocab-parallel-ce target+sumexp": 1,
                                       "all_gather|gather-logits fwd": 1}


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_block_copies_activations_only_where_the_all_reduce_needs_its_own_buffer(nproc: int) -> None:
    """Copies per GPT block (forward + backward, B=2 rows, counted by lslm.metrics.allocations).

    Without SP: the two f backwards (attention and MLP input gradients), whose incoming gradient
    other branches still read, so the all-reduce works on a copy; g's forward sums in place.
    With SP: none. The GPT runs sequence-first (T, B, C) under sequence parallelism, so each
    rank's slice of the sequence is one contiguous block and no all-gather or reduce-scatter
    rearranges anything; attention's head split and merge stay views (the fused CPU kernel
    writes its output in the query's memory order). Batch-first, the same block made 10: one
    rank-major rearrangement per collective (2 all-gathers and 2 reduce-scatters forward, their
    4 transposes backward, the 2 regathers). Before the gradient-buffer change (issue 19): 4 and 16.
    """
    copies = _suite(nproc)[0]["copies"]
    act = B * T * 2 * C * 4  # one (B, T, 2C) fp32 activation
    assert copies["tp copies"] == 2 and copies["tp copy bytes"] == 2 * act
    assert copies["sp copies"] == 0 and copies["sp copy bytes"] == 0


@pytest.mark.parametrize("nproc", [2, 4])
def test_sequence_parallel_layers_rearrange_nothing_sequence_first(nproc: int) -> None:
    """Each SP layer's forward + backward: no copy sequence-first (the default, dim 0); batch-first (dim 1, the
    Hugging Face plans) one per collective: column 3 (gather, regather, reduce-scatter; 2 without the regather),
    row 2 (reduce-scatter, gather), embedding 2 (reduce-scatter, gather of the gradient)."""
    copies = _suite(nproc)[0]["layer copies"]
    assert {k: v for k, v in copies.items() if k.endswith("seq0")} == {
        "column seq0": 0, "column saved seq0": 0, "row seq0": 0, "embedding seq0": 0}
    assert {k: v for k, v in copies.items() if k.endswith("seq1")} == {
        "column seq1": 3, "column saved seq1": 2, "row seq1": 2, "embedding seq1": 2}


def test_vocab_padding() -> None:
    assert pad_vocab_size(50257, 2) == 50258
    assert pad_vocab_size(50257, 4, multiple=128) == 50688
    assert pad_vocab_size(1024, 4) == 1024
    assert vocab_range(50258, 1, 2) == (25129, 50258)
    with pytest.raises(ValueError, match="pad_vocab_size"):
        vocab_range(50257, 0, 2)
    with pytest.raises(ValueError, match="tp"):
        pad_vocab_size(100, 0)


def test_qkv_rows_give_each_rank_whole_heads_of_q_k_and_v() -> None:
    # 4 heads of 2 dims, tp=2: rank 1 owns heads 2, 3 -> rows 4..7 of each of q, k, v.
    assert qkv_rows(8, 4, 2, 1).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    perm = qkv_permutation(8, 4, 2)
    assert sorted(perm.tolist()) == list(range(24))
    assert torch.equal(perm.chunk(2)[1], qkv_rows(8, 4, 2, 1))
    with pytest.raises(ValueError, match="n_head=4 attention heads cannot be split over tp=3"):
        qkv_rows(8, 4, 3, 0)


def test_sizes_that_do_not_divide_are_rejected_with_the_numbers() -> None:
    from lslm.runtime.grid import RankGrid
    from lslm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    class _Ctx:  # the layers read only sizes and the device at construction
        tp_size, tp_rank, device = 4, 0, torch.device("cpu")
        grid = RankGrid.build(4, tp=4)

    with pytest.raises(ValueError, match="out_features=10 is not divisible by tp=4"):
        ColumnParallelLinear(8, 10, _Ctx())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="in_features=6 is not divisible by tp=4"):
        RowParallelLinear(6, 8, _Ctx())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="padded vocabulary.*=50257 is not divisible by tp=4"):
        VocabParallelEmbedding(50257, 8, _Ctx())  # type: ignore[arg-type]
