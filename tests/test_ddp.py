"""lslm.data_parallel.ddp: every variant equals one process and torch's DDP, exact ledger bytes, clear errors.

Launches dominate the run time, so each world size runs everything in one launch
(``tests.ddp_workers:suite``, cached per world size) and the tests below assert on
its results. The model is the tiny lslm GPT (dropout 0), trained 3 SGD steps
(lr 0.1, momentum 0.9) on 2 rows x 16 tokens per rank and micro-batch, with
``bucket_cap_mb=0.05`` so fused and bucketed use 14 buckets.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lslm.data_parallel.ddp import (
    VARIANTS,
    BucketedDDP,
    FusedDDP,
    NaiveDDP,
    TorchDDP,
    cap_bytes,
    make_ddp,
    plan_buckets,
    tensor_digest,
)
from lslm.demos.ddp_memory import ddp_memory_rows
from lslm.metrics.malloc import malloc_in_use_bytes
from lslm.models.gpt import GPT, GPTConfig
from tests.helpers import run_workers

# fp32 tolerance on parameters after 3 steps. The sums behind each gradient run in
# another order than in one process (per-rank partial sums, then the all-reduce's
# order), so results differ by rounding: the largest difference observed is 1 ulp of
# a LayerNorm weight near 1.0 (1.2e-7). 1e-6 is ~8 ulp there, far below any real bug
# (a missing division or a skipped bucket moves parameters by >= 1e-3 here).
ATOL = 1e-6
OURS = ("naive", "fused", "bucketed")
TINY_GPT = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1024, block_size=64)  # notebook 04's


@functools.cache
def _suite(nproc: int) -> tuple[dict[str, Any], ...]:
    return tuple(run_workers("tests.ddp_workers:suite", nproc, timeout=300))


def _cases(nproc: int) -> list[tuple[int, str, dict[str, Any]]]:
    return [(rank, name, case) for rank, res in enumerate(_suite(nproc)) for name, case in res["cases"].items()]


# -- pure functions, bad arguments (no processes) ----------------------------------------
def test_buckets_are_reverse_order_capped_and_split_by_dtype() -> None:
    assert plan_buckets([4, 4, 4, 4], cap=8) == [[3, 2], [1, 0]]
    assert plan_buckets([4, 100, 4, 4], cap=8) == [[3, 2], [1], [0]]  # larger than the cap: alone
    assert plan_buckets([4, 4, 4], cap=100, keys=["f32", "bf16", "bf16"]) == [[2, 1], [0]]
    assert plan_buckets([], cap=8) == []
    assert cap_bytes(0.05) == int(0.05 * 2**20)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "25"])
def test_bad_bucket_cap_is_rejected_before_any_communication(bad: Any) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number > 0"):
        make_ddp(model, None, variant="bucketed", bucket_cap_mb=bad)  # ctx=None: it never gets that far
    for cls in (FusedDDP, BucketedDDP, TorchDDP):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            cls(model, None, bucket_cap_mb=bad)


def test_unknown_variant_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown DDP variant 'ring'.*naive.*fused.*bucketed.*torch"):
        make_ddp(nn.Linear(2, 2), None, variant="ring")
    assert VARIANTS == ("naive", "fused", "bucketed", "torch")
    assert NaiveDDP.variant == "naive"


def test_tensor_digest_is_bitwise() -> None:
    a = torch.tensor([0.0, 1.0, 2.5])
    assert tensor_digest(a) == tensor_digest(a.clone())
    assert tensor_digest(a) != tensor_digest(torch.tensor([-0.0, 1.0, 2.5]))  # equal as numbers, not as bits
    assert tensor_digest(a) != tensor_digest(a.double())
    assert tensor_digest(a) != tensor_digest(a.view(3, 1))
    assert tensor_digest(torch.ones(2, dtype=torch.bfloat16)) == tensor_digest(torch.ones(2, dtype=torch.bfloat16))


def test_tiny_gpt_has_no_dropout() -> None:
    assert GPTConfig.tiny().dropout == 0.0  # so one process and n processes compute the same function


# -- multi-process: correctness -----------------------------------------------------------
@pytest.mark.parametrize("nproc", [2, 4])
def test_every_variant_equals_one_process_and_torch_ddp(nproc: int) -> None:
    names = {name for _, name, _ in _cases(nproc)}
    assert names == {f"{v}/accum{a}" for v in (*VARIANTS, "torch+ledger") for a in (1, 2)}
    for rank, name, case in _cases(nproc):
        assert case["max_diff_ref"] <= ATOL, (rank, name, case["max_diff_ref"])
        assert case["max_diff_torch"] <= ATOL, (rank, name, case["max_diff_torch"])
        if nproc == 2:
            # Two ranks: a+b == b+a, and dividing by 2 is exact, so ours equals torch's
            # (which divides before summing) bit for bit.
            assert case["max_diff_torch"] == 0.0, (rank, name)


@pytest.mark.parametrize("nproc", [2, 4])
def test_replicas_are_bitwise_identical_after_every_step(nproc: int) -> None:
    for rank, name, case in _cases(nproc):
        assert case["in_sync"] == [None, None, None], (rank, name, case["in_sync"])  # hash all-gather per step


# -- multi-process: communication volume -----------------------------------------------------
@pytest.mark.parametrize("nproc", [2, 4])
def test_ledger_all_reduced_bytes_equal_gradient_bytes(nproc: int) -> None:
    res = _suite(nproc)[0]
    grad_bytes = 4 * res["param_numel"]  # fp32, every parameter trains
    for rank, name, case in _cases(nproc):
        where = (rank, name)
        assert case["grad_bytes"] == grad_bytes, where
        assert case["broadcast_bytes"] == grad_bytes, where  # rank 0's weights, once (the GPT has no buffers)
        assert case["bytes_no_sync"] == [0, 0, 0], where  # accumulation micro-batches: nothing on the wire
        expected = [0] * 3 if name.startswith("torch/") else [grad_bytes] * 3  # torch's reducer bypasses the ledger
        assert case["bytes_sync"] == expected, where
        if name.startswith("naive"):
            assert case["calls_sync"] == [len(res["param_names"])] * 3, where
        if name.startswith(("fused", "bucketed")):
            assert case["calls_sync"] == [len(case["buckets"])] * 3 and len(case["buckets"]) > 5, where


def test_buckets_follow_reverse_parameter_order() -> None:
    res = _suite(2)[0]
    fused, bucketed = res["cases"]["fused/accum1"]["buckets"], res["cases"]["bucketed/accum1"]["buckets"]
    assert fused == bucketed
    assert [n for b in bucketed for n in b] == res["param_names"][::-1]
    assert bucketed[0] == ["lm_head.weight"] and bucketed[-1] == ["wte.weight"]  # 256 KiB > cap: alone
    assert res["cases"]["naive/accum1"]["buckets"] == [[n] for n in res["param_names"]]
    assert sorted(n for b in res["cases"]["torch+ledger/accum1"]["buckets"] for n in b) == sorted(res["param_names"])


@pytest.mark.parametrize("nproc", [2, 4])
def test_bucketed_overlaps_backward_and_records_a_timeline(nproc: int) -> None:
    for res in _suite(nproc):
        case = res["cases"]["bucketed/accum1"]
        assert case["overlap"] == [True, True, True]  # bucket 0 went out before backward returned
        nb = len(case["buckets"])
        for step, events in enumerate(case["timeline"]):
            ready = {e["bucket"]: e for e in events if e["event"] == "bucket_ready"}
            done = {e["bucket"]: e for e in events if e["event"] == "allreduce_done"}
            assert sorted(ready) == sorted(done) == list(range(nb))
            assert sum(e["bytes"] for e in done.values()) == case["grad_bytes"]
            assert all(ready[b]["t"] <= done[b]["t_start"] <= done[b]["t"] for b in range(nb))
            assert {e["step"] for e in events} == {step}


# -- multi-process: memory by owner --------------------------------------------------------
def _bucket_bytes(res: dict[str, Any], buckets: list[list[str]]) -> list[int]:
    """Bytes of each bucket's flat buffer, by hand from the plan: fp32, Σ numel of its parameters."""
    return [4 * sum(res["param_numels"][n] for n in bucket) for bucket in buckets]


