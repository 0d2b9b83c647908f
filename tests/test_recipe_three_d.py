"""lslm.recipes.three_d: settings checked before launch; at dp = tp = pp = 2 (8 processes, launched through
``lslm.launch``) the losses equal the serial baseline's and the stage-to-stage bytes are exactly the schedule's.

Tolerance: fp32, ``rel=1e-5`` per step on the loss, as for the DDP, TP and pipeline recipes (the same numbers
added in another order: micro-batch means, tp partial sums, the dp average). Measured: 7.0e-8 relative at most
over both runs; a dropped micro-batch or a missing reduction moves the loss by far more.
"""

from __future__ import annotations

import pytest

from lslm.recipes import three_d as R
from lslm.recipes.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("lslm_cache")  # conftest.py: a per-session cache, never ~/.cache

RTOL = 1e-5
STEPS = 3
L, C, T, B = 4, 32, 32, 8
SMALL = dict(n_layer=L, n_head=2, n_embd=C, vocab_size=1024, block_size=T, batch_size=B, steps=STEPS, log_every=100)
GRID = dict(dp=2, tp=2, pp=2)
#: ZeRO-1 with sequence parallelism under 1F1B, and interleaved 1F1B with SP (activations cross as sequence shards);
#: each with a recomputation mode too (which must change no loss).
RUNS = ({"schedule": "1f1b", "microbatches": 2, "zero": 1, "sequence_parallel": True, "recompute": "selective"},
        {"schedule": "interleaved", "microbatches": 2, "sequence_parallel": True, "recompute": "full"})


def test_bad_settings_raise_value_error_naming_them() -> None:
    with pytest.raises(ValueError, match="3 attention heads"):
        R.ThreeDConfig(**{**SMALL, "n_head": 3, "n_embd": 48})
    with pytest.raises(ValueError, match="does not divide world_size=6"):
        R.check_config(R.ThreeDConfig(**SMALL), 6)
    with pytest.raises(ValueError, match="does not divide world_size=6"):  # from run(): before the launch
        R.run(nproc=6, **SMALL)
    with pytest.raises(SystemExit) as exit_info:  # the command line: an argparse error, exit code 2
        R.main(["--nproc", "8", "--zero", "2"])
    assert exit_info.value.code == 2
    assert R.check_config(R.ThreeDConfig(**SMALL), 8) == 2


def _stage_to_rank(p: int, v: int) -> list[int]:
    return [s % p for s in range(p * v)]


def test_dp2_tp2_pp2_reproduces_the_serial_run() -> None:
    baseline = train(TrainConfig(**SMALL))["losses"]
    res = R.run(8, runs=list(RUNS), output="none", timeout=300, **SMALL, **GRID)
    for i, run in enumerate(RUNS):
        records = [res[rank][i] for rank in range(8)]
        assert records[0]["losses"] == pytest.approx(baseline, rel=RTOL), run
        print(run, "max relative loss difference", max(abs(a - b) / b for a, b in zip(records[0]["losses"],
                                                                                    baseline)))
        m, v = run["microbatches"], records[0]["virtual_stages"]
        s2r = _stage_to_rank(2, v)
        shards = GRID["tp"] if run.get("sequence_parallel") else 1
        msg = (B // GRID["dp"] // m) * T * C * 4 // shards  # one micro-batch's activation (or its gradient), fp32
        for r in records:
            assert r["losses"] == records[0]["losses"]
            assert (r["dp_size"], r["tp_size"], r["pp_size"]) == (2, 2, 2)
            assert r["recompute"] == run["recompute"]
            pp_rank = r["coords"]["pp"]
            assert r["stages"] == [s for s, rank in enumerate(s2r) if rank == pp_rank]
            crossings = sum((s > 0 and s2r[s - 1] != pp_rank) + (s < len(s2r) - 1 and s2r[s + 1] != pp_rank)
                            for s in r["stages"])
            assert r["pp_comm_bytes"] == [2 * m * crossings * msg] * STEPS, run
