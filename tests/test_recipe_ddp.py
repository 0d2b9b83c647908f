"""lslm.recipes.ddp and lslm bench ddp: data order, equality with the serial baseline, exact bytes.

Tolerance of the loss comparisons: fp32, ``rtol=RTOL = 1e-5`` on the per-step loss.
A data-parallel step averages per-rank mean gradients instead of taking one mean
over the batch, so its gradients differ from the serial ones by fp32 rounding;
AdamW carries that into the weights. Measured on this model: at most 3.3e-7
relative over 30 steps (2 processes, every variant). A wrong data split or a
missing division by the world size moves the losses by 1e-2 or more.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lslm.data.dataset import batches, token_blocks
from lslm.recipes import ddp as R
from lslm.recipes.train import TrainConfig, train
from tests.helpers import nproc_backends, run_workers

RTOL = 1e-5
STEPS = 8
SMALL = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1024, block_size=64, steps=STEPS, log_every=100)


def _baseline(batch_size: int) -> list[float]:
    cfg = TrainConfig(**{k: v for k, v in SMALL.items()}, batch_size=batch_size)
    return train(cfg)["losses"]


def _ddp(nproc: int, **kwargs: object) -> list[dict]:
    cfg = R.DDPConfig(**{**SMALL, **kwargs})
    R.check_config(cfg, nproc)
    return list(run_workers("lslm.recipes.ddp:worker", nproc, timeout=180, **asdict(cfg)))


# -- validation, before any process starts -----------------------------------------------
def test_bad_settings_raise_value_error_before_launch() -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        R.DDPConfig(variant="allreduce-everything")
    with pytest.raises(ValueError, match="unknown model"):
        R.DDPConfig(model="bert")
    with pytest.raises(ValueError, match="not divisible by 4 processes"):
        R.run(nproc=4, batch_size=6)
    with pytest.raises(ValueError, match="grad_accum"):
        R.check_config(R.DDPConfig(batch_size=8, grad_accum=3), 2)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        R.DDPConfig(bucket_cap_mb=0)


# -- the data order ----------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_baseline_sampler_deals_out_the_serial_batches(world: int) -> None:
    data = token_blocks(64, 1024)
    global_batch = 8
    for epoch in (0, 1):
        serial = batches(data, global_batch, seed=3, epoch=epoch)
        per_rank = []
        for r in range(world):
            sampler = R.make_sampler(data, "baseline", rank=r, world_size=world, seed=3)
            sampler.set_epoch(epoch)
            per_rank.append(iter(DataLoader(data, batch_size=global_batch // world, sampler=sampler, drop_last=True)))
        for _ in range(5):
            x, y = next(serial)
            want = sorted(map(tuple, torch.cat([x, y[:, -1:]], 1).tolist()))
            got = sorted(map(tuple, torch.cat([next(it)["input_ids"] for it in per_rank]).tolist()))
            assert got == want


def test_torch_sampler_needs_set_epoch_to_reshuffle() -> None:
    data = list(range(20))
    s = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0, drop_last=True)
    first, again = list(s), list(s)
    s.set_epoch(1)
    assert first == again and list(s) != first
    ranks = [list(DistributedSampler(data, num_replicas=2, rank=r, seed=0)) for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == data  # disjoint shares that cover the epoch


# -- training equals the serial baseline ------------------------------------------------------
VARIANTS = ("naive", "fused", "bucketed", "torch")


@pytest.fixture(scope="module")
def every_variant() -> dict[str, list[dict]]:
    """All four variants trained in one 2-process launch (recipe.compare), by variant, one record per rank."""
    res = R.run(2, runs=[{"variant": v} for v in VARIANTS], output="none", timeout=300,
                **{**SMALL, "batch_size": 8, "bucket_cap_mb": 0.1})
    return {v: [res[rank][i] for rank in range(2)] for i, v in enumerate(VARIANTS)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_process_ddp_reproduces_the_serial_run(variant: str, every_variant: dict[str, list[dict]]) -> None:
    base = _baseline(8)
    res = every_variant[variant]
    assert [r["variant"] for r in res] == [variant] * 2
    assert res[0]["losses"] == res[1]["losses"]  # every rank reports the same global loss
    assert res[0]["losses"] == pytest.approx(base, rel=RTOL)
    for r in res:
        # The ranks see different rows, so their own losses differ; their mean is the global loss.
        assert r["local_losses"] != res[1 - r["rank"]]["local_losses"]
        assert len(r["step_s"]) == len(r["compute_s"]) == len(r["comm_exposed_s"]) == STEPS
        _assert_durations_add_up(r)
        assert r["memory"]["model_state"]["params"] == 4 * r["num_parameters"]
        assert r["throughput"]["devices"] == 2 and r["throughput"]["mfu"] > 0  # the harness's MFU, every recipe
        if variant != "torch":
            # The ledger: exactly the gradient bytes all-reduced in every step.
            assert r["comm_bytes"] == [r["grad_bytes"]] * STEPS == [4 * r["num_parameters"]] * STEPS
    if variant in ("fused", "bucketed"):
        assert len(res[0]["buckets"]) > 1 and res[0]["comm_calls"] == [len(res[0]["buckets"])] * STEPS
    for r in res:
        # Memory by owner: the wrappers' bucket buffers are visible. Bucketed reduces the gradient buffer itself
        # (the recipe's default main_grad): no second Ψ, the buffer counted once, as the gradients.
        comm_buffers = r["memory"]["by_owner"]["resident"].get("comm_buffers", {})
        assert r["memory"]["by_owner"]["resident"]["parameters"] == {"cpu": 4 * r["num_parameters"]}
        if variant == "bucketed":
            assert sum(comm_buffers.values()) == 0
            assert r["memory"]["by_owner"]["resident"]["gradients"] == {"cpu": r["grad_bytes"]}
        elif variant in ("naive", "torch"):
            assert sum(comm_buffers.values()) == 0


def _assert_durations_add_up(r: dict) -> None:
    """Every step: compute and exposed communication are non-negative, and together fit inside the step."""
    for compute, exposed, step in zip(r["compute_s"], r["comm_exposed_s"], r["step_s"]):
        assert compute >= 0 and exposed >= 0 and compute + exposed <= step


def test_split_compute_comm_is_spans_between_ordered_marks() -> None:
    from lslm.harness import Marks

    m = Marks({"start": 10.0, "forward_end": 10.5, "grads_ready": 11.5, "backward_end": 11.75, "sync_end": 12.0,
               "end": 12.5})
    assert R.split_compute_comm(m, in_reducer=False) == {"compute_s": 1.75, "comm_exposed_s": 0.25}
    assert R.split_compute_comm(m, in_reducer=True) == {"compute_s": 1.5, "comm_exposed_s": 0.5}
    no_grads = Marks({k: v for k, v in m.times.items() if k != "grads_ready"})
    with pytest.raises(ValueError, match="grads_ready"):
        R.split_compute_comm(no_grads, in_reducer=True)


@pytest.mark.parametrize("nproc,backend", nproc_backends(1, 2))
def test_torch_ddp_exposed_comm_is_never_negative(nproc: int, backend: str) -> None:
    # torch's DDP communicates inside backward(): the recipe splits it at the last gradient accumulated (a hook),
    # in the same step. Step 0 pays the warm-up, which the former separate no_sync probe read as negative comm.
    cfg = R.DDPConfig(**{**SMALL, "steps": 3}, batch_size=8, variant="torch", grad_accum=2, bucket_cap_mb=0.1)
    res = run_workers("lslm.recipes.ddp:worker", nproc, backend=backend, timeout=180, **asdict(cfg))
    for r in res:
        assert len(r["comm_exposed_s"]) == 3
        _assert_durations_add_up(r)


def test_four_processes_with_gradient_accumulation() -> None:
    base = _baseline(16)
    res = _ddp(4, batch_size=16, variant="bucketed", grad_accum=2, bucket_cap_mb=0.25)
    assert res[0]["losses"] == pytest.approx(base, rel=RTOL)
    # no_sync() on the first micro-batch: still one gradient all-reduce per step.
    assert res[0]["comm_bytes"] == [res[0]["grad_bytes"]] * STEPS


def test_timeline_of_bucketed_run() -> None:
    res = _ddp(2, batch_size=8, variant="bucketed", bucket_cap_mb=0.25, record_timeline=True, steps=2)
    for r in res:
        step = r["timeline"][-1]
        assert step["t0"] <= step["forward_end"] <= step["backward_end"] <= step["sync_end"] <= step["step_end"]
        ready = [e for e in step["events"] if e["event"] == "bucket_ready"]
        done = [e for e in step["events"] if e["event"] == "allreduce_done"]
        assert len(ready) == len(done) == len(r["buckets"])
        assert sum(e["bytes"] for e in ready) == r["grad_bytes"]
        assert all(e["t"] <= step["sync_end"] for e in done)


def test_hf_gpt2_two_processes_match_one(tmp_path) -> None:
    kwargs = dict(model="hf_gpt2", batch_size=4, steps=4, variant="fused", bucket_cap_mb=0.5)
    one = _ddp(1, **kwargs)
    out = tmp_path / "hf.json"
    two = R.main(["--nproc", "2", "--model", "hf_gpt2", "--batch-size", "4", "--steps", "4", "--variant", "fused",
                  "--bucket-cap-mb", "0.5", "--n-layer", "2", "--n-embd", "64", "--out", str(out)])
    assert two[0]["losses"] == pytest.approx(one[0]["losses"], rel=RTOL)
    log = json.loads(out.read_text())
    assert log["losses"] == two[0]["losses"] and [r["rank"] for r in log["ranks"]] == [0, 1]
    assert log["config"]["model"] == "hf_gpt2"


# -- the benchmark, quick mode: structure and exact bytes only (never timings) ------------------
def test_bench_quick_structure_and_exact_bytes(tmp_path, capsys) -> None:
    from lslm.cli import main

    assert main(["bench", "ddp", "--quick", "--nprocs", "2", "--out", str(tmp_path), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    lines = printed.strip().splitlines()
    assert lines[-1].startswith("bucketed / torch DDP step time") and "2 processes" in lines[-1]
    assert lines[-2].startswith("buffered / torch DDP step time") and "2 processes" in lines[-2]
    assert (tmp_path / "ddp.txt").read_text() == printed  # the .txt is exactly what the bench printed
    assert "== 2 processes (gloo, 1 thread(s)/rank)" in printed
    assert any(x.startswith("  bucketed ") and ": tokens/s " in x and ", MFU " in x for x in lines)  # the harness's
    data = json.loads((tmp_path / "ddp.json").read_text())
    res = data["2"]
    assert (tmp_path / "ddp.png").stat().st_size > 0
    variants = {(r["variant"], r["bucket_mb"]) for r in res["rows"]}
    mb = res["bucket_cap_mb"]
    assert {(v, mb) for v in ("naive", "fused", "bucketed", "buffered", "torch", "local")} <= variants
    assert ("buffered", 0.25) not in variants  # the sweep is the plain bucketed one's
    main = {r["variant"]: r for r in res["rows"] if r["bucket_mb"] == mb}
    # The gradient buffer is bucketed at the same cap with the same plan: same buckets, same bytes.
    assert main["buffered"]["num_buckets"] == main["bucketed"]["num_buckets"]
    assert main["buffered"]["grad_bytes"] == main["bucketed"]["grad_bytes"] == res["grad_bytes"]
    # Same weights, data and steps: the buffer changes where gradients live, not the update (2 ranks: a + b is
    # the same sum wherever an element sits in its bucket, so the weights agree exactly).
    assert res["buffered_vs_bucketed_max_weight_diff"] == 0.0
    assert {("bucketed", 0.25), ("bucketed", 1.0)} <= variants
    for r in res["rows"]:
        assert len(r["step_ms_all"]) == res["steps"] and r["step_ms"] > 0
        if r["variant"] in ("naive", "fused", "bucketed", "buffered"):
            assert r["ledger_exact"], r
            assert r["ledger_bytes_per_step"] == [res["grad_bytes"]] * res["steps"]
    assert res["torch_hook_exact"] and res["torch_hook_bytes_per_step"][0] == res["grad_bytes"]
    assert sum(res["bucket_bytes"]) == res["grad_bytes"]
    assert isinstance(res["hidden_fraction"], float)
    assert len(res["timeline"]) == 2 and all(tl["events"] for tl in res["timeline"])