def _mem(case: dict[str, Any], category: str, kind: str = "resident") -> int:
    return sum(case["memory"][kind][category].values())


def test_registered_comm_buffers_equal_the_bucket_plan() -> None:
    for rank, res in enumerate(_suite(2)):
        psi = 4 * res["param_numel"]
        for name, case in res["cases"].items():
            where = (rank, name)
            sizes = _bucket_bytes(res, case["buckets"])
            expected = {"bucketed": sum(sizes), "fused": max(sizes) if sizes else 0}.get(name.split("/")[0], 0)
            if name.startswith("bucketed"):
                assert expected == case["grad_bytes"] == psi, where  # one flat buffer per bucket: 1 Psi in all
            assert _mem(case, "comm_buffers") == _mem(case, "comm_buffers", "logical") == expected, where
            assert list(case["memory"]["resident"]["comm_buffers"]) == ([] if expected == 0 else ["cpu"]), where
            # SGD with momentum after 3 steps: params, grads, one momentum buffer each, Psi bytes apiece.
            for category in ("parameters", "gradients", "optimizer_states"):
                assert _mem(case, category) == _mem(case, category, "logical") == psi, (where, category)
            if name.startswith("torch/"):  # torch's reducer buckets: not registered, sized by torch itself
                assert sum(case["reducer_bucket_bytes"]) == psi, where


