"""Hugging Face GPT-2 and Llama made tensor-parallel from outside (lslm.tensor_parallel.hf_plans): the same logits
and the same training as the unsharded model, with and without sequence parallelism, at tp = 2 and 4.

Models (``tests.tp_hf_workers``): GPT-2 with the real, odd 50,257-token vocabulary (padded to
50,258 / 50,260), width 32, 4 heads, 2 layers, untied and tied head; Llama with 4 query heads
and 2 or 1 key/value heads (GQA: at tp=4 every KV head is replicated), vocabulary 251. Three
SGD steps (lr 0.1, momentum 0.9) on 2 rows x 16 tokens, next-token loss computed by hand on
both sides (the vocab-parallel loss for the sharded model). One launch per world size runs
every case; the checks of bad sizes run in this process on a fake 4-rank world.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from lslm.models.hf import build_hf_gpt2, build_hf_llama
from lslm.runtime import ParallelContext, RankGrid
from lslm.tensor_parallel.apply import apply_tensor_parallel, plan_for
from lslm.tensor_parallel.hf_plans import gpt2_plan, llama_plan
from lslm.tensor_parallel.layers import ColumnParallelLinear
from tests.helpers import fake_world, nproc_backends, run_workers
from tests.tp_hf_workers import CASES, N_LAYER

# fp32. Every sharded matmul sums in another order than the serial one (per-rank partial
# sums, then the all-reduce or reduce-scatter), so the models drift apart by rounding: the
# largest loss difference seen over 3 steps is 1.9e-6 (2 ulp of a loss near 10.8) and the
# largest logit difference 3.9e-7. A real bug moves them far more: skipping the KV-head
# gradient sync (case llama_kv1_no_sync) already moves the losses by 2.4e-3 and the logits
# by 6e-2; a wrong head layout or a missed reduction moves the first loss by > 1e-2.
LOSS_ATOL = 1e-5
LOGIT_ATOL = 1e-5
# Each feature at least once per world size, kept few: launches on a shared 2-core machine dominate.
RUN = {2: ("gpt2", "gpt2_sp", "gpt2_tied_sp", "llama_kv2", "llama_kv2_sp", "llama_kv1", "llama_kv1_eager_sp",
           "llama_kv1_no_sync", "llama_kv1_buffered"),
       4: ("gpt2", "gpt2_sp", "llama_kv2_sp", "llama_kv1", "llama_kv2_buffered_sp")}


@functools.cache
def _suite(nproc: int, backend: str) -> tuple[dict[str, Any], ...]:
    cases = list(RUN[nproc])
    return tuple(run_workers("tests.tp_hf_workers:suite", nproc, backend=backend, timeout=300, tp=nproc,
                             cases=cases))


def _cases(nproc: int, backend: str) -> list[tuple[int, str, dict[str, Any]]]:
    return [(res["rank"], name, case) for res in _suite(nproc, backend) for name, case in res["cases"].items()]


@pytest.mark.parametrize("nproc, backend", nproc_backends(2, 4))
def test_sharded_model_trains_like_the_unsharded_one(nproc: int, backend: str) -> None:
    seen = set()
    for rank, name, case in _cases(nproc, backend):
        if not CASES[name][3]:  # trained without the gradient sync: see the test below
            continue
        seen.add(name)
        diffs = [abs(a - b) for a, b in zip(case["losses"], case["ref_losses"], strict=True)]
        assert max(diffs) <= LOSS_ATOL, (rank, name, case["losses"], case["ref_losses"])
        assert case["logits_diff"] <= LOGIT_ATOL, (rank, name, case["logits_diff"])  # after training
        assert case["drift"] == 0.0, (rank, name, case["drift"])  # replicated parameters bitwise identical
        assert case["hf_loss_gap"] <= LOSS_ATOL, (rank, name)  # our shifted loss is HF's labels= loss
    assert seen == {c for c in RUN[nproc] if CASES[c][3]}


@pytest.mark.parametrize("nproc, backend", nproc_backends(2, 4))
def test_odd_vocabulary_is_padded_and_the_head_tied_or_not(nproc: int, backend: str) -> None:
    gpt2_padded = {2: 50258, 4: 50260}[nproc]
    for rank, name, case in _cases(nproc, backend):
        padded = gpt2_padded if name.startswith("gpt2") else 252
        assert (case["padded_vocab"], case["local_vocab"]) == (padded, padded // nproc), (rank, name)
        assert case["tied"] == ("tied" in name), (rank, name)


@pytest.mark.parametrize("nproc, backend", nproc_backends(2, 4))
def test_collectives_per_step_are_megatrons(nproc: int, backend: str) -> None:
    # Per forward: the embedding's all-reduce and the loss's two. TP: one all-reduce per
    # row-parallel layer forward, one per attention and MLP input backward (Llama's q, k, v
    # and gate, up share one f at their module's input, like a fused projection). SP
    # (module-level gathers): an all-gather before every attention and MLP and after the final
    # norm, a reduce-scatter after every row layer; the backward mirrors them, plus the
    # all-gather of the sequence split's gradient.
    layers = N_LAYER
    sp = ({"all_reduce": 3, "all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers},
          {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 1})
    want = {"gpt2": ({"all_reduce": 3 + 2 * layers}, {"all_reduce": 2 * layers + 1}),
            "llama": ({"all_reduce": 3 + 2 * layers}, {"all_reduce": 2 * layers + 1})}
    for rank, name, case in _cases(nproc, backend):
        expected = sp if name.endswith("_sp") else want[name.split("_")[0]]
        assert (case["fwd_ops"], case["bwd_ops"]) == expected, (rank, name)


def test_without_the_kv_head_gradient_sync_the_replicas_go_wrong() -> None:
    for rank, _name, case in [c for c in _cases(2, "gloo") if c[1] == "llama_kv1_no_sync"]:
        assert case["losses"][0] == pytest.approx(case["ref_losses"][0], abs=LOSS_ATOL)  # same start
        assert abs(case["losses"][1] - case["ref_losses"][1]) > 100 * LOSS_ATOL, (rank, case["losses"])
        assert case["logits_diff"] > 100 * LOGIT_ATOL, (rank, case["logits_diff"])


# -- plans and bad sizes, in this process (a fake 4-rank world: nothing is communicated) ---------------------
def _fake_ctx(tp: int) -> ParallelContext:
    return ParallelContext.create(RankGrid.build(4, tp=tp), rank=0, local_rank=0, node_rank=0,
                                  device=torch.device("cpu"), backend="fake", timeout_s=5)


def test_plans_are_registered_for_both_classes() -> None:
    gpt2 = build_hf_gpt2(64, 8, 1, 2, 8)
    llama = build_hf_llama(64, 8, 1, 4, 16, 32, num_key_value_heads=2)
    assert plan_for(gpt2).styles == gpt2_plan(gpt2).styles and plan_for(gpt2).tied is None
    assert plan_for(llama).styles == llama_plan(llama).styles
    assert plan_for(build_hf_gpt2(64, 8, 1, 2, 8, tie_word_embeddings=True)).tied == ("lm_head", "transformer.wte")


@pytest.mark.parametrize("build, message", [
    (lambda: build_hf_gpt2(64, 8, 1, 6, 12), r"n_head=6 is not divisible by tp=4"),
    (lambda: build_hf_gpt2(64, 8, 1, 4, 8), None),  # n_inner = 32: fine (control)
    (lambda: build_hf_llama(64, 8, 1, 6, 24, 32, num_key_value_heads=2),
     r"num_attention_heads=6 query heads cannot be split over tp=4"),
    (lambda: build_hf_llama(64, 8, 1, 2, 8, 32, num_key_value_heads=1),
     r"num_attention_heads=2 query heads cannot be split over tp=4"),
    (lambda: build_hf_llama(64, 8, 1, 12, 48, 32, num_key_value_heads=3),
     r"num_key_value_heads=3 key/value heads neither split over tp=4"),
    (lambda: build_hf_llama(64, 8, 1, 4, 16, 30, num_key_value_heads=2), r"intermediate_size=30 is not divisible"),
], ids=["gpt2-heads", "gpt2-ok", "llama-q-heads", "llama-q-fewer-than-tp", "llama-kv-heads", "llama-mlp"])
def test_sizes_that_do_not_divide_fail_before_any_module_is_replaced(build: Any, message: str | None) -> None:
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with fake_world(0, 4):
        ctx = _fake_ctx(4)
        if message is None:
            apply_tensor_parallel(model, ctx)
            assert any(isinstance(m, ColumnParallelLinear) for m in model.modules())
            return
        with pytest.raises(ValueError, match=message):
            apply_tensor_parallel(model, ctx)
    assert not any(isinstance(m, ColumnParallelLinear) for m in model.modules())
    assert getattr(model, "tensor_parallel", None) is None
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
