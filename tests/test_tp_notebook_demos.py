"""Notebook 05's launched demos against their references: a Hugging Face Llama with grouped-query attention
tensor-parallel over more ranks than KV heads (lslm.demos.hf_llama_gqa), exact counts and fp32 equality only."""

from __future__ import annotations

import pytest

from tests.helpers import nproc_backends, run_workers


@pytest.mark.parametrize(("nproc", "backend"), nproc_backends(4))
def test_llama_gqa_with_more_ranks_than_kv_heads_matches_the_unsharded_model(nproc: int, backend: str) -> None:
    # 4 query heads, 2 KV heads, tp = 4: each rank holds 1 query head and the KV head it uses; each KV head is
    # replicated on 2 ranks. (The notebook runs tp = 2 with 1 KV head.)
    results = run_workers("lslm.demos.hf_llama_gqa:worker", nproc, backend=backend, timeout=240, tp=4,
                          num_key_value_heads=2)
    for r in results:
        head_dim = r["head_dim"]
        assert r["q_proj_rows"] == [head_dim, 4 * head_dim]  # one query head of four
        assert r["k_proj_rows"] == [head_dim, 2 * head_dim]  # one KV head of two: replicated, not split
        assert r["kv_groups"] == [1, 2]
        assert r["local_logits"][-1] * 4 >= r["logits"][-1] == 251  # the odd vocabulary, padded to 252
        # fp32: the parallel sums run in another order than the serial matmuls, a few ulps (measured ~1e-7)
        assert r["logits_max_abs_diff"] < 1e-5 and r["loss_abs_diff"] < 1e-5
        assert max(abs(a - b) for a, b in zip(r["tp_losses"], r["serial_losses"])) < 1e-5
        assert r["kv_grad_syncs_per_step"] == [1, 1, 1]  # one all-reduce of the kv-heads slots per step
        assert r["kv_copies_max_abs_diff"] == 0.0  # the summed gradient keeps the copies bit-identical
