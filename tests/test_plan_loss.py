"""The loss's temporaries per framework (lslm.plan.activations, "The loss"): the hand count against the CPU
allocator's peak of the loss's forward + backward alone, and what each style adds to a stage's memory."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lslm.metrics.step_memory import measure_step_memory
from lslm.plan.activations import last_stage_extra_bytes, loss_moments_per_logit
from lslm.plan.autocast import autocast_activations
from lslm.plan.layout import Layout
from lslm.plan.memory import layer_linear_params
from lslm.plan.model import ModelSpec

B, S, V, H = 2, 32, 20_000, 8  # 1.3M logits: the loss's tensors dwarf the head's (H x V) and the allocator's noise


def _steps():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H, generator=g).to(torch.bfloat16)  # lslm: cpu-ok (a CPU allocator measurement)
    w = torch.randn(H, V, generator=g).to(torch.bfloat16).requires_grad_()  # lslm: cpu-ok (as above)
    y = torch.randint(0, V, (B, S), generator=g)  # lslm: cpu-ok (as above)

    def lslm():  # lslm's GPT: F.cross_entropy(logits.float().flatten(0, 1)); the caller keeps the logits
        logits = x @ w
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        w.grad = None
        return logits

    def torchtitan():  # torchtitan: cross_entropy(pred.flatten(0, 1).float()); del pred; loss.backward()
        pred = x @ w
        loss = F.cross_entropy(pred.flatten(0, 1).float(), y.flatten(0, 1))
        del pred
        loss.backward()
        w.grad = None

    return {"lslm": lslm, "torchtitan": torchtitan}


def test_loss_peak_matches_the_hand_count_on_cpu():
    steps = _steps()
    measure_step_memory(steps["torchtitan"], "cpu")  # warm-up: the first measured call's one-off allocations
    for style, step in steps.items():
        m = measure_step_memory(step, "cpu")
        if m.step_peak is None:
            pytest.skip("no glibc allocator reading on this platform")
        expected = max(loss_moments_per_logit(style, 2).values()) * B * S * V  # 14 and 12 bytes per logit
        assert m.step_peak == pytest.approx(expected, rel=0.02), style


def test_each_style_in_the_memory_model():
    assert loss_moments_per_logit("lslm", 2) == {"forward end": 10, "loss backward": 14}
    assert loss_moments_per_logit("torchtitan", 2) == {"forward end": 10, "loss backward": 12}
    with pytest.raises(ValueError, match="loss"):
        ModelSpec(2, 64, 4, 100, 16, loss="megatron")
    lslm = ModelSpec(2, 64, 4, 1000, 16, micro_batch=2, global_batch=2, dropout=False)
    titan = replace(lslm, loss="torchtitan")
    sbv = 16 * 2 * 1000
    half = Layout(flash_attention=True, precision="bf16")
    # half weights: lslm's count stays the fp32 logits (4 per logit), torchtitan's is 12
    assert last_stage_extra_bytes(titan, half) - last_stage_extra_bytes(lslm, half) == 8 * sbv
    # autocast: the same moments, less the caller's bf16 logits from the loss's backward on for torchtitan
    auto = Layout(flash_attention=True, mixed="autocast")
    a, t = (autocast_activations(m, auto, 1, 0, "none", layer_linear_params(m, 1)) for m in (lslm, titan))
    assert a.moments["forward end"] == t.moments["forward end"]
    assert a.moments["loss backward"] - t.moments["loss backward"] == 2 * sbv
    assert (a.after_backward, t.after_backward) == (2 * sbv, 0.0)
