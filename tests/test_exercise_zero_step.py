"""Notebook 08's exercise: the reference ZeRO-1 step passes; each typical mistake fails with its own hint.

All candidates are judged in one launch of 3 processes (``run_checks``): 3 ranks make padding matter
(n = 13, 5, 1 do not divide) and tell a rank's slice from its neighbour's. Memory is judged by what a
rank can reach (a full momentum kept nested or in a default argument fails; a step counter or a cached
buffer passes), communication by the ledger (an all-reduce then a slice sends 1.5x and fails).
"""

from __future__ import annotations

from lslm.exercises import check_zero1_step, reference_zero1_step
from lslm.exercises.core import run_checks
from lslm.exercises.registry import get

WORKER = "lslm.exercises.zero_step:worker"


def zero1_step(param, grad, state, rank, world_size, lr, momentum):
    n = param.numel()
    s = -(-n // world_size)
    padded = torch.zeros(s * world_size)  # noqa: F821 - torch comes from the exercise header
    padded[:n] = grad
    g = torch.empty(s)  # noqa: F821
    dist.reduce_scatter_tensor(g, padded)  # noqa: F821
    m = state.setdefault("m", torch.zeros(s))  # noqa: F821
    m.mul_(momentum).add_(g / world_size)
    full = torch.zeros(s * world_size)  # noqa: F821
    full[:n] = param
    dist.all_gather_into_tensor(full, (full[rank * s:(rank + 1) * s] - lr * m).contiguous())  # noqa: F821
    param.copy_(full[:n])


def zero1_wrong_slice(param, grad, state, rank, world_size, lr, momentum):
    n = param.numel()
    s = -(-n // world_size)
    padded = torch.zeros(s * world_size)  # noqa: F821
    padded[:n] = grad
    g = torch.empty(s)  # noqa: F821
    dist.reduce_scatter_tensor(g, padded)  # noqa: F821
    m = state.setdefault("m", torch.zeros(s))  # noqa: F821
    m.mul_(momentum).add_(g / world_size)
    full = torch.zeros(s * world_size)  # noqa: F821
    full[:n] = param
    other = (rank + 1) % world_size  # steps the neighbour's slice of the parameters with its own momentum
    dist.all_gather_into_tensor(full, (full[other * s:(other + 1) * s] - lr * m).contiguous())  # noqa: F821
    param.copy_(full[:n])


def zero1_no_average(param, grad, state, rank, world_size, lr, momentum):
    n = param.numel()
    s = -(-n // world_size)
    padded = torch.zeros(s * world_size)  # noqa: F821
    padded[:n] = grad
    g = torch.empty(s)  # noqa: F821
    dist.reduce_scatter_tensor(g, padded)  # noqa: F821 - the sum, never divided
    m = state.setdefault("m", torch.zeros(s))  # noqa: F821
    m.mul_(momentum).add_(g)
    full = torch.zeros(s * world_size)  # noqa: F821
    full[:n] = param
    dist.all_gather_into_tensor(full, (full[rank * s:(rank + 1) * s] - lr * m).contiguous())  # noqa: F821
    param.copy_(full[:n])


def zero1_full_tensor(param, grad, state, rank, world_size, lr, momentum):
    g = grad.clone()
    dist.all_reduce(g)  # noqa: F821 - DDP's step: every rank steps everything
    m = state.setdefault("m", torch.zeros_like(param))  # noqa: F821
    m.mul_(momentum).add_(g / world_size)
    param.sub_(lr * m)


def zero1_no_padding(param, grad, state, rank, world_size, lr, momentum):
    n = param.numel()
    s = n // world_size  # floor: the last n % world_size elements belong to nobody
    g = torch.empty(s)  # noqa: F821
    dist.reduce_scatter_tensor(g, grad[:s * world_size].contiguous())  # noqa: F821
    m = state.setdefault("m", torch.zeros(s))  # noqa: F821
    m.mul_(momentum).add_(g / world_size)
    full = param[:s * world_size].clone()
    dist.all_gather_into_tensor(full, (full[rank * s:(rank + 1) * s] - lr * m).contiguous())  # noqa: F821
    param[:s * world_size].copy_(full)


def zero1_nested_full(param, grad, state, rank, world_size, lr, momentum):
    g = grad.clone()
    dist.all_reduce(g)  # noqa: F821 - DDP's step, its momentum kept as torch.optim lays out its state
    m = state.setdefault("param0", {}).setdefault("momentum_buffer", torch.zeros_like(param))  # noqa: F821
    m.mul_(momentum).add_(g / world_size)
    param.sub_(lr * m)


def zero1_default_full(param, grad, state, rank, world_size, lr, momentum, _buffers={}):  # noqa: B006 - the mistake
    g = grad.clone()
    dist.all_reduce(g)  # noqa: F821 - the whole momentum, kept out of `state` in a mutable default
    m = _buffers.setdefault(param.numel(), torch.zeros_like(param))  # noqa: F821
    m.mul_(momentum).add_(g / world_size)
    param.sub_(lr * m)


def zero1_all_reduce_slice(param, grad, state, rank, world_size, lr, momentum):
    n = param.numel()
    s = -(-n // world_size)
    g = grad.clone()
    dist.all_reduce(g)  # noqa: F821 - the whole sum on every rank, of which the step uses one slice
    padded = torch.zeros(s * world_size)  # noqa: F821
    padded[:n] = g / world_size
    m = state.setdefault("m", torch.zeros(s))  # noqa: F821
    m.mul_(momentum).add_(padded[rank * s:(rank + 1) * s])
    full = torch.zeros(s * world_size)  # noqa: F821
    full[:n] = param
    dist.all_gather_into_tensor(full, (full[rank * s:(rank + 1) * s] - lr * m).contiguous())  # noqa: F821
    param.copy_(full[:n])


def zero1_step_counter(param, grad, state, rank, world_size, lr, momentum):
    state["step"] = state.get("step", torch.zeros(())) + 1  # noqa: F821 - torch.optim's kind of step counter
    n = param.numel()
    s = -(-n // world_size)
    padded = torch.zeros(s * world_size)  # noqa: F821
    padded[:n] = grad
    g = torch.empty(s)  # noqa: F821
    dist.reduce_scatter_tensor(g, padded)  # noqa: F821
    m = state.setdefault("m", torch.zeros(s))  # noqa: F821
    m.mul_(momentum).add_(g / world_size)
    full = torch.zeros(s * world_size)  # noqa: F821
    full[:n] = param
    dist.all_gather_into_tensor(full, (full[rank * s:(rank + 1) * s] - lr * m).contiguous())  # noqa: F821
    param.copy_(full[:n])


def zero1_cached_buffers(param, grad, state, rank, world_size, lr, momentum):
    n = param.numel()
    s = -(-n // world_size)
    if "full" not in state:  # allocated once, reused by every call: the gather output and the padded gradient
        state["full"] = torch.zeros(s * world_size)  # noqa: F821
        state["padded"] = torch.zeros(s * world_size)  # noqa: F821
        state["m"] = torch.zeros(s)  # noqa: F821
    full, padded, m = state["full"], state["padded"], state["m"]
    padded[:n] = grad
    g = torch.empty(s)  # noqa: F821
    dist.reduce_scatter_tensor(g, padded)  # noqa: F821
    m.mul_(momentum).add_(g / world_size)
    full[:n] = param
    dist.all_gather_into_tensor(full, (full[rank * s:(rank + 1) * s] - lr * m).contiguous())  # noqa: F821
    param.copy_(full[:n])


def test_reference_and_mistakes_in_one_launch() -> None:
    verdicts = run_checks([reference_zero1_step, zero1_step, zero1_wrong_slice, zero1_no_average, zero1_full_tensor,
                           zero1_no_padding, zero1_nested_full, zero1_default_full, zero1_all_reduce_slice,
                           zero1_step_counter, zero1_cached_buffers], WORKER, 3, timeout=180)
    ref, ours, wrong_slice, no_avg, full, no_pad, nested, default, ar_slice, counter, cached = verdicts
    assert ref.passed and ours.passed, (ref, ours)
    assert counter.passed and cached.passed, (counter, cached)  # caches and counters are not optimizer state
    assert nested.details["kind"] == "full_state" and "state['param0']['momentum_buffer']" in nested.message
    assert "momentum of slices" in nested.message and "slice only" in nested.hint
    assert default.details["kind"] == "full_state" and "the default argument _buffers" in default.message
    assert "default arguments" in default.hint
    assert ar_slice.details["kind"] == "comm_all_reduce" and "1.50x" in ar_slice.message, ar_slice
    assert ar_slice.details["n"] == 12 and ar_slice.details["call"] == 1
    assert "reduce-scatter sends half as much" in ar_slice.hint
    assert wrong_slice.details["kind"] == "wrong_slice" and "holds slice" in wrong_slice.message
    assert "rank r owns elements" in wrong_slice.hint
    assert no_avg.details["kind"] == "no_average" and "divide by world_size" in no_avg.hint
    assert full.details["kind"] == "full_state" and "all-reduced" in full.message and "slice only" in full.hint
    assert no_pad.details["kind"] in ("padding", "padding_error") and no_pad.details["n"] % 3
    assert "pad" in no_pad.hint


def test_registered_for_notebook_08_and_stub_not_attempted() -> None:
    ex = get("zero1_step")
    assert ex.notebook == "08_zero" and ex.check is check_zero1_step and len(ex.hints) == 2

    def zero1_step(param, grad, state, rank, world_size, lr, momentum):
        raise NotImplementedError

    verdict = check_zero1_step(zero1_step)
    assert verdict.state == "not attempted" and "NotImplementedError" in verdict.message
