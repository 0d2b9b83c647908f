"""lslm gpu-check (lslm.bench.gpu_check): the no-GPU exit, the dry run's plan and JSON, the step runner.

The GPU path itself needs a GPU; the dry run exercises its plan (every recipe's settings checked for
its process count) and the calibration code (tiny sizes on the CPU), and writes the same JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lslm.bench import gpu_check
from lslm.bench.calibrate import peak_flops, time_median
from lslm.cli import main as lslm_main
from tests.helpers import forbid_cuda_from_lslm

#: field names of each calibration part in ../shared/gpu/h200_2026-11-28.json (a calculator reads both files)
SHARED_FIELDS = {
    "gemm": {"tokens", "hidden", "gemm", "n", "k", "s", "tflops"},
    "attention": {"head_dim", "seq", "batch", "heads", "s_fwd_bwd", "tflops"},
    "adamw": {"params", "s", "gbytes_per_s"},
    "gpt": {"name", "n_layer", "n_embd", "n_head", "seq", "micro_batch", "vocab", "compiled", "first_step_s",
            "params", "step_s", "tokens_per_s", "mfu", "mem_states_bytes", "mem_peak_bytes", "mem_activation_bytes",
            "reserved_bytes"},
}
#: the recomputation runs (``rows`` of ../shared/gpu/h200_recompute_2026-11-28.json), plus the dtypes they ran in
RECOMPUTE_FIELDS = {"n_layer", "n_embd", "n_head", "micro_batch", "seq", "vocab", "recompute", "params",
                    "mem_states_bytes", "mem_peak_bytes", "mem_activation_bytes", "step_s", "matmul_flops_by_dtype",
                    "attention_calls_by_dtype"}


def _pretend_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_without_a_gpu_it_says_so_and_exits_0(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _pretend_no_gpu(monkeypatch)
    assert lslm_main(["gpu-check", "--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing run, nothing written
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        gpu_check.run_check(tmp_path)


def test_dry_run_lists_every_step_and_writes_the_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    forbid_cuda_from_lslm(monkeypatch)  # the dry run is the CPU path: lslm never touches torch.cuda there
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    [path] = tmp_path.iterdir()
    assert path.name.startswith("gpu-check_dry-run_") and path.suffix == ".json" and f"wrote {path}" in printed
    record = json.loads(path.read_text())
    assert record["dry_run"] is True and record["passed"] is True and record["device"] == "cpu (dry run)"
    names = [s["name"] for s in record["steps"]]
    want = (["tests:cuda", "tests:nccl"] + [f"recipe:{n}" for n, _, _ in gpu_check.RECIPES_AT_ONE]
            + ["recipe:ddp-bucketed-x2", "doctor", "calibrate:gemm", "calibrate:attention", "calibrate:adamw",
               "calibrate:gpt", "calibrate:recompute"])
    assert names == want
    for step in record["steps"]:
        assert step["name"] in printed and step["command"] in printed
        if step["name"].startswith("calibrate:"):
            assert step["ok"] is True and step["duration_s"] >= 0
        else:  # planned only
            assert step["ok"] is None and step["duration_s"] is None and step["command"].startswith("python -m ")
    recipe_cmds = [s["command"] for s in record["steps"] if s["name"].startswith("recipe:")]
    assert all("--device cuda" in c for c in recipe_cmds)
    assert all("--nproc 1 " in c for c in recipe_cmds[1:-1]) and "--nproc 2 " in recipe_cmds[-1]
    assert all(t in record["steps"][0]["command"] for t in gpu_check.CUDA_TESTS)
    for part, fields in SHARED_FIELDS.items():
        assert record[part] and all(fields <= set(row) for row in record[part]), part
    assert all(row["tflops"] > 0 for row in record["gemm"] + record["attention"])
    for row in record["gemm"]:  # the GEMM back to back, and its backward's two shapes: flops over time, each
        for part in ("queued", "dgrad", "wgrad"):
            assert row[f"tflops_{part}"] == pytest.approx(2 * row["tokens"] * row["n"] * row["k"] / row[f"s_{part}"]
                                                          / 1e12)
    assert record["gpt"][0]["mem_peak_bytes"] is None  # the CPU has no allocator statistics
    assert record["gpt"][0]["mfu"] is None  # no peak for a CPU
    runs = record["recompute"]
    assert [r["recompute"] for r in runs] == ["none", "selective", "full"]
    assert all(RECOMPUTE_FIELDS <= set(r) for r in runs)
    assert all(set(r["matmul_flops_by_dtype"]) == {"bfloat16"} for r in runs)  # replays under the forward's autocast
    none, _, full = (r["matmul_flops_by_dtype"]["bfloat16"] for r in runs)
    assert full > none  # the replayed forward's matmuls


def test_only_runs_the_steps_named_and_says_so_in_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_cuda_from_lslm(monkeypatch)
    assert gpu_check.main(["--dry-run", "--only", "calibrate:recompute", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.iterdir()
    assert path.name.endswith("_calibrate-recompute.json")
    record = json.loads(path.read_text())
    assert [s["name"] for s in record["steps"]] == ["calibrate:recompute"] and record["only"] == ["calibrate:recompute"]
    assert "gemm" not in record and len(record["recompute"]) == 3
    steps = gpu_check.plan_steps(2, None)
    assert [s.name for s in gpu_check.select_steps(steps, ["calibrate"])] == [
        f"calibrate:{p}" for p in gpu_check.CALIBRATIONS]
    assert gpu_check.select_steps(steps, []) == steps
    _pretend_no_gpu(monkeypatch)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # a misspelt step is a usage error, even where nothing would run
        lslm_main(["gpu-check", "--only", "calibrate:recompte"])
    assert exit_.value.code == 2 and "no such step" in capsys.readouterr().err


def test_a_recompute_run_in_fp32_fails_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from lslm.bench import calibrate

    runs = [{"name": "x", "recompute": "full", "matmul_flops_by_dtype": {"bfloat16": 1, "float32": 3}}]
    monkeypatch.setattr(calibrate, "gpt_recompute", lambda *a, **k: runs)
    step, record = gpu_check.Step("calibrate:recompute"), {}
    gpu_check._calibrate(step, torch.device("cpu"), calibrate.SIZES["tiny"], None, record)
    assert step.ok is False and "x full: matmuls ran in float32" in step.output_tail and record["recompute"] == runs


def test_step_runner_records_pass_fail_and_timeouts(tmp_path: Path) -> None:
    ok = gpu_check.Step("x", [sys.executable, "-c", "print('hello')"])
    gpu_check._run_command(ok, tmp_path)
    assert (ok.ok, ok.returncode, ok.output_tail.strip()) == (True, 0, "hello") and ok.duration_s >= 0
    assert ok.command == "python -c print('hello')"
    bad = gpu_check.Step("x", [sys.executable, "-c", "raise SystemExit(3)"])
    gpu_check._run_command(bad, tmp_path)
    assert (bad.ok, bad.returncode) == (False, 3)
    none_selected = gpu_check.Step("tests:y", [sys.executable, "-c", "raise SystemExit(5)"])
    gpu_check._run_command(none_selected, tmp_path)
    assert none_selected.ok is True  # pytest's "no test selected": no NCCL case fits this machine's GPUs
    slow = gpu_check.Step("x", [sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    gpu_check._run_command(slow, tmp_path)
    assert slow.ok is False and "timed out" in slow.note


def test_plan_checks_settings_and_names() -> None:
    steps = gpu_check.plan_steps(1, None)  # no tests folder: the test steps are left out
    assert [s.name for s in steps][:2] == ["recipe:train", "recipe:ddp-bucketed"]
    assert not any(s.name.endswith("-x1") for s in steps)
    assert gpu_check.gpu_slug("NVIDIA H200") == "h200"
    assert gpu_check.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("Mystery GPU") is None
    with pytest.raises(ValueError, match="repeats"):
        time_median(lambda: None, torch.device("cpu"), repeats=0)
