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
divisible by the world size first, then ones that are not), and after every call judges three things:

* the parameters, against the serial trajectory;
* the memory, by what the rank holds: every tensor its function can reach between calls (``state``,
  nested at any depth, default arguments, closure, attributes, new globals) is searched for the
  momentum of *another* rank's slice. Caches (a gather buffer, a tensor step counter) are allowed;
  from the second call on, when the momentum no longer equals the mean gradient, a full-tensor
  momentum is found wherever it is kept;
* the communication, by the ledger (:mod:`lslm.exercises.recorded`): the bus bytes of the call must
  not exceed a reduce-scatter plus an all-gather of ``s * world_size`` elements, so an all-reduce
  followed by a slice (1.5x the bytes) fails even though its parameters are right.

A wrong answer is named by what it computed: the slice of another rank, the sum instead of the
mean, a momentum for the whole tensor (and where it was kept), the elements past the last full
slice left behind (no padding), an all-reduce or other surplus communication.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lslm.exercises.core import Verdict, call_learner, check_each, collect_and_judge, report, run_check
from lslm.exercises.recorded import collectives_recorded
from lslm.exercises.registry import Exercise, register
from lslm.runtime.records import CommLedger, CommRecord

__all__ = ["check_zero1_step", "reference_zero1_step", "worker"]

SIZES = (12, 13, 5, 1)  # 12: divisible by 2 and 3; then sizes that need padding
CALLS = 3
LR, MOMENTUM = 0.1, 0.9
RTOL, ATOL = 1e-5, 1e-6  # fp32: the reduce-scatter sums in another order than the checker
# Looser, to find momentum wherever the learner keeps it (another dtype, another summation order); still
# far below the gap between a momentum and anything else a rank holds (parameters, its own gradient).
FIND_RTOL, FIND_ATOL = 1e-4, 1e-5


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


def _roots(fn: Callable[..., Any], state: Any, param: torch.Tensor, globals_before: dict[str, int]
           ) -> list[tuple[str, Any]]:
    """Everything a rank can keep between calls, named as the learner would write it.

    ``state``, the function's default arguments (a mutable default lives as long as the function),
    its closure and attributes, attributes set on ``param``, and the module globals the learner's code
    created or replaced (``global``) since its first call: optimizer state kept anywhere else would not
    survive to the next call.
    """
    code = getattr(fn, "__code__", None)
    roots: list[tuple[str, Any]] = [("state", state)]
    defaults = getattr(fn, "__defaults__", None) or ()
    if code is not None and defaults:
        names = code.co_varnames[:code.co_argcount][-len(defaults):]
        roots += [(f"the default argument {n}", v) for n, v in zip(names, defaults)]
    roots += [(f"the default argument {n}", v) for n, v in (getattr(fn, "__kwdefaults__", None) or {}).items()]
    for name, cell in zip(code.co_freevars if code is not None else (), getattr(fn, "__closure__", None) or ()):
        try:
            roots.append((f"the closure variable {name}", cell.cell_contents))
        except ValueError:  # a cell not filled yet holds nothing
            continue
    roots += [(f"{getattr(fn, '__name__', 'fn')}.{k}", v) for k, v in getattr(fn, "__dict__", {}).items()
              if not k.startswith("__")]
    roots += [(f"param.{k}", v) for k, v in getattr(param, "__dict__", {}).items()]
    roots += [(f"the global {k}", v) for k, v in getattr(fn, "__globals__", {}).items()
              if globals_before.get(k) != id(v) and not isinstance(v, (types.ModuleType, type, types.FunctionType))]
    return roots


def _reachable(roots: list[tuple[str, Any]], limit: int = 10_000) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``roots`` through containers and plain objects, with the path to it."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    stack = list(reversed(roots))
    while stack and len(seen) < limit:  # the limit only guards against a learner's self-referencing maze
        path, obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, complex, bool)):
            continue
        seen.add(id(obj))
        children: list[tuple[str, Any]] = []
        if isinstance(obj, torch.Tensor):
            found.append((path, obj))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                children.append((f"{path}[{k!r}]" if not isinstance(k, torch.Tensor) else f"{path}[<tensor>]", v))
                if isinstance(k, torch.Tensor):  # torch.optim keys its state by the parameter tensor
                    children.append((f"a key of {path}", k))
        elif isinstance(obj, (list, tuple, collections.deque)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, (set, frozenset)):
            children = [(f"an element of {path}", v) for v in obj]
        elif isinstance(obj, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType,
                              types.MethodType)):
            continue  # code, not storage: a module or class reached from here is the library's, not the rank's
        else:  # a plain object (a namespace, an optimizer): its attributes, if it has a __dict__
            attrs = getattr(obj, "__dict__", None)
            children = [(f"{path}.{k}", v) for k, v in attrs.items()] if isinstance(attrs, dict) else []
        stack.extend(reversed(children))
    return found


def _contains(flat: torch.Tensor, pattern: torch.Tensor) -> bool:
    """Whether ``pattern`` appears in ``flat`` as a run of consecutive elements (to a tolerance)."""
    p = pattern.numel()
    if flat.numel() < p:
        return False
    windows = flat.unfold(0, p, 1)
    return bool(torch.isclose(windows, pattern, rtol=FIND_RTOL, atol=FIND_ATOL).all(dim=1).any())


