"""ZeRO-R (lslm.zero.activations): partitioned activation checkpoints under tensor parallelism, tp = 2."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.helpers import run_workers
from tests.zero_r_workers import CONFIG, B, T


@functools.cache
def _suite() -> dict[str, Any]:
    return run_workers("tests.zero_r_workers:suite", 2, timeout=300)[0]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_partitioned_checkpoints_give_the_same_loss_and_gradients(dropout: float) -> None:
    r = _suite()
    for mode in ("partitioned", "partitioned-cpu"):  # recomputation replays the forward exactly, dropout included
        got = r[f"{mode}_d{dropout}"]
        assert got["loss_equal"] and got["max_grad_diff"] == 0.0, mode
    # torch's own checkpoint replays only the default generator: the tensor-parallel tracker's dropout streams
    # draw new masks in the recomputation, and the gradients are wrong (Megatron has its own checkpoint for this).
    ckpt = r[f"checkpoint_d{dropout}"]
    assert ckpt["loss_equal"] and ((ckpt["max_grad_diff"] == 0.0) == (dropout == 0.0))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_partitioned_checkpoints_replay_the_forwards_autocast(precision: str) -> None:
    # Forward under CPU autocast, backward outside, dropout on: the recomputation re-enters the forward's autocast
    # (lslm.runtime.replay); run outside it, its matmuls were fp32 and the gradients differed.
    got = _suite()[f"partitioned_{precision}"]
    assert got["loss_equal"] and got["identical"], got


def test_each_rank_keeps_a_tp_th_of_every_block_input() -> None:
    r = _suite()
    block_input = B * T * CONFIG["n_embd"] * 4  # one (B, T, C) fp32 tensor
    layers, t = CONFIG["n_layer"], r["tp"]
    plain, ckpt, part = (r[f"{m}_d0.0"]["saved"] for m in ("plain", "checkpoint", "partitioned"))
    assert ckpt < plain  # checkpointing keeps the blocks' inputs only
    assert ckpt - part == layers * block_input * (t - 1) // t  # and P_a 1/t of each
    assert r["partitioned-cpu_d0.0"]["saved"] == part  # the same bytes, on the host
    # one all-gather of each block's input in backward (the ledger counts the gathered tensor)
    assert r["partitioned_d0.0"]["gathers"] == layers and r["partitioned_d0.0"]["gather_bytes"] == layers * block_input
    assert r["checkpoint_d0.0"]["gathers"] == 0
