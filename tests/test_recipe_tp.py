"""lslm.recipes.tp: settings checked before launch, losses equal to the serial baseline, exact traffic per step.

Tolerance of the loss comparisons: fp32, ``rel=RTOL = 1e-5`` on the per-step loss (as
for the DDP recipe). Tensor parallelism computes every matmul as partial sums over
``t`` ranks, the loss from per-rank pieces of the softmax, and the global gradient norm
from per-rank squares: the same numbers in another order, so the runs differ from the
serial one by fp32 rounding, which AdamW carries into the weights. Measured on this
model over 8 steps: at most ~2e-7 relative. A missing sequence-parallel gradient sync,
a division by dp x tp or a norm that counts replicated parameters twice moves the
losses by far more.
"""

from __future__ import annotations

import json

import pytest

from lslm.recipes import tp as R
from lslm.recipes.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("lslm_cache")  # conftest.py: a per-session cache, never ~/.cache

RTOL = 1e-5
STEPS = 8
SMALL = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1024, block_size=64, steps=STEPS, log_every=100)
L, C, T, B = 2, 64, 64, 8


@pytest.fixture(scope="module")
def baseline() -> list[float]:
    """The serial run (lslm.recipes.train) on the same data, seed and optimiser."""
    return train(TrainConfig(**SMALL, batch_size=B))["losses"]


# -- validation, before any process starts -----------------------------------------------
def test_bad_sizes_raise_value_error_naming_them() -> None:
    with pytest.raises(ValueError, match="n_head=4 .* tp=3"):
        R.TPConfig(tp=3)
    with pytest.raises(ValueError, match="tp=3 .*does not divide world_size=4"):
        R.run(nproc=4, tp=3, n_head=3, n_embd=48)
    with pytest.raises(ValueError, match="block_size=62 .* tp=4"):
        R.TPConfig(tp=4, sequence_parallel=True, block_size=62)
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by dp=4"):
        R.check_config(R.TPConfig(tp=1, batch_size=6), 4)
    with pytest.raises(ValueError, match="dp=3"):
        R.TPConfig(dp=3, batch_size=8)
    with pytest.raises(ValueError, match="dp=1 = 2 but world_size=4"):
        R.check_config(R.TPConfig(tp=2, dp=1), 4)
    with pytest.raises(SystemExit) as exit_info:  # the command line: an argparse error, exit code 2
        R.main(["--nproc", "4", "--tp", "3", "--n-head", "3", "--n-embd", "48"])
    assert exit_info.value.code == 2


# -- training equals the serial baseline ------------------------------------------------------
RUNS = ({}, {"sequence_parallel": True}, {"async_grad_allreduce": True})


@pytest.fixture(scope="module")
def tp2(baseline: list[float]) -> list[list[dict]]:
    """tp=2 plain, with sequence parallelism and with the async all-reduce, in one 2-process launch."""
    res = R.run(2, runs=list(RUNS), output="none", timeout=300, tp=2, batch_size=B, **SMALL)
    return [[res[rank][i] for rank in range(2)] for i in range(len(RUNS))]


def _sp_grad_numel() -> int:
    # LayerNorms (2 per block + ln_f, weight and bias), row-parallel biases (2 per block), position embeddings.
    return 2 * C * (2 * L + 1) + 2 * C * L + T * C


@pytest.mark.parametrize("i", range(len(RUNS)), ids=["tp2", "tp2-sp", "tp2-async"])
def test_tp2_reproduces_the_serial_run(i: int, tp2: list[list[dict]], baseline: list[float]) -> None:
    res = tp2[i]
    assert res[0]["losses"] == res[1]["losses"] == res[0]["local_losses"]  # both TP ranks report the one loss
    assert res[0]["losses"] == pytest.approx(baseline, rel=RTOL)
    assert [r["tp_size"] for r in res] == [2, 2] and [r["dp_size"] for r in res] == [1, 1]
    act = B * T * C * 4  # one (B, T, C) fp32 activation
    ce = 3 * B * T * 4  # the loss's max, target-logit and sum-of-exp all-reduces
    if RUNS[i].get("sequence_parallel"):
        # Forward: embedding reduce-scatter, 4 per block (2 all-gathers, 2 reduce-scatters), head all-gather;
        # backward: head re-gather + reduce-scatter, 6 per block, embedding all-gather; plus the SP gradient sync.
        want = (10 * L + 5) * act + ce + 4 * _sp_grad_numel()
    else:
        # Per block 2 all-reduces forward (g) and 2 backward (f); embedding forward, head backward.
        want = (4 * L + 2) * act + ce
    for r in res:
        assert r["tp_comm_bytes"] == [want] * STEPS
        assert r["dp_comm_bytes"] == [0] * STEPS and r["clip_comm_bytes"] == [4] * STEPS
        assert r["comm_bytes"] == [want + 4] * STEPS


def test_dp2_x_tp2_from_the_command_line_reproduces_the_serial_run(tmp_path, baseline: list[float]) -> None:
    out = tmp_path / "tp.json"
    res = R.main(["--nproc", "4", "--tp", "2", "--batch-size", str(B), "--steps", str(STEPS), "--log-every", "100",
                  "--n-layer", str(L), "--n-embd", str(C), "--block-size", str(T), "--out", str(out)])
    assert res[0]["losses"] == pytest.approx(baseline, rel=RTOL)
    act = (B // 2) * T * C * 4
    for r in res:
        assert r["tp_size"] == 2 and r["dp_size"] == 2
        assert r["tp_comm_bytes"] == [(4 * L + 2) * act + 3 * (B // 2) * T * 4] * STEPS
        assert r["dp_comm_bytes"] == [4 * r["num_parameters"]] * STEPS  # one flat all-reduce of this rank's shards
    # The TP ranks of one replica read the same rows (same loss); the two replicas read different rows.
    by_rank = {r["rank"]: r["local_losses"] for r in res}
    assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3] and by_rank[0] != by_rank[2]
    log = json.loads(out.read_text())
    assert log["losses"] == res[0]["losses"] and [r["rank"] for r in log["ranks"]] == [0, 1, 2, 3]
    assert log["config"]["tp"] == 2 and log["dp_size"] == 2
