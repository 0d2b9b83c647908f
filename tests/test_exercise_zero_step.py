"""Notebook 08's exercise: the reference ZeRO-1 step passes; each typical mistake fails with its own hint.

All candidates are judged in one launch of 3 processes (``run_checks``): 3 ranks make padding matter
(n = 13, 5, 1 do not divide) and tell a rank's slice from its neighbour's.
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


def test_reference_and_mistakes_in_one_launch() -> None:
    verdicts = run_checks([reference_zero1_step, zero1_step, zero1_wrong_slice, zero1_no_average, zero1_full_tensor,
                           zero1_no_padding], WORKER, 3, timeout=180)
    ref, ours, wrong_slice, no_avg, full, no_pad = verdicts
    assert ref.passed and ours.passed, (ref, ours)
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
