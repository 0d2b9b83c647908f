"""lslm.recipes.pipeline: settings checked before launch, losses equal to the serial baseline, exact traffic per step.

Tolerance of the loss comparisons: fp32, ``rel=RTOL = 1e-5`` on the per-step loss (as for
the DDP and TP recipes). A pipeline step computes each micro-batch's mean loss and adds
the micro-batches' gradients (each weighted ``1/m``) where the serial step takes one mean
over the batch: the same numbers added in another order, and the clip norm is a sum of
per-rank squares. AdamW carries that rounding into the weights. Measured over these runs:
at most 1.4e-7 relative. A dropped or doubled micro-batch, a missing ``1/m`` or a dp
average over the wrong group moves the losses by far more.
"""

from __future__ import annotations

import pytest

from lslm.recipes import pipeline as R
from lslm.recipes.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("lslm_cache")  # conftest.py: a per-session cache, never ~/.cache

RTOL = 1e-5
STEPS = 4
L, C, T, B = 8, 32, 32, 8
SMALL = dict(n_layer=L, n_head=2, n_embd=C, vocab_size=1024, block_size=T, batch_size=B, steps=STEPS, log_every=100)


@pytest.fixture(scope="module")
def baseline() -> list[float]:
    """The serial run (lslm.recipes.train) on the same data, seed and optimiser."""
    return train(TrainConfig(**SMALL))["losses"]


# -- validation, before any process starts -----------------------------------------------
def test_bad_settings_raise_value_error_naming_them() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        R.PipelineConfig(schedule="pipedream")
    with pytest.raises(ValueError, match="3 stages.* 2 (blocks|layers)"):
        R.PipelineConfig(pp=3, n_layer=2)
    with pytest.raises(ValueError, match="multiple of .*4"):
        R.PipelineConfig(pp=4, n_layer=8, schedule="interleaved", microbatches=6, batch_size=12)
    with pytest.raises(ValueError, match="dualpipev needs .*>= .*4"):
        R.PipelineConfig(pp=2, n_layer=4, schedule="dualpipev", microbatches=2)
    with pytest.raises(ValueError, match="8 rows does not split into 3"):
        R.PipelineConfig(pp=2, dp=1, microbatches=3, batch_size=8)
    with pytest.raises(ValueError, match="dp=3"):
        R.PipelineConfig(dp=3, batch_size=8)
    with pytest.raises(ValueError, match="does not divide world_size=3"):
        R.check_config(R.PipelineConfig(pp=2), 3)
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by dp=4"):
        R.check_config(R.PipelineConfig(pp=1, batch_size=6, microbatches=1), 4)
    with pytest.raises(ValueError, match="batch of 4 rows does not split into 8"):  # 8 rows over dp=2: 4 per replica
        R.check_config(R.PipelineConfig(pp=2, microbatches=8, batch_size=8), 4)
    with pytest.raises(ValueError, match="does not divide world_size=4"):  # from run(): before the launch
        R.run(nproc=4, pp=3, n_layer=3)
    with pytest.raises(SystemExit) as exit_info:  # the command line: an argparse error, exit code 2
        R.main(["--nproc", "2", "--pp", "2", "--schedule", "dualpipev", "--microbatches", "2", "--n-layer", "4"])
    assert exit_info.value.code == 2
    assert R.PipelineConfig(schedule="interleaved", n_layer=4).virtual_stages == 2
    assert R.PipelineConfig(schedule="zb-h1").virtual_stages == 1


# -- training equals the serial baseline ------------------------------------------------------
def _stage_to_rank(schedule: str, p: int, v: int) -> list[int]:
    if schedule == "dualpipev":
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * v)]


