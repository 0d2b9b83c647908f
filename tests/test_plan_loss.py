"""The loss's temporaries per framework (lslm.plan.activations, "The loss"): the hand count against the CPU
allocator's peak of the loss's forward + backward alone, and what each style adds to a stage's memory."""

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lslm.metrics.step_memory import measure_step_memory
from lslm.plan.activations import (
    last_stage_extra_bytes,
    loss_bytes_per_logit,
    loss_moments_per_logit,
    loss_temporary_bytes,
)
from lslm.plan.autocast import autocast_activations
from lslm.plan.layout import Layout
from lslm.plan.memory import layer_linear_params, stage_memory
from lslm.plan.model import ModelSpec
from lslm.runtime.context import ParallelContext
from lslm.runtime.fake_world import fake_world
from lslm.runtime.grid import RankGrid
from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

B, S, V, H = 2, 32, 20_000, 8  # 1.3M logits: the loss's tensors dwarf the head's weight gradient (H x V)


class _InPlaceCrossEntropy(torch.autograd.Function):
    """Megatron-LM's vocabulary-parallel loss at t = 1 (its algorithm, our code): the fp32 logits become the
    softmax and then the gradient, in place."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z.sub_(z.max(dim=-1).values.unsqueeze(-1))
        picked = z.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        torch.exp(z, out=z)
        total = z.sum(dim=-1)
        z.div_(total.unsqueeze(-1))
        ctx.save_for_backward(z, target)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        softmax, target = ctx.saved_tensors
        softmax.scatter_add_(-1, target.unsqueeze(-1), torch.full_like(target, -1, dtype=softmax.dtype).unsqueeze(-1))
        return softmax.mul_(grad.unsqueeze(-1)), None


def _steps(dtype: torch.dtype, ctx: ParallelContext) -> dict[tuple[str, bool], Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H, generator=g).to(dtype)  # lslm: cpu-ok (a CPU allocator measurement)
    w = torch.randn(H, V, generator=g).to(dtype).requires_grad_()  # lslm: cpu-ok (as above)
    y = torch.randint(0, V, (B, S), generator=g)  # lslm: cpu-ok (as above)

    def lslm():  # lslm's GPT: F.cross_entropy(logits.float().flatten(0, 1)); the caller keeps the logits
        logits = x @ w
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        w.grad = None
        return logits

    def lslm_vocab_parallel():  # lslm's GPT under tp > 1: the vocabulary-parallel loss (here one rank's half)
        logits = x @ w[:, : V // 2]
        vocab_parallel_cross_entropy(logits, y.clamp(max=V // 2 - 1), ctx).backward()
        w.grad = None
        return logits

    def torchtitan():  # torchtitan: cross_entropy(pred.flatten(0, 1).float()); del pred; loss.backward()
        pred = x @ w
        loss = F.cross_entropy(pred.flatten(0, 1).float(), y.flatten(0, 1))
        del pred
        loss.backward()
        w.grad = None

    def megatron():  # post_language_model_processing: the half output dies when it returns the loss
        def post() -> torch.Tensor:
            output = x @ w
            return _InPlaceCrossEntropy.apply(output.float(), y).mean()
        post().backward()
        w.grad = None

    return {("lslm", False): lslm, ("lslm", True): lslm_vocab_parallel, ("torchtitan", False): torchtitan,
            ("megatron", False): megatron}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_loss_peak_matches_the_hand_count_on_cpu(dtype):
    e = torch.finfo(dtype).bits // 8
    with fake_world(0, 2):
        ctx = ParallelContext.create(RankGrid.build(2, tp=2), rank=0, local_rank=0, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        steps = _steps(dtype, ctx)
        for step in steps.values():  # warm-up: the first measured call and each loss's first call allocate once
            measure_step_memory(step, "cpu")
        for (style, vocab_parallel), step in steps.items():
            m = measure_step_memory(step, "cpu")
            if m.step_peak is None:
                pytest.skip("no glibc allocator reading on this platform")
            logits = B * S * V // (2 if vocab_parallel else 1)
            expected = max(loss_moments_per_logit(style, e, vocab_parallel).values()) * logits
            # the head's weight gradient (H x V) may be alive at the peak: H/(B S) of a logit's bytes
            assert expected * 0.995 <= m.step_peak <= expected + H * V * e + 0.005 * expected, (style, vocab_parallel)


def test_each_style_in_the_memory_model():
    assert loss_moments_per_logit("lslm", 2) == {"forward end": 10, "loss backward": 14}
    assert loss_moments_per_logit("lslm", 2, vocab_parallel=True) == {"forward end": 10, "loss backward": 12}
    assert loss_moments_per_logit("torchtitan", 2) == {"forward end": 10, "loss backward": 12}
    assert loss_moments_per_logit("megatron", 2) == {"forward end": 6, "loss backward": 6}
    assert loss_moments_per_logit("megatron", 4) == {"forward end": 4, "loss backward": 4}
    with pytest.raises(ValueError, match="loss"):
        ModelSpec(2, 64, 4, 100, 16, loss="deepspeed")
    with pytest.raises(ValueError, match="bytes"):
        loss_moments_per_logit("lslm", 1)
    lslm = ModelSpec(2, 64, 4, 1000, 16, micro_batch=2, global_batch=2, dropout=False)
    titan, megatron = replace(lslm, loss="torchtitan"), replace(lslm, loss="megatron")
    sbv = 16 * 2 * 1000
    half = Layout(flash_attention=True, precision="bf16")
    # half weights: the peak of each style's moments
    assert [loss_bytes_per_logit(m, half) for m in (lslm, titan, megatron)] == [14, 12, 6]
    assert loss_bytes_per_logit(lslm, replace(half, tp=2)) == 12  # lslm's vocabulary-parallel loss
    # what every style saves (the fp32 softmax, Korthikanti's 4sbV/t) is an activation; the rest a buffer
    assert len({last_stage_extra_bytes(m, half) for m in (lslm, titan, megatron)}) == 1
    assert [loss_temporary_bytes(m, half) for m in (lslm, titan, megatron)] == [10 * sbv, 8 * sbv, 2 * sbv]
    peak = stage_memory(titan, half, 1, 0)
    assert peak.buffers["loss temporaries"].value == 8 * sbv
    assert "loss temporaries" not in stage_memory(titan, Layout(flash_attention=True, mixed="autocast"), 1, 0).buffers
    # autocast: the same moments, less the caller's bf16 logits from the loss's backward on for torchtitan
    auto = Layout(flash_attention=True, mixed="autocast")
    a, t = (autocast_activations(m, auto, 1, 0, "none", layer_linear_params(m, 1)) for m in (lslm, titan))
    assert a.moments["forward end"] == t.moments["forward end"]
    assert a.moments["loss backward"] - t.moments["loss backward"] == 2 * sbv
    assert (a.after_backward, t.after_backward) == (2 * sbv, 0.0)
    # under tp, lslm's vocabulary-parallel loss: 12 bytes per logit at its backward, as torchtitan's 12 (whose
    # logits are gone but whose backward holds one more fp32 gradient)
    auto2 = replace(auto, tp=2)
    a2, t2 = (autocast_activations(m, auto2, 1, 0, "none", layer_linear_params(m, 2)) for m in (lslm, titan))
    assert a2.moments == t2.moments and a2.after_backward == 2 * sbv / 2
    with pytest.raises(ValueError, match="masters"):
        autocast_activations(megatron, auto, 1, 0, "none", layer_linear_params(megatron, 1))
