"""lslm.metrics.flops: training flops, MFU and HFU against hand counts (exact), and the peak table."""

from __future__ import annotations

import pytest
from torch import nn

from lslm.metrics.flops import (
    DEVICE_PEAKS,
    attention_flops,
    gpt_step_flops,
    peak_for,
    throughput,
    training_flops,
)
from lslm.models.gpt import GPT, GPTConfig
from lslm.plan import ModelSpec, hardware_presets
from lslm.plan.timing import model_flops, narayanan_flops

# the course's default GPT: L = 2, h = 64, V = 1024, s = 64; a step of B = 8 sequences, T = 512 tokens
CFG = GPTConfig(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=64)
B, T = 8, 8 * 64
LAYERS = 2 * 12 * 64 * 64  # qkv 3h², proj h², fc 4h², proj 4h² per layer: 98,304
HEAD = 64 * 1024  # 65,536
N = LAYERS + HEAD  # 163,840


def test_n_is_the_weights_of_every_linear_layer_of_lslm_gpt() -> None:
    for tied in (False, True):
        model = GPT(GPTConfig(**{**CFG.__dict__, "tie_weights": tied}))
        linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)}
        assert sum(linear.values()) == N  # a tied head is one weight, counted once either way


def test_model_flops_by_hand() -> None:
    f = gpt_step_flops(CFG, B)
    assert f.tokens == T
    assert 6 * N * T == 503_316_480
    assert 6 * 2 * 64 * 64 * T == 25_165_824  # causal attention: 6·L·h·s per token = 6·L·h·s² per sequence
    assert f.model == f.hardware == 503_316_480 + 25_165_824


def test_causal_attention_is_half_of_dense_and_dense_is_narayanan() -> None:
    assert attention_flops(2, 64, 64, T, causal=False) == 2 * attention_flops(2, 64, 64, T) == 50_331_648
    dense = training_flops(n_layer=2, hidden=64, seq_len=64, layer_matmul_params=LAYERS, head_params=HEAD, tokens=T,
                           causal=False)
    assert dense.model == 503_316_480 + 50_331_648
    spec = ModelSpec(2, 64, 4, 1024, 64, micro_batch=B, global_batch=B)
    assert dense.model == pytest.approx(narayanan_flops(spec), rel=1e-12)  # 72·B·s·L·h²(1 + s/6h + V/12hL)
    assert model_flops(spec) == dense.model  # the calculator counts through the same function (dense)


def test_recomputation_is_hardware_flops_only() -> None:
    full = gpt_step_flops(CFG, B, recompute="full")
    sel = gpt_step_flops(CFG, B, recompute="selective")
    model = 528_482_304
    assert full.model == sel.model == model
    assert full.hardware == model + 2 * LAYERS * T + 2 * 2 * 64 * 64 * T == 637_534_208  # layers' forward again
    assert sel.hardware == model + 2 * 2 * 64 * 64 * T == 536_870_912  # the attention core's forward again
    spec = ModelSpec(2, 64, 4, 1024, 64, micro_batch=B, global_batch=B)
    assert model_flops(spec, "full") == training_flops(n_layer=2, hidden=64, seq_len=64, layer_matmul_params=LAYERS,
                                                       head_params=HEAD, tokens=T, causal=False,
                                                       recompute="full").hardware


def test_mfu_and_hfu_arithmetic() -> None:
    r = throughput(gpt_step_flops(CFG, B, recompute="full"), step_s=0.5, devices=2, peak=1e9, peak_source="test")
    assert r.tokens_per_s == 1024 and r.flops_per_s == 528_482_304 * 2
    assert r.mfu == 528_482_304 / (0.5 * 2 * 1e9) and r.hfu == 637_534_208 / (0.5 * 2 * 1e9)
    line = r.line()
    assert "tokens/s 1024" in line and "TFLOP/s achieved" in line and "MFU 52.8%" in line and "HFU 63.8%" in line
    none = throughput(gpt_step_flops(CFG, B), 0.5, 1, None, "no datasheet peak known")
    assert none.mfu is None and "MFU n/a (no datasheet peak known)" in none.line()
    with pytest.raises(ValueError, match="peak must be finite"):
        throughput(gpt_step_flops(CFG, B), 0.5, 1, float("inf"))


def test_peak_table_by_device_name_and_the_calculator_uses_it() -> None:
    assert peak_for("NVIDIA H100 80GB HBM3", "bf16") == 989e12 and peak_for("NVIDIA H200", "tf32") == 494.5e12
    assert peak_for("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12 and peak_for("NVIDIA H100 PCIe", "bf16") is None
    assert peak_for("NVIDIA L4", "fp32") is None and peak_for("Some GPU", "bf16") is None
    hw = hardware_presets()
    assert hw["h100-sxm"].peak_flops == {p: DEVICE_PEAKS["H100"][p] for p in ("fp32", "bf16", "fp16")}
    assert hw["a100-80gb"].peak_flops["bf16"] == DEVICE_PEAKS["A100"]["bf16"]
