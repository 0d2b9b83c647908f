"""lslm.metrics.step_memory: a step's memory read from the allocator (glibc on CPU) and PyTorch's memory profiler.

One process: a Linear layer's forward/backward and AdamW step. Measured in steady state (Adam's states exist), the
step frees last step's gradients and makes new ones of the same size, so it ends where it began; its peak is AdamW's
update of the weight, whose denominator ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` holds two temporaries of the
weight's size at once. glibc adds chunk headers and whatever Python allocates meanwhile: 32 KiB of slack on 2 MiB.
The profiler's categories at its peak hold the parameters, gradients and optimizer states, byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from lslm.metrics import StepMemory, measure_step_memory
from lslm.metrics.malloc import malloc_in_use_bytes
from lslm.metrics.zero3_window import zero3_freed_bytes, zero3_saving_vs_stage2, zero3_window_bytes

SLACK = 32 * 1024


def _linear_step() -> tuple[torch.nn.Linear, object]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(16, 512)  # lslm: cpu-ok (the measurement under test is glibc's)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lin(x).square().sum().backward()
        opt.step()
    for _ in range(2):  # Adam's states, and the kernels' own first-call allocations, exist from here on
        step()
    return lin, step


@pytest.mark.skipif(malloc_in_use_bytes() is None, reason="glibc's mallinfo2 is needed to read the allocator")
def test_a_linear_adamw_step_by_glibc_and_by_the_profiler() -> None:
    lin, step = _linear_step()
    weight, bias = (4 * p.numel() for p in (lin.weight, lin.bias))
    m = measure_step_memory(step, "cpu")
    assert isinstance(m, StepMemory) and m.source == "malloc" and m.categories is None
    assert abs(m.after - m.before) <= SLACK, m
    assert abs(m.step_peak - 2 * weight) <= SLACK, (m.step_peak, 2 * weight)
    p = measure_step_memory(step, torch.device("cpu"), categories=True)
    assert p.source == "malloc+profiler" and p.categories_error is None
    cats = p.categories
    assert cats["parameter"] == weight + bias
    assert cats["gradient"] == weight + bias
    assert cats["optimizer_state"] == 2 * (weight + bias) + 2 * 4  # exp_avg, exp_avg_sq and a float32 step each
    assert p.profiled_peak == sum(cats.values())
    # The profiler's own records are malloc'ed too: the peak it reads is no lower than without it.
    assert p.step_peak >= 2 * weight - SLACK


def test_bad_device_and_the_window_formulas() -> None:
    with pytest.raises(ValueError, match="allocator"):
        measure_step_memory(lambda: None, "meta")
    units, root = [10, 20, 30, 40], 5  # forward order: the backward starts with 40 and gathers 30 ahead
    assert zero3_window_bytes(units, root) == 5 + 40 + 30
    assert zero3_window_bytes(units, root, gather_copy=True) == 5 + 40 + 30 + 30
    assert zero3_window_bytes(units, root, prefetch=0) == 45
    assert zero3_freed_bytes(units) == 10 + 20
    assert zero3_freed_bytes(units, gather_copy=True) == 0
    assert zero3_saving_vs_stage2(1000, 800, 4, units, root) == 1000 - 200 - 75
    with pytest.raises(ValueError, match="prefetch"):
        zero3_window_bytes(units, root, prefetch=-1)
    with pytest.raises(ValueError, match="empty"):
        zero3_freed_bytes([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's path needs a GPU (make gpu-check)")
def test_a_linear_adamw_step_by_the_cuda_allocator() -> None:
    """The same step on a GPU, read from torch.cuda's allocator: in steady state it ends where it began, and its
    peak is AdamW's two weight-sized temporaries plus the activations (32 KiB), rounded by the caching allocator."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 512, bias=False, device=device)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(16, 512, device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lin(x).square().sum().backward()
        opt.step()
    for _ in range(2):  # Adam's states and cuBLAS's workspace exist from here on
        step()
    weight = 4 * lin.weight.numel()
    m = measure_step_memory(step, device)
    assert m.source == "cuda" and m.after == m.before, m
    assert 2 * weight <= m.step_peak <= 2 * weight + 256 * 1024, (m.step_peak, 2 * weight)
