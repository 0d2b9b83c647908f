"""Notebook 05's launched demos: a Hugging Face Llama with grouped-query attention tensor-parallel over more ranks
than KV heads (lslm.demos.hf_llama_gqa) against the unsharded model, exact counts and fp32 equality only; the TP
time model (lslm.demos.tp_time_model): its collectives and its arithmetic, no timings."""

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


def test_tp_time_model_counts_the_step_collectives_and_prices_them_with_the_fit() -> None:
    from lslm.demos import tp_time_model as tm

    spec = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    batch, seq = 2, 16
    measured = run_workers("lslm.demos.tp_time_model:tp_worker", 2, timeout=240, models=[spec], batch=batch,
                           seq=seq, steps=1, warmup=0)[0]["models"][0]
    bsh = batch * seq * spec["n_embd"] * 4
    # 4 all-reduces of one (B, T, C) activation per layer, the embedding's (fwd) and the head input's (bwd),
    # the loss's max and its stacked target logits + sums of exponentials.
    assert sorted((op, nbytes, n) for op, nbytes, n, _ in measured["records"]) == sorted(
        [("all_reduce", bsh, 2)] * (4 * spec["n_layer"] + 2) + [("all_reduce", batch * seq * 4, 2),
                                                               ("all_reduce", 2 * batch * seq * 4, 2)])
    assert sum(label.startswith("blocks.") for *_, label in measured["records"]) == 4 * spec["n_layer"]
    assert {"step_s", "comm_s"} <= set(measured)  # times: present, never compared

    compute = run_workers("lslm.demos.tp_time_model:compute_worker", 1, timeout=240, ranks=2, models=[spec],
                          batch=batch, seq=seq, steps=1, warmup=0)[0]["models"][0]
    assert compute["rest_s"] == compute["compute_s"] - spec["n_layer"] * compute["per_layer_s"]

    # The prediction is compute plus the fitted alpha-beta of exactly those collectives.
    fit = {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "gamma_s_per_byte": 0.0}
    pred = tm.predict({"compute_s": 0.0, "per_layer_s": 0.01, "rest_s": 0.002}, measured, fit)
    def ar(nbytes: int) -> float:  # a 2-rank ring all-reduce: 2 messages, 2(n-1)/n = 1 of the bytes
        return 2 * 1e-4 + nbytes * 1e-9

    assert abs(pred["per_layer_comm_s"] - 4 * ar(bsh)) < 1e-12
    assert abs(pred["rest_comm_s"] - (2 * ar(bsh) + ar(batch * seq * 4) + ar(2 * batch * seq * 4))) < 1e-12
    assert abs(pred["predicted_s"] - (0.002 + pred["rest_comm_s"] + 2 * (0.01 + 4 * ar(bsh)))) < 1e-12


def test_tp_time_model_fit_reads_the_committed_collectives() -> None:
    import json

    from lslm.demos import tp_time_model as tm
    from tests.helpers import REPO_ROOT

    fit = tm.fit_gloo(json.loads((REPO_ROOT / "bench" / "results" / "collectives.json").read_text()), 2)
    assert fit["alpha_s"] > 0 and fit["beta_s_per_byte"] > 0
    with pytest.raises(ValueError, match="no torch all_reduce"):
        tm.fit_gloo({"2": {"rows": []}}, 2)