def _foreign_momentum(tensors: list[tuple[str, torch.Tensor]], m_new: torch.Tensor, n: int, world: int,
                      rank: int) -> dict[str, Any] | None:
    """Where this rank keeps the momentum of another rank's slice, if it does (None: only its own).

    Memory is judged by what the rank holds, not by how many elements it holds: buffers it caches
    (a gather output, a step counter) are its business, but a tensor holding the momentum of elements
    outside slice ``rank`` is optimizer state ZeRO-1 shards away, and so is a tensor the size of the
    whole parameter that keeps this rank's momentum in its place (zeros elsewhere: no memory saved).
    Slices with fewer than two real elements are not searched: one float could match by chance.
    """
    s = -(-n // world)
    slices = {k: m_new[k * s:min(n, (k + 1) * s)].double() for k in range(world)}
    slices = {k: w for k, w in slices.items() if w.numel() >= 2}
    for path, t in tensors:
        if not t.is_floating_point() or t.numel() < 2:
            continue
        flat = t.detach().reshape(-1).cpu().double()
        found = [k for k, w in slices.items() if _contains(flat, w)]
        foreign = [k for k in found if k != rank]
        if foreign or (rank in found and flat.numel() >= n > s):
            return {"where": path, "slices": foreign, "held": flat.numel()}
    return None


def _comm_problem(records: list[CommRecord], s: int, world: int, element_size: int) -> dict[str, Any] | None:
    """Bus bytes of one call against ZeRO-1's: a reduce-scatter and an all-gather of ``s * world`` elements."""
    want = 2 * (world - 1) * s * element_size  # (W-1)/W of s*W elements, twice
    got = sum(r.bus_bytes for r in records)
    if got <= want + 0.5:  # bus bytes are fractions of a byte apart at most when they agree
        return None
    by_op: dict[str, float] = {}
    for r in records:
        by_op[r.op] = by_op.get(r.op, 0.0) + r.bus_bytes
    kind = "comm_all_reduce" if "all_reduce" in by_op else "comm"
    return {"kind": kind, "sent": round(got, 1), "expected": want, "by_op": {k: round(v, 1) for k, v in by_op.items()}}


def _check_one(fn: Callable[..., Any], ctx: Any) -> dict[str, Any] | None:
    world, rank = ctx.world_size, ctx.rank
    problem: dict[str, Any] | None = None
    ledger = CommLedger()
    globals_before = {k: id(v) for k, v in getattr(fn, "__globals__", {}).items()}
    for n in SIZES:
        s = -(-n // world)
        param, state = _param0(n).to(ctx.device), {}
        for c in range(CALLS):
            where = {"n": n, "call": c + 1}
            since = len(ledger.records)
            try:
                with collectives_recorded(ledger):
                    call_learner(fn, param, _grad(rank, c, n).to(ctx.device), state, rank, world, LR, MOMENTUM,
                                 label=f"n={n}, call {c + 1}")
            except Exception as exc:  # noqa: BLE001 - the learner's error becomes the verdict
                kind = "padding_error" if n % world else "error"
                problem = {**where, "kind": kind, "error": f"{type(exc).__name__}: {exc}"[:300]}
                break
            found = _diagnose(param.detach().cpu().float(), n, world, c)
            if found is None and c:  # after call 1 the momentum is the mean gradient: judged from call 2 on
                held = _foreign_momentum(_reachable(_roots(fn, state, param, globals_before)),
                                         _serial(n, world, c + 1)[c][2], n, world, rank)
                if held is not None:
                    found = {"kind": "full_state", "slice": s, **held,
                             "all_reduce": any(r.op == "all_reduce" for r in ledger.records)}
            if found is None:
                found = _comm_problem(ledger.select(since=since), s, world, param.element_size())
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
                  "instead of stepping the whole tensor (the checker looks at every tensor your function can "
                  "reach between calls: state, nested or not, default arguments, closures, globals)",
    "comm_all_reduce": "all-reduce hands every rank the whole summed gradient, 2(W-1)/W of the tensor per rank, and "
                       "the step then uses one slice of it: reduce-scatter sends half as much and delivers exactly "
                       "that slice; with the all-gather after it, ZeRO-1 sends what DDP's all-reduce alone sends",
    "comm": "ZeRO-1 sends what DDP sends: one reduce-scatter of the padded gradient (dist.reduce_scatter_tensor) "
            "and one all-gather of the updated slices (dist.all_gather_into_tensor), in param's dtype, nothing "
            "else",
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
            others = ", ".join(map(str, p["slices"]))
            held = (f"holds the momentum of slice{'s' if len(p['slices']) > 1 else ''} {others} too" if others else
                    "keeps this rank's momentum inside a tensor the size of the whole parameter")
            msg = (f"rank {rank} ({case}): {p['where']} ({p['held']} elements) {held}; ZeRO-1 keeps only slice "
                   f"{rank}, {p['slice']} elements" + (" (and you all-reduced: that is DDP's step)"
                                                       if p["all_reduce"] else ""))
        elif kind in ("comm", "comm_all_reduce"):
            ops = ", ".join(f"{op} {b:g} B" for op, b in p["by_op"].items())
            msg = (f"rank {rank} ({case}): your step sent {p['sent']:g} bytes per rank ({ops}); a reduce-scatter and "
                   f"an all-gather send {p['expected']} ({p['sent'] / p['expected']:.2f}x as much)")
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
