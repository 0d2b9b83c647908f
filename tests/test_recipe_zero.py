"""lslm.recipes.zero: settings checked before launch, losses equal to the serial baseline, exact traffic per step.

Tolerance: fp32, ``rel=RTOL = 1e-5`` on the per-step loss, as for the DDP and TP recipes (the
gradient means are the same numbers summed in another order than in one process; AdamW carries
the rounding into the weights). A missing average, a wrong slice or a stale all-gather moves the
losses by far more.
"""

from __future__ import annotations

import pytest

from lslm.recipes import zero as R
from lslm.recipes.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("lslm_cache")  # conftest.py: a per-session cache, never ~/.cache

RTOL = 1e-5
STEPS = 6
SMALL = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1024, block_size=64, steps=STEPS, log_every=100,
             batch_size=8)
RUNS = ({"stage": 1}, {"stage": 2}, {"stage": 2, "bucket_cap_mb": 0.1}, {"stage": 1, "precision": "bf16"},
        {"stage": 3}, {"stage": 3, "keep_gathered": True})


@pytest.fixture(scope="module")
def baseline() -> list[float]:
    """The serial run (lslm.recipes.train) on the same data, seed and optimiser."""
    return train(TrainConfig(**SMALL))["losses"]


def test_bad_settings_raise_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by dp=4"):
        R.check_config(R.ZeroConfig(batch_size=6), 4)
    with pytest.raises(ValueError, match="stage"):
        R.ZeroConfig(stage=4)
    with pytest.raises(SystemExit) as exit_info:
        R.main(["--nproc", "2", "--stage", "7"])
    assert exit_info.value.code == 2


@pytest.fixture(scope="module")
def zero2(baseline: list[float]) -> list[list[dict]]:
    """Every run of RUNS in one 2-process launch."""
    res = R.run(2, runs=list(RUNS), output="none", timeout=300, **SMALL)
    return [[res[rank][i] for rank in range(2)] for i in range(len(RUNS))]


@pytest.mark.parametrize("i", range(len(RUNS)), ids=["stage1", "stage2", "stage2-small-buckets", "stage1-bf16",
                                                     "stage3", "stage3-keep-gathered"])
def test_zero_reproduces_the_serial_run(i: int, zero2: list[list[dict]], baseline: list[float]) -> None:
    res = zero2[i]
    assert res[0]["losses"] == res[1]["losses"]
    if RUNS[i].get("precision") == "bf16":  # bf16 weights: the loss tracks fp32 loosely (rounding of every weight)
        assert res[0]["losses"] == pytest.approx(baseline, rel=2e-2)
    else:
        assert res[0]["losses"] == pytest.approx(baseline, rel=RTOL)
    numel = res[0]["padded_numel"]
    for r in res:
        assert r["dp_size"] == 2 and r["stage"] == RUNS[i]["stage"]
        # Per step: the whole padded fp32 gradient buffer reduce-scattered and the parameter buffer all-gathered
        # (the ledger counts the full tensor of each), the clip norm's one fp32 number besides.
        item = 2 if RUNS[i].get("precision") == "bf16" else 4
        gathered = numel
        if RUNS[i]["stage"] == 3 and not RUNS[i].get("keep_gathered"):  # blocks gathered twice, the root once
            gathered = 2 * sum(r["bucket_numels"][:-1]) + r["bucket_numels"][-1]
        assert r["rs_bytes"] == [4 * numel] * STEPS and r["ag_bytes"] == [item * gathered] * STEPS
        assert r["other_comm_bytes"] == [4] * STEPS
    assert res[0]["owned_params"] + res[1]["owned_params"] == 235_264  # the tiny GPT: each element owned once


def test_a_killed_job_resumes_from_its_last_complete_checkpoint_at_another_size(tmp_path,
                                                                               zero2: list[list[dict]]) -> None:
    """Save every 2 steps, SIGKILL a rank after step 4 (0-based 3): the job fails. Resume at 3 processes from the
    last complete checkpoint: the remaining steps' losses are the uninterrupted run's."""
    from lslm.launcher import LaunchError
    from lslm.zero.checkpoint import MANIFEST, latest_checkpoint

    folder = tmp_path / "ckpt"
    common = dict(SMALL, batch_size=6, stage=2, checkpoint_dir=str(folder))
    whole = R.run(2, output="none", timeout=300, **{k: v for k, v in common.items() if k != "checkpoint_dir"})
    with pytest.raises(LaunchError, match="SIGKILL|signal 9|killed"):
        R.run(2, output="none", timeout=300, save_every=2, crash_at_step=4, **common)
    assert sorted(p.name for p in folder.iterdir()) == ["step000002", "step000004"]
    # A save cut short (no manifest) is never resumed from: the one before it is.
    (folder / "step000004" / MANIFEST).rename(folder / "step000004" / "manifest.partial")
    assert latest_checkpoint(folder).name == "step000002"
    resumed = R.run(3, output="none", timeout=300, resume=True, **common)
    assert resumed[0]["first_step"] == 2
    assert resumed[0]["losses"] == pytest.approx(whole[0]["losses"][2:], rel=RTOL)


def test_under_torchrun_stage3_gives_the_launched_runs_losses(tmp_path, baseline: list[float]) -> None:
    """``torchrun --nproc-per-node 2 -m lslm.recipes.zero --stage 3 ...`` (the command a cluster runs): the same
    losses, bit for bit, as the same settings through ``lslm.launch``; the run log written by rank 0."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "zero3.json"
    args = ["--stage", "3", "--steps", str(STEPS), "--batch-size", str(SMALL["batch_size"]), "--log-every", "100",
            "--n-layer", str(SMALL["n_layer"]), "--n-head", str(SMALL["n_head"]), "--n-embd", str(SMALL["n_embd"]),
            "--vocab-size", str(SMALL["vocab_size"]), "--block-size", str(SMALL["block_size"]), "--out", str(out)]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "lslm.recipes.zero", *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = json.loads(out.read_text())
    launched = R.run(2, output="none", timeout=300, **SMALL, stage=3)
    assert log["losses"] == launched[0]["losses"]  # the same code, data and arithmetic: bit for bit
    assert log["losses"] == pytest.approx(baseline, rel=RTOL)
    assert [r["rank"] for r in log["ranks"]] == [0, 1] and log["config"]["stage"] == 3