def _check(records: list[dict], baseline: list[float], run: dict) -> None:
    """Losses as the baseline's, every rank reports the one loss, and the exact bytes per step."""
    p, m = run["pp"], run["microbatches"]
    dp = len(records) // p
    s2r = _stage_to_rank(run["schedule"], p, records[0]["virtual_stages"])
    msg = (B // dp // m) * T * C * 4  # one micro-batch's activation (or its gradient), fp32
    assert records[0]["losses"] == pytest.approx(baseline, rel=RTOL), run
    for r in records:
        assert r["losses"] == records[0]["losses"] and (r["pp_size"], r["dp_size"]) == (p, dp)
        pp_rank = r["rank"] // dp
        assert r["stages"] == [s for s, rank in enumerate(s2r) if rank == pp_rank]
        # Each stage boundary that crosses ranks: m activations one way, m gradients the other.
        crossings = sum((s > 0 and s2r[s - 1] != pp_rank) + (s < len(s2r) - 1 and s2r[s + 1] != pp_rank)
                        for s in r["stages"])
        assert r["pp_comm_calls"] == [2 * m * crossings] * STEPS, run
        assert r["pp_comm_bytes"] == [2 * m * crossings * msg] * STEPS, run
        assert r["dp_comm_bytes"] == [4 * r["num_parameters"] if dp > 1 else 0] * STEPS  # one flat average per stage
        assert r["clip_comm_bytes"] == [4] * STEPS and r["other_comm_bytes"] == [8] * STEPS  # + the loss broadcast


RUNS2 = ({"pp": 2, "schedule": "1f1b", "microbatches": 4}, {"pp": 2, "schedule": "zb-h1", "microbatches": 4},
         {"pp": 2, "schedule": "dualpipev", "microbatches": 4})


def test_pp2_schedules_reproduce_the_serial_run(baseline: list[float]) -> None:
    res = R.run(2, runs=list(RUNS2), output="none", timeout=300, **SMALL)
    for i, run in enumerate(RUNS2):
        _check([res[rank][i] for rank in range(2)], baseline, run)


# The dp run first: the job's process group has the first run's grid, and the harness averages the reported
# loss over that grid's dp group (the later pp=4 run has dp=1; its dp pairs then hold the same loss).
RUNS4 = ({"pp": 2, "schedule": "gpipe", "microbatches": 2}, {"pp": 4, "schedule": "interleaved", "microbatches": 4})
#: dp=2 x pp=2 ZB-H1 in half precision with the API defaults: gradients in fp32 buffers, each stage's averaged in
#: place as soon as its last backward (I or W) is done. Same launch (a launch costs more than these runs).
HALF4 = tuple({"pp": 2, "schedule": "zb-h1", "microbatches": 2, "precision": m} for m in ("fp16", "bf16"))
U = {"fp16": 2.0**-11, "bf16": 2.0**-8}  # unit roundoff; tests/test_recipe_precision.py's tolerance: 0.25 u


def test_pp4_interleaved_and_pp2_x_dp2_reproduce_the_serial_run(baseline: list[float]) -> None:
    res = R.run(4, runs=list(RUNS4 + HALF4), output="none", timeout=300, **SMALL)
    for i, run in enumerate(RUNS4):
        _check([res[rank][i] for rank in range(4)], baseline, run)
    for i, run in enumerate(HALF4, start=len(RUNS4)):
        mode = run["precision"]
        serial = train(TrainConfig(**SMALL, precision=mode))
        records = [res[rank][i] for rank in range(4)]
        worst = max(abs(a - b) / b for a, b in zip(records[0]["losses"], serial["losses"], strict=True)) / U[mode]
        print(f"dp=2 x pp=2 zb-h1 {mode}: {worst:.4f} u")
        assert worst <= 0.25, (mode, worst)
        for r in records:
            assert r["losses"] == records[0]["losses"] and r["dp_size"] == 2
            assert r["stepped"] == serial["stepped"] and r["loss_scale"] == serial["loss_scale"]
            assert r["dp_comm_bytes"] == [4 * r["num_parameters"]] * STEPS  # the fp32 buffers, in place
    # pp=2 x dp=2: ranks 0, 1 hold stage 0 of replicas 0 and 1; the pipeline ranks of a replica read the same rows.
    by_rank = {r[0]["rank"]: r[0]["local_losses"] for r in res}
    assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3] and by_rank[0] != by_rank[1]
