"""Exercise of notebook 04: the naive gradient synchronisation of DDP.

The learner writes ``sync_gradients(model, world_size)``: after ``loss.backward()``
on every rank (same weights, different data), it must leave in each parameter's
``.grad`` the mean of that gradient over all ranks, using ``torch.distributed``
(all-reduce with SUM, then divide; ``ReduceOp.AVG`` is accepted too where the
backend supports it). The checker runs it on real processes and compares with the
mean of the gathered local gradients, watching which tensors go into
``dist.all_reduce`` to catch the classic bug of reducing the parameter instead of
its gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lslm.exercises.core import Verdict, load_learner_function, report, run_check

# fp32 sums in another order (ring vs gathered mean) differ by a few ulps; gradients here are O(0.01-1).
RTOL, ATOL = 1e-5, 1e-7
N_CASES = 2


def reference_sync_gradients(model: nn.Module, world_size: int) -> None:
    """Our solution: all-reduce (SUM) every existing ``.grad`` in place, then divide by ``world_size``."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world_size)


def _model(case: int) -> nn.Module:
    torch.manual_seed(case)  # same weights on every rank
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


@contextlib.contextmanager
def _spy_all_reduce(seen: list[int]) -> Iterator[None]:
    """Record the ``data_ptr`` of every tensor passed to ``dist.all_reduce`` while inside."""
    original = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(tensor.data_ptr())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        yield
    finally:
        dist.all_reduce = original


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=RTOL, atol=ATOL)


def _diagnose(names: list[str], got: list[torch.Tensor | None], expected: list[torch.Tensor],
              local: list[torch.Tensor], n: int) -> dict[str, Any] | None:
    """None if ``got`` is right, else what is wrong (``kind``) and where."""
    if any(g is None for g in got):
        i = next(i for i, g in enumerate(got) if g is None)
        return {"kind": "none", "param": names[i]}
    bad = [i for i in range(len(got)) if not _close(got[i], expected[i])]  # type: ignore[arg-type]
    if not bad:
        return None
    i = bad[0]
    flat_g, flat_e = got[i].reshape(-1), expected[i].reshape(-1)  # type: ignore[union-attr]
    j = int((~torch.isclose(flat_g.double(), flat_e.double(), rtol=RTOL, atol=ATOL)).nonzero()[0])
    where = {"param": names[i], "index": j, "expected": flat_e[j].item(), "got": flat_g[j].item()}
    if all(_close(got[k], local[k]) for k in bad):  # type: ignore[arg-type]
        kind = "unsynced" if len(bad) == len(got) else "partial"
    elif all(_close(got[k], n * expected[k]) for k in bad):  # type: ignore[arg-type]
        kind = "no_divide"
    elif all(_close(got[k], expected[k] / n) for k in bad):  # type: ignore[arg-type]
        kind = "divided_twice"
    else:
        kind = "wrong"
    return {"kind": kind, **where}


def worker(module: str, name: str) -> dict[str, Any]:
    """Each rank runs the learner's function after a backward on its own data; rank 0 reports."""
    from lslm.runtime import init_distributed

    fn = load_learner_function(module, name)
    with init_distributed(timeout_s=20) as ctx:  # a hang ends with a timeout error, not a stuck notebook
        n, r = ctx.world_size, ctx.rank
        problems: list[dict[str, Any]] = []
        for case in range(N_CASES):
            model = _model(case).to(ctx.device)
            gen = torch.Generator().manual_seed(100 * case + r)  # this rank's data: same numbers on any device
            x = torch.randn(4, 6, generator=gen).to(ctx.device)  # lslm: cpu-ok (host RNG, then moved)
            model(x).pow(2).mean().backward()
            names = [nm for nm, _ in model.named_parameters()]
            params = list(model.parameters())
            before = [p.detach().clone() for p in params]
            local = [p.grad.detach().clone() for p in params]
            flat = torch.cat([g.reshape(-1) for g in local])
            everyone = [torch.empty_like(flat) for _ in range(n)]
            ctx.comm.all_gather(everyone, flat)
            mean = torch.stack(everyone).double().mean(0)
            expected, offset = [], 0
            for g in local:
                expected.append(mean[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            seen: list[int] = []
            try:
                with _spy_all_reduce(seen):
                    fn(model, n)
            except Exception as exc:  # noqa: BLE001 - the learner's error becomes the verdict
                problems.append({"case": case, "kind": "error", "error": f"{type(exc).__name__}: {exc}"})
                break
            param_ptrs = {p.data_ptr(): nm for nm, p in zip(names, params)}
            touched = [param_ptrs[ptr] for ptr in seen if ptr in param_ptrs]
            changed = [nm for nm, p, b in zip(names, params, before) if not torch.equal(p.detach(), b)]
            if touched or changed:
                problems.append({"case": case, "kind": "param", "param": (touched or changed)[0]})
                break
            found = _diagnose(names, [p.grad for p in params], expected, local, n)
            if found:
                problems.append({"case": case, **found})
                break
        report_all: list[Any] = [None] * n
        dist.all_gather_object(report_all, problems)
    return _verdict(report_all)


HINTS = {
    "error": "call dist.all_reduce(p.grad, op=dist.ReduceOp.SUM) on every parameter's gradient, "
             "then divide it by world_size",
    "param": "you reduced the parameter (p or p.data), not its gradient: call dist.all_reduce(p.grad, ...) - "
             "a parameter hook that receives the parameter must still reduce param.grad",
    "none": "keep every .grad a tensor: reduce it in place (all_reduce works in place) instead of replacing it",
    "unsynced": "the gradients are still this rank's own: call dist.all_reduce on every p.grad",
    "partial": "some parameters were left out: loop over all of model.parameters()",
    "no_divide": "all-reduce SUMs the gradients of all ranks: divide by world_size to get their mean",
    "divided_twice": "the result is the mean divided by world_size once more: divide only once, after the SUM",
    "wrong": "after your function every rank must hold the mean of all ranks' gradients, parameter by parameter",
}


def _verdict(report_all: list[list[dict[str, Any]]]) -> dict[str, Any]:
    for rank, probs in enumerate(report_all):
        if not probs:
            continue
        p = probs[0]
        kind = p["kind"]
        if kind == "error":
            msg = f"rank {rank} (case {p['case']}): {p['error']}"
        elif kind in ("param", "none"):
            msg = f"rank {rank} (case {p['case']}): parameter {p['param']!r}: " + (
                "the parameter itself was all-reduced or changed" if kind == "param" else ".grad is None afterwards")
        else:
            msg = (f"rank {rank} (case {p['case']}): {p['param']}.grad[{p['index']}] expected {p['expected']:.6g}, "
                   f"got {p['got']:.6g}")
        return {"passed": False, "message": msg, "hint": HINTS[kind], "details": {"rank": rank, **p}}
    return {"passed": True, "message": "ok"}


def check_grad_sync(fn: Callable[..., Any], world_sizes: tuple[int, ...] = (2, 3)) -> Verdict:
    """Check the learner's ``sync_gradients(model, world_size)`` and print the verdict."""
    return report(run_check(fn, "lslm.exercises.grad_sync:worker", world_sizes, timeout=120))
