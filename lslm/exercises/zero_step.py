"""Exercise of notebook 08: one ZeRO stage-1 step for this rank's slice.

The learner writes ``zero1_step(param, grad, state, rank, world_size, lr, momentum)``. ``param``
is the flat fp32 parameter tensor (``n`` elements, the same on every rank), ``grad`` this rank's
own gradient of it, ``state`` a dict the rank keeps between calls (empty at the first). One call
must leave ``param`` where SGD with momentum (``m = momentum * m + g``; ``p -= lr * m``) on the
*mean* gradient over the ranks puts it, while this rank keeps the momentum of its slice only:

1. pad ``n`` up to a multiple of ``world_size`` (slices of ``s = ceil(n / world_size)`` elements);
2. reduce-scatter the padded gradient: rank ``r`` receives the sum of slice ``r``, then divides by ``world_size``;
3. step slice ``r`` of the parameters with the momentum of slice ``r`` (``s`` elements in ``state``);
4. all-gather the updated slices and copy the first ``n`` elements back into ``param``.

The checker runs it on real processes (2 and 3), three calls in a row for several ``n`` (one
divisible by the world size first, then ones that are not), and after every call compares
``param`` with the serial trajectory and the state's size with ``s``. A wrong answer is named by
what it computed: the slice of another rank, the sum instead of the mean, a momentum for the whole
tensor, the elements past the last full slice left behind (no padding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lslm.exercises.core import Verdict, call_learner, check_each, collect_and_judge, report, run_check
from lslm.exercises.registry import Exercise, register

__all__ = ["check_zero1_step", "reference_zero1_step", "worker"]

SIZES = (12, 13, 5, 1)  # 12: divisible by 2 and 3; then sizes that need padding
CALLS = 3
LR, MOMENTUM = 0.1, 0.9
RTOL, ATOL = 1e-5, 1e-6  # fp32: the reduce-scatter sums in another order than the checker


def reference_zero1_step(param: torch.Tensor, grad: torch.Tensor, state: dict, rank: int, world_size: int,
                         lr: float, momentum: float) -> None:
    """Our solution: pad, reduce-scatter and average, step this rank's slice, all-gather."""
    n = param.numel()
    s = -(-n // world_size)  # elements per slice, the last one padded
    padded = torch.zeros(s * world_size, dtype=grad.dtype, device=grad.device)
    padded[:n] = grad
    g = torch.empty(s, dtype=grad.dtype, device=grad.device)
    dist.reduce_scatter_tensor(g, padded)  # slice `rank` of the sum over ranks
    g /= world_size  # the mean, as DDP's average
    m = state.setdefault("momentum", torch.zeros(s, dtype=param.dtype, device=param.device))
    m.mul_(momentum).add_(g)
    full = torch.zeros(s * world_size, dtype=param.dtype, device=param.device)
    full[:n] = param
    mine = full[rank * s:(rank + 1) * s] - lr * m
    dist.all_gather_into_tensor(full, mine.contiguous())
    param.copy_(full[:n])


def _param0(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + n)
    return torch.randn(n, generator=g)  # lslm: cpu-ok (seeded on the host; the checker moves it to the device)


def _grad(rank: int, call: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 100 * call + n)
    return torch.randn(n, generator=g)  # lslm: cpu-ok (seeded on the host; the checker moves it to the device)


def _serial(n: int, world: int, calls: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(param before, mean gradient, momentum after) of each call, padded to a multiple of ``world``."""
    s = -(-n // world)
    p, m, out = _padded(_param0(n), s * world), torch.zeros(s * world), []  # lslm: cpu-ok (the host's reference)
    for c in range(calls):
        g = _padded(sum(_grad(r, c, n) for r in range(world)) / world, s * world)
        m_new = MOMENTUM * m + g
        out.append((p, g, m_new))
        p, m = p - LR * m_new, m_new
    return out


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size)  # lslm: cpu-ok (the reference trajectory is computed on the host)
    out[:t.numel()] = t
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _diagnose(got: torch.Tensor, n: int, world: int, call: int) -> dict[str, Any] | None:
    """None if ``got`` is right after ``call``, else what the learner computed instead."""
    s = -(-n // world)
    traj = _serial(n, world, call + 1)
    p_prev, g, m_new = traj[call]
    want = (p_prev - LR * m_new)[:n]
    if _close(got, want):
        return None
    m_prev = traj[call - 1][2] if call else torch.zeros(s * world)  # lslm: cpu-ok (host reference)
    summed = (p_prev - LR * (MOMENTUM * m_prev + world * g))[:n]
    if _close(got, summed):
        return {"kind": "no_average"}
    bad = int((~torch.isclose(got, want, rtol=RTOL, atol=ATOL)).nonzero()[0].item())
    if n % world and bad >= (world - 1) * s:
        if _close(got[:(world - 1) * s], want[:(world - 1) * s]):
            return {"kind": "padding", "index": bad, "expected": float(want[bad]), "got": float(got[bad])}
    j = bad // s
    lo, hi = j * s, min(n, (j + 1) * s)
    slices = [(p_prev[k * s:(k + 1) * s], m_new[k * s:(k + 1) * s]) for k in range(world)]
    for a in range(world):
        for b in range(world):
            if (a, b) != (j, j) and _close(got[lo:hi], (slices[a][0] - LR * slices[b][1])[:hi - lo]):
                return {"kind": "wrong_slice", "slice": j, "param_slice": a, "momentum_slice": b}
    return {"kind": "wrong", "index": bad, "expected": float(want[bad]), "got": float(got[bad])}


def _state_numel(state: Any) -> int:
    if not isinstance(state, dict):
        return -1
    return sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))


def _check_one(fn: Callable[..., Any], ctx: Any) -> dict[str, Any] | None:
    world, rank = ctx.world_size, ctx.rank
    problem: dict[str, Any] | None = None
    calls_made: list[str] = []
    saved = dist.all_reduce

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        calls_made.append("all_reduce")
        return saved(*args, **kwargs)

    for n in SIZES:
        s = -(-n // world)
        param, state = _param0(n).to(ctx.device), {}
        for c in range(CALLS):
            where = {"n": n, "call": c + 1}
            dist.all_reduce = all_reduce
            try:
                call_learner(fn, param, _grad(rank, c, n).to(ctx.device), state, rank, world, LR, MOMENTUM,
                             label=f"n={n}, call {c + 1}")
            except Exception as exc:  # noqa: BLE001 - the learner's error becomes the verdict
                kind = "padding_error" if n % world else "error"
                problem = {**where, "kind": kind, "error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                dist.all_reduce = saved
            if problem:
                break
            held = _state_numel(state)
            if held > s:
                problem = {**where, "kind": "full_state", "held": held, "slice": s,
                           "all_reduce": "all_reduce" in calls_made}
                break
            found = _diagnose(param.detach().cpu().float(), n, world, c)
            if found:
                problem = {**where, **found}
                break
        if problem:
            break
    return collect_and_judge(problem, _judge)


def worker(module: str, name: str | list[str]) -> Any:
    """Each rank runs the learner's step on every size and judges its own parameters; rank 0 reports."""
    return check_each(module, name, _check_one)


HINTS = {
    "error": "run it by hand first: with world_size=1 it is plain SGD with momentum (the reduce-scatter and "
             "all-gather of one rank copy)",
    "padding_error": "n is not a multiple of world_size here: pad the gradient (and the parameters) with zeros to "
                     "s * world_size elements, s = ceil(n / world_size), before the collectives, and copy back "
                     "only the first n",
    "padding": "the elements after the last full slice were left behind: every rank's slice has "
               "s = ceil(n / world_size) elements, so pad to s * world_size with zeros (the last slice ends in "
               "padding) and copy the first n elements back",
    "no_average": "reduce-scatter sums the slices over the ranks: divide by world_size to get the mean gradient "
                  "(DDP's average), before the momentum sees it",
    "wrong_slice": "rank r owns elements [r * s, (r + 1) * s): reduce_scatter_tensor hands rank r the sum of "
                   "that slice, so step the parameters' slice r with it, and all-gather puts slice r back at "
                   "r * s",
    "full_state": "ZeRO-1's point is that a rank keeps optimizer state for its slice only: keep a momentum of "
                  "s = ceil(n / world_size) elements, step only param's slice rank, and all-gather the slices "
                  "instead of stepping the whole tensor",
    "wrong": "after a call, param must equal p - lr * m on every element, with m = momentum * m + mean gradient",
}


def _judge(everyone: list[dict[str, Any] | None]) -> dict[str, Any]:
    for rank, p in enumerate(everyone):
        if not p:
            continue
        case = f"n={p['n']}, call {p['call']}"
        kind = p["kind"]
        if "error" in p:
            msg = f"rank {rank} ({case}): {p['error']}"
        elif kind == "full_state":
            msg = (f"rank {rank} ({case}): your state holds {p['held']} elements of momentum; this rank's slice has "
                   f"{p['slice']}" + (" (and you all-reduced: that is DDP's step)" if p["all_reduce"] else ""))
        elif kind == "no_average":
            msg = f"rank {rank} ({case}): the parameters moved as if the gradient were the sum over ranks, not the mean"
        elif kind == "wrong_slice":
            msg = (f"rank {rank} ({case}): slice {p['slice']} of the parameters holds slice {p['param_slice']} of "
                   f"the old parameters stepped with the momentum of slice {p['momentum_slice']}")
        elif kind == "padding":
            msg = (f"rank {rank} ({case}): param[{p['index']}] (in the last, padded slice) expected "
                   f"{p['expected']:.6f}, got {p['got']:.6f}")
        else:
            msg = f"rank {rank} ({case}): param[{p['index']}] expected {p['expected']:.6f}, got {p['got']:.6f}"
        return {"passed": False, "message": msg, "hint": HINTS[kind], "details": {"rank": rank, **p}}
    return {"passed": True, "message": "ok"}


def check_zero1_step(fn: Callable[..., Any], world_sizes: tuple[int, ...] = (2, 3)) -> Verdict:
    """Check the learner's ``zero1_step(param, grad, state, rank, world_size, lr, momentum)``; print the verdict."""
    return report(run_check(fn, "lslm.exercises.zero_step:worker", world_sizes, timeout=180, exercise="zero1_step"))


register(Exercise(
    name="zero1_step", notebook="08_zero", reference=reference_zero1_step, check=check_zero1_step,
    hints=("four moves: pad to a multiple of world_size, reduce-scatter the gradient (then divide by world_size), "
           "update your slice of the parameters with the momentum of your slice, all-gather the slices",
           "s = -(-n // world_size); padded gradient of s * world_size zeros with grad in front; "
           "dist.reduce_scatter_tensor(g, padded) gives g = the summed slice rank; m = momentum * m + g / world_size "
           "kept in state (s elements); new = full[rank*s:(rank+1)*s] - lr * m; "
           "dist.all_gather_into_tensor(full, new); param.copy_(full[:n])")))
