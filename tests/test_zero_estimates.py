"""ZeRO's model-state formulas: the paper's, lslm's exact count, DeepSpeed's estimator rows re-derived."""

from __future__ import annotations

import pytest

from lslm.metrics.zero_estimates import deepspeed_zero2_estimate, deepspeed_zero3_estimate, lslm_bytes, paper_bytes

GiB = 2**30


def test_the_paper_s_rows_for_its_own_example() -> None:
    # ZeRO paper, Figure 1: Ψ = 7.5 B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    psi, n = 7.5e9, 64
    assert [round(paper_bytes(s, psi, n) / 1e9, 1) for s in (0, 1, 2, 3)] == [120.0, 31.4, 16.6, 1.9]


def test_lslm_matches_the_paper_when_gradients_are_half_and_nothing_is_padded() -> None:
    psi, n = 1_000_000, 8
    for stage in (1, 2, 3):
        assert lslm_bytes(stage, psi, psi // n, n, grad_bytes=2) == paper_bytes(stage, psi, n)
    # fp32 main_grad (the default) costs 2 more bytes per gradient element than the paper counts
    assert lslm_bytes(1, psi, psi // n, n) - paper_bytes(1, psi, n) == 2 * psi
    with pytest.raises(ValueError, match="multiple of n"):
        lslm_bytes(1, psi + 1, psi // n, n)


def test_deepspeed_s_documented_zero3_rows_for_t5_small_on_one_gpu() -> None:
    # DeepSpeed's estimate_zero3_model_states_mem_needs_all_live(t5-small, 1 GPU), as its users print it:
    # 60M total, 16M largest layer; per CPU | per GPU (GiB, 2 decimals) in its printing order.
    rows = deepspeed_zero3_estimate(60_506_624, 16_449_536, gpus_per_node=1)
    printed = [(round(r.cpu_bytes / GiB, 2), round(r.gpu_bytes / GiB, 2)) for r in rows]
    assert printed == [(1.52, 0.06), (1.52, 0.06), (1.35, 0.17), (1.35, 0.17), (0.09, 1.08), (0.34, 1.08)]


def test_gpt2_small_on_eight_gpus() -> None:
    """GPT-2 small (124,439,808 parameters tied; the largest layer the 50,257 x 768 embedding) on one node of 8."""
    psi, largest, n = 124_439_808, 50_257 * 768, 8
    z2 = deepspeed_zero2_estimate(psi, gpus_per_node=n)
    assert z2[1].gpu_bytes == 2 * psi + 18 * psi // n  # fp16 weights whole, the 18 bytes partitioned
    z3 = deepspeed_zero3_estimate(psi, largest, gpus_per_node=n)
    assert z3[4].gpu_bytes == 4 * largest + 18 * psi // n
    # DeepSpeed's stage 3 without offload against lslm's exact stage 3 in bf16 with fp32 main_grad: the same
    # partitioned 2 + 4 + 4 + 8 = 18 bytes per element (lslm: 2 params + 4 grads + 4 masters + 8 moments), the
    # gathered largest layer aside (lslm gathers a whole block in the model's dtype, not the largest layer in fp32).
    numel = psi + (-psi) % n
    assert lslm_bytes(3, numel, psi // n, n) == 18 * numel // n
    assert z3[4].gpu_bytes - lslm_bytes(3, numel, psi // n, n) == 4 * largest
