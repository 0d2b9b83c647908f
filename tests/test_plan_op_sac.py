"""recompute="op" (torchtitan's op-level selective checkpointing): kept bytes and recomputed flops by hand."""

from dataclasses import replace

import pytest

from lslm.plan import estimate
from lslm.plan.activations import layer_activation_bytes
from lslm.plan.calibrated import elementwise_bytes, microbatch_times
from lslm.plan.gpu_calibration import H200_CALIBRATION
from lslm.plan.hardware import hardware_presets
from lslm.plan.layout import Layout
from lslm.plan.model import ModelSpec
from lslm.plan.op_sac import op_layer_bytes, op_recompute_flops, op_recomputed_gemms

# T = b s = 2 x 16 = 32 tokens; Llama: h 64, 4 heads of 16, 2 key/value heads (kv width 32), f 96
LLAMA = ModelSpec(2, 64, 4, 128, 16, micro_batch=2, global_batch=2, n_kv_head=2, ffn_hidden=96, arch="llama",
                  dropout=False)
GPT = ModelSpec(2, 64, 4, 128, 16, micro_batch=2, global_batch=2)  # f = 256


def test_kept_bytes_by_hand():
    op = Layout(recompute="op", flash_attention=True)
    # Llama, t = 1, e = 2: input, wq, attention, w2 2·32·64 = 4,096 each; wv 2·32·32 = 2,048; w1 2·32·96 = 6,144;
    # the log-sum-exp 4·32·4 = 512
    assert op_layer_bytes(LLAMA, op) == 4 * 4096 + 2048 + 6144 + 512 == 25088
    assert layer_activation_bytes(LLAMA, op) == 25088
    # t = 2 with SP: input, wq, attention 2,048 each; wv one key/value head 2·32·16 = 1,024; w1 2·32·48 = 3,072;
    # w2's partial sums whole 4,096; log-sum-exp 256; two reduce-scatter outputs 2 x 2,048
    tp2 = Layout(tp=2, sequence_parallel=True, recompute="op", flash_attention=True)
    assert op_layer_bytes(LLAMA, tp2) == 3 * 2048 + 1024 + 3072 + 4096 + 256 + 2 * 2048 == 18688
    # GPT, t = 1: input 4,096, qkv 12,288, attention 4,096, fc1 2·32·256 = 16,384, log-sum-exp 512; no masks
    assert op_layer_bytes(GPT, op) == 4096 + 12288 + 4096 + 16384 + 512 == 37376
    # fp32: every activation 4 bytes
    assert op_layer_bytes(LLAMA, replace(op, precision="fp32")) == 2 * (4 * 4096 + 2048 + 6144) + 512


def test_recomputed_flops_by_hand():
    op = Layout(recompute="op", flash_attention=True)
    # Llama: wk 2·32·32·64 + wo 2·32·64·64 + w3 2·32·96·64 (the 2nd, 4th and 6th matmuls)
    assert op_recompute_flops(LLAMA, op) == 131072 + 262144 + 393216
    assert op_recomputed_gemms(LLAMA, 2) == [("qkv", 16, 64), ("proj", 64, 32), ("fc1", 48, 64)]
    # GPT: proj 2·32·64·64 + fc2 2·32·64·256 (the 2nd and 4th)
    assert op_recompute_flops(GPT, op) == 262144 + 1048576


def test_op_in_the_time_and_memory_model():
    hw = hardware_presets()["h100-sxm"]
    none, op = Layout(flash_attention=True, precision="fp32"), Layout(flash_attention=True, precision="fp32",
                                                                      recompute="op")
    # uncalibrated (fp32): the compute term grows by layers x the recomputed flops / rate, nothing else
    a, b = estimate(LLAMA, none, hw), estimate(LLAMA, op, hw)
    assert b.times["compute"].value - a.times["compute"].value == pytest.approx(
        2 * op_recompute_flops(LLAMA, op) / hw.flops("fp32"), rel=1e-12)
    # memory: 2 layers' kept tensors + the replayed layer's rest (full - kept) against 2 full layers (same ends)
    kept, full = op_layer_bytes(LLAMA, op), layer_activation_bytes(LLAMA, op, "none")
    assert (kept, full) == (49664, 106496)  # fp32: 2 x 24,576 + 512; Llama list 4e·sbh + qkv + proj + 4e·sbf
    assert b.memory.activations.value - a.memory.activations.value == 2 * kept + (full - kept) - 2 * full
    # calibrated (bf16): the recomputed GEMMs at their shapes' efficiencies, the elementwise forward, no attention
    half_none, half_op = replace(none, precision="bf16"), replace(op, precision="bf16")
    n, o = (microbatch_times(LLAMA, lay, H200_CALIBRATION, 2, head=False) for lay in (half_none, half_op))
    gemms = sum(2 * 32 * n_ * k / (H200_CALIBRATION.gemm_efficiency(kind, 32, n_, k) * H200_CALIBRATION.peak_flops)
                for kind, n_, k in op_recomputed_gemms(LLAMA, 1))
    assert o.gemm - n.gemm == pytest.approx(2 * gemms, rel=1e-12)
    assert o.attention == n.attention
    assert o.elementwise - n.elementwise == pytest.approx(2 * 32 * elementwise_bytes(LLAMA, half_op)[0]
                                                          / H200_CALIBRATION.hbm_Bps, rel=1e-12)


def test_op_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="sequence_parallel"):
        Layout(tp=2, recompute="op")
    with pytest.raises(ValueError, match="autocast"):
        Layout(recompute="op", mixed="autocast")
