"""Notebook 04b's tools: gradient accumulation and gbs = mbs x k x dp, the torchrun script, Lightning and Accelerate.

Tolerances (fp32; every comparison sums the same numbers in another order):
* gradients: ``accumulation.REL_TOL = 1e-5`` of the largest gradient entry (measured: 1.1e-7);
  a missing ``/ k`` is off by ``k - 1``, a rank's rows counted twice by O(1).
* losses, Lightning / Accelerate vs lslm DDP: ``side_by_side.LOSS_ATOL = 2e-5`` absolute on
  losses near 7 (measured: at most 2 fp32 ulps, 9.5e-7, over 20 steps).
* the torchrun script vs lslm DDP with torch's sampler: ``rtol=1e-5`` as in test_recipe_ddp.
One launch of 2 processes runs the no_sync check and the three frameworks (plus lslm in the
script's data order); the script runs under torchrun from its file; a tiny failing script checks
that :func:`torchrun_file` raises.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lslm.data_parallel import accumulation as A
from lslm.integrations import side_by_side as S
from lslm.integrations.torchrun_file import shell_line, torchrun_file
from lslm.launcher.launch_errors import LaunchError
from lslm.recipes import ddp_script
from tests.helpers import run_workers

pytestmark = pytest.mark.usefixtures("lslm_cache")

STEPS = 6
SMALL = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1024, block_size=64, batch_size=8, steps=STEPS, log_every=100)


# -- gradient accumulation, one process -----------------------------------------------------
def test_backward_adds_into_grad_and_zeroing_restarts() -> None:
    model, x, y = A.reference_setup(gbs=2, block_size=16, n_layer=1, n_embd=32)
    model(x, y)[1].backward()
    once = A.flat_grad(model)
    model(x, y)[1].backward()  # no zero_grad: the second gradient is added to the first
    torch.testing.assert_close(A.flat_grad(model), 2 * once)
    A.accumulate(model, x, y, mbs=2)  # starts from nothing again
    torch.testing.assert_close(A.flat_grad(model), once)


def test_serial_identity_every_micro_batch_size() -> None:
    rows = A.serial_identity(gbs=8)
    assert [(r["mbs"], r["k"], r["dp"]) for r in rows] == [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1)]
    A.check(rows)
    assert max(abs(r["loss"] - rows[0]["loss"]) for r in rows) < 1e-5


def test_a_missing_division_by_k_is_caught() -> None:
    model, x, y = A.reference_setup(gbs=4, block_size=16, n_layer=1, n_embd=32)
    A.accumulate(model, x, y, mbs=4)
    ref = A.flat_grad(model)
    for p in model.parameters():
        p.grad = None
    for j in range(2):  # the classic mistake: loss not divided by k = 2
        model(x[2 * j:2 * j + 2], y[2 * j:2 * j + 2])[1].backward()
    bad = A.flat_grad(model)
    rel = ((bad - ref).abs().max() / ref.abs().max()).item()
    with pytest.raises(AssertionError, match="mbs=2, k=2"):
        A.check([{"mbs": 2, "k": 2, "dp": 1, "rel_diff": rel}])
    assert rel == pytest.approx(1.0, rel=1e-4)  # twice the gradient


def test_bad_accumulation_input_raises() -> None:
    with pytest.raises(ValueError, match="divide the batch"):
        A.accumulate(torch.nn.Linear(1, 1), torch.zeros(6, 1), torch.zeros(6, 1), mbs=4)
    with pytest.raises(ValueError, match="multiple of dp=3"):
        A.combinations(8, dp=3)
    assert A.combinations(8, dp=2) == [(4, 1, 2), (2, 2, 2), (1, 4, 2)]


# -- one 2-process job: no_sync, Lightning and Accelerate; then the from-scratch script under torchrun ---
@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    return run_workers("lslm.integrations.side_by_side:worker", 2, timeout=300, script_order=True, gbs=8, **SMALL)[0]


def test_gbs_identity_with_no_sync_on_two_processes(job: dict[str, Any]) -> None:
    rows = job["gbs"]
    assert [(r["mbs"], r["k"], r["dp"]) for r in rows] == [(4, 1, 2), (2, 2, 2), (1, 4, 2)]
    A.check(rows)  # on rank 0, with every rank's gradient equal to rank 0's


def test_lightning_and_accelerate_match_lslm_ddp(job: dict[str, Any]) -> None:
    assert set(job) == {"lslm", "lslm_torch_sampler", "accelerate", "lightning", "gbs"}
    assert all(len(job[k]) == STEPS for k in S.FRAMEWORKS)
    diffs = S.max_differences(job)
    assert diffs["accelerate"] <= S.LOSS_ATOL and diffs["lightning"] <= S.LOSS_ATOL, diffs
    assert job["lslm"][-1] < job["lslm"][0] - 0.3  # it learns


def test_script_under_torchrun_matches_lslm_ddp(job: dict[str, Any], tmp_path: Path) -> None:
    assert (shell_line("lslm/recipes/ddp_script.py", ["--steps", "6"])
            == "torchrun --nproc-per-node=2 lslm/recipes/ddp_script.py --steps 6")
    args = ["--steps", str(STEPS), "--log-every", "3", "--out", str(tmp_path)]
    lines = torchrun_file(Path(ddp_script.__file__), args, nproc=2, timeout=180, quiet=True)
    # Only rank 0 prints: steps 1, 3, 6 and the checkpoint line, each once.
    assert [ln.split()[1] for ln in lines if ln.startswith("step")] == ["1", "3", "6"]
    assert sum(ln.startswith("saved") for ln in lines) == 1
    losses = json.loads((tmp_path / "losses.json").read_text())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(job["lslm_torch_sampler"]), rtol=1e-5, atol=0)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == STEPS and "lm_head.weight" in state["model"]


def test_torchrun_file_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no script"):
        torchrun_file(tmp_path / "missing.py")
    script = tmp_path / "job.py"
    script.write_text("import os\nraise SystemExit(3 if os.environ['RANK'] == '1' else 0)\n")
    with pytest.raises(LaunchError, match="exited with code"):
        torchrun_file(script, nproc=2, timeout=60, quiet=True)


def test_side_by_side_rejects_unknown_framework() -> None:
    with pytest.raises(ValueError, match="unknown frameworks"):
        S.worker(frameworks=["keras"])