def test_memory_by_owner_bucketed_adamw_hand_count() -> None:
    for rank, res in enumerate(_suite(2)):
        case = res["memory_adamw"]
        psi, tensors = res["param_numel"], case["num_param_tensors"]
        assert _mem(case, "parameters") == _mem(case, "gradients") == 4 * psi, rank
        assert _mem(case, "optimizer_states") == 2 * 4 * psi + 4 * tensors, rank  # exp_avg, exp_avg_sq, step
        sizes = _bucket_bytes(res, case["buckets"])
        assert len(sizes) > 5 and _mem(case, "comm_buffers") == sum(sizes) == 4 * psi, rank
        # 16 Psi of model states (fp32 AdamW) + 4 Psi of buckets, plus the step scalars.
        assert case["memory"]["total_resident"] == case["memory"]["total_logical"] == 20 * psi + 4 * tensors, rank


@pytest.mark.skipif(malloc_in_use_bytes() is None, reason="glibc's mallinfo2 is needed to read the allocator")
def test_allocator_agrees_with_the_counted_buckets_and_states_at_2_ranks() -> None:
    # One process as rank 0 of 2 (fake backend): glibc's bytes for each piece the notebook counts. The allocator
    # adds per-tensor and per-module records and chunk headers (tens of kB on 0.9 MB): never below, within 5 %.
    rows = {r["what"].split(" (")[0]: r for r in ddp_memory_rows(TINY_GPT, world_size=2, bucket_cap_mb=0.1)}
    assert set(rows) == {"parameters", "gradient buckets", "AdamW states", "copying buckets"}
    psi = rows["parameters"]["counted"] // 4
    assert rows["gradient buckets"]["counted"] == rows["copying buckets"]["counted"] == 4 * psi
    for what, r in rows.items():
        assert 0 <= r["allocator"] - r["counted"] <= 0.05 * r["counted"], (what, r)


# -- multi-process: bad input and unused parameters -----------------------------------------
@pytest.mark.parametrize("nproc", [2, 4])
def test_differing_replicas_without_broadcast_are_named(nproc: int) -> None:
    for res in _suite(nproc):
        msg = res["misuse"]["differ"]
        assert msg.startswith("ValueError: 'wte.weight' differs across ranks"), msg
        assert "broadcast_params=True" in msg
        assert res["misuse"]["same"] == ""  # identical replicas pass the check


@pytest.mark.parametrize("nproc", [2, 4])
def test_unused_parameters_error_by_default_and_work_with_the_option(nproc: int) -> None:
    for res in _suite(nproc):
        misuse = res["misuse"]
        for v in OURS:
            msg = misuse["unused_default"][v]
            assert msg.startswith("RuntimeError:") and "'b.weight', 'b.bias'" in msg, (v, msg)
            assert "find_unused_parameters=True" in msg
        for v in VARIANTS:
            nobody, rank0_only = misuse["unused_option"][f"{v}/0"], misuse["unused_option"][f"{v}/1"]
            assert nobody["max_diff"] <= ATOL and rank0_only["max_diff"] <= ATOL, v
            assert nobody["b_grad_none"] == [True, True], v  # no rank used it: .grad stays None, as in torch
            assert rank0_only["b_grad_none"] == [False, False], v  # rank 0 used it: every rank gets the mean


def test_forgetting_or_repeating_finish_grad_sync_is_an_error() -> None:
    misuse = _suite(2)[0]["misuse"]
    assert "finish_grad_sync() was not called" in misuse["forgot_finish"]
    assert "called again" in misuse["finish_twice"]


def test_model_not_on_the_context_device_is_rejected() -> None:
    ctx = SimpleNamespace(device=torch.device("cuda", 0))  # checked before any communication
    with pytest.raises(ValueError, match=r"'wte.weight' is on cpu .* call model.to\(ctx.device\)"):
        make_ddp(GPT(GPTConfig.tiny(n_layer=1)), ctx, variant="naive")
