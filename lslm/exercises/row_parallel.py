"""Exercise of notebook 05: a row-parallel linear layer, forward and backward (Megatron's ``g``).

Row parallelism (Shoeybi et al. 2019, "Megatron-LM", section 3, equation 3 and figure 3)
splits ``W`` (``out x in``) by input columns over the ``t`` ranks of a group and ``x``
along its last dim the same way: rank ``r`` computes ``x_r @ W_r.T``, an all-reduce sums
the partials, the bias is added once, after the sum. The learner writes ``g``, an autograd
Function (``ReduceFromTensorParallelRegion``: forward all-reduces over ``group``, backward
is the identity, since ``dL/dpartial_r = dL/dy`` is already whole on every rank), and
``row_parallel_forward(x_local, weight_local, bias, group)``, the whole ``y`` through ``g``.

The checker (2 and 4 gloo processes) builds one ``nn.Linear`` from one seed on every rank,
hands the learner its slices (``x[..., cols]``, ``W[:, cols]``, the whole bias), and
compares output and gradients after ``y.backward(dy)`` (``dy`` the same on every rank, as
after ``g`` in a model) with the single-process ones' slices: three shapes, for groups of 2
(two of them on 4 processes, so a sum over the world shows) and then the world as one
group. It watches torch's collectives (wrong group, communication in backward) and wants
an autograd Function of the learner's own in the output's graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lslm.exercises.core import Verdict, call_learner, check_each, collect_and_judge, report, run_check
from lslm.exercises.registry import Exercise, register

# fp32 throughout. The parallel output sums t partial dot products (each over in/t terms) where nn.Linear sums all
# `in` terms at once: the same numbers added in another order, which differs by a few ulps (values are O(1), at most
# 24 terms: <~ 1e-6). Gradients are slices of the same matmuls. Every mistake diagnosed below is off by a factor
# (t, 1/t), a whole bias (~0.1) or a whole partial sum, so 1e-5 both accepts correct answers and rejects mistakes.
RTOL, ATOL = 1e-5, 1e-5
CASES = (((4,), 4, 6), ((2, 3), 8, 5), ((1,), 3, 3))  # (batch dims of x, input features per rank, output features)
TP = 2  # the first group size checked; on more processes the checker also uses the whole world as one group
DEADLOCK_S = 10.0  # one call on these shapes takes milliseconds, even on a loaded machine
_WATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce",
            "all_to_all_single")


class ReferenceReduceFromTensorParallelRegion(torch.autograd.Function):
    """Our ``g``: forward sums ``x`` over ``group`` (all-reduce), backward passes the gradient through unchanged."""

    @staticmethod
    def forward(fn, x: torch.Tensor, group):
        y = x.clone()  # all_reduce works in place: leave autograd's input as it was
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(fn, grad_output: torch.Tensor):
        return grad_output, None  # dL/dpartial_r = dL/dy, already whole on every rank; no gradient for group


def reference_row_parallel_forward(x_local: torch.Tensor, weight_local: torch.Tensor, bias: torch.Tensor, group):
    """Our solution: this rank's partial product, summed over the group by g, then the bias once."""
    partial = x_local @ weight_local.t()  # (..., out): this rank's input columns' share of x @ W.T
    return ReferenceReduceFromTensorParallelRegion.apply(partial, group) + bias


@dataclass
class _Watch:
    """torch collectives called while the learner's code runs: op, phase (forward/backward), group ranks."""

    phase: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)


@contextlib.contextmanager
def _watching(watch: _Watch) -> Iterator[None]:
    saved = {name: getattr(dist, name) for name in _WATCHED if hasattr(dist, name)}

    def spy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[2] if name == "all_reduce" and len(args) > 2 else None)
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            watch.calls.append({"op": name, "phase": watch.phase, "ranks": sorted(ranks)})
            return original(*args, **kwargs)
        return call

    try:
        for name, original in saved.items():
            setattr(dist, name, spy(name, original))
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, rtol=RTOL, atol=ATOL)


def _values(what: str, got: torch.Tensor, want: torch.Tensor, note: str) -> str:
    """The element where ``got`` is furthest from ``want``, both values, and what the mistake looks like."""
    worst = (got - want).abs().argmax()
    flat, index = int(worst), [int(i) for i in torch.unravel_index(worst, want.shape)]
    return (f"{what}{index} expected {float(want.reshape(-1)[flat]):.6g}, got {float(got.reshape(-1)[flat]):.6g}"
            + (f" ({note})" if note else ""))


def _own_functions(y: torch.Tensor) -> list[str]:
    """Names of the autograd Functions not from torch that ``y``'s graph passes through (the learner's ``g``)."""
    found, seen, stack = [], set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and not cls.__module__.startswith("torch"):
            found.append(cls.__name__)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


def _forward_kind(y: torch.Tensor, want: torch.Tensor, partial: torch.Tensor, bias: torch.Tensor, tp: int,
                  reduced_over: list[list[int]], tp_ranks: list[int]) -> tuple[str, str] | None:
    """None if ``y`` is the whole output, else (the mistake it shows, what that looks like)."""
    if _close(y, want):
        return None
    wrong = [ranks for ranks in reduced_over if ranks != tp_ranks]
    if wrong:
        return "wrong_group", f"the all-reduce ran over ranks {wrong[0]}; this tensor-parallel group is {tp_ranks}"
    if _close(y, want + (tp - 1) * bias):
        return "bias_every_rank", f"that is x @ W.T + {tp} * bias: every rank added the bias before the sum"
    if _close(y, partial + bias) or _close(y, partial):
        return "no_reduce", "this rank's partial sum alone: nothing was summed over the group"
    if _close(y, want - bias):
        return "no_bias", "that is x @ W.T without the bias"
    return "wrong_output", ""


def _grad_kind(name: str, got: torch.Tensor, want: torch.Tensor, tp: int) -> tuple[str, str]:
    if _close(got, tp * want):
        return "backward_reduces", f"{tp} times too big"
    if _close(got, want / tp):
        return ("bias_split" if name == "bias" else "grad_divided"), f"{tp} times too small"
    return "wrong_grad", ""


def _case(fn: Callable[..., Any], ctx: Any, group: Any, batch: tuple[int, ...], per_rank: int, out: int,
          seed: int) -> dict[str, Any] | None:
    """One shape on one group: None if output and gradients match nn.Linear's slices, else the first problem."""
    tp, tr = dist.get_world_size(group), dist.get_rank(group)
    tp_ranks = sorted(dist.get_process_group_ranks(group))
    cols = slice(tr * per_rank, (tr + 1) * per_rank)
    torch.manual_seed(seed)  # the same layer and data on every rank
    linear = nn.Linear(per_rank * tp, out)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, per_rank * tp, generator=gen).requires_grad_()  # lslm: cpu-ok (host RNG; reference)
    dy = torch.randn(*batch, out, generator=gen)  # lslm: cpu-ok (host RNG, moved below)
    y_ref = linear(x)
    y_ref.backward(dy)
    want = {"x_local": x.grad[..., cols], "weight_local": linear.weight.grad[:, cols], "bias": linear.bias.grad}
    given = {"x_local": x.detach()[..., cols], "weight_local": linear.weight.detach()[:, cols],
             "bias": linear.bias.detach()}
    leaves = {k: v.clone().to(ctx.device).requires_grad_() for k, v in given.items()}
    where = {"tp": tp, "tp_rank": tr, "x": list(x.shape), "x_local": list(leaves["x_local"].shape)}
    label = f"group of {tp}, x of shape {tuple(x.shape)}"
    watch = _Watch()
    try:
        with _watching(watch):
            watch.phase = "forward"
            y = call_learner(fn, leaves["x_local"], leaves["weight_local"], leaves["bias"], group, label=label)
            watch.phase = None
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(y_ref.shape):
                got = list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                return {**where, "kind": "shape", "text": f"returned {got}, expected a tensor of shape "
                                                          f"{list(y_ref.shape)}"}
            reduced = [c["ranks"] for c in watch.calls if c["op"] == "all_reduce"]
            partial = given["x_local"] @ given["weight_local"].t()
            found = _forward_kind(y.detach().cpu(), y_ref.detach(), partial, given["bias"], tp, reduced, tp_ranks)
            if found is not None:
                return {**where, "kind": found[0], "text": _values("output", y.detach().cpu(), y_ref.detach(),
                                                                   found[1])}
            if not y.requires_grad:
                return {**where, "kind": "no_grad", "text": "the output does not require grad"}
            own = _own_functions(y)
            watch.phase = "backward"
            try:
                call_learner(y.backward, dy.to(ctx.device), label=f"{label}: backward")
            except Exception as exc:  # noqa: BLE001 - the learner's backward error becomes the finding
                return {**where, "kind": "error_backward", "text": f"{type(exc).__name__}: {exc}"}
            watch.phase = None
    except NameError as exc:
        return {**where, "kind": "name", "text": f"NameError: {exc}"}
    except Exception as exc:  # noqa: BLE001 - the learner's error becomes the finding
        return {**where, "kind": "error", "text": f"{type(exc).__name__}: {exc}"}
    for name, leaf in leaves.items():
        if leaf.grad is None:
            return {**where, "kind": "no_grad", "text": f"the gradient of {name} is None after backward"}
        got = leaf.grad.detach().cpu()
        if not _close(got, want[name]):
            kind, note = _grad_kind(name, got, want[name], tp)
            return {**where, "kind": kind, "text": _values(f"grad of {name}", got, want[name], note)}
    in_backward = [c["op"] for c in watch.calls if c["phase"] == "backward"]
    if in_backward:
        return {**where, "kind": "backward_comm",
                "text": f"output and gradients are right, but backward called dist.{', dist.'.join(in_backward)}"}
    if not own:
        return {**where, "kind": "no_g",
                "text": "output and gradients are right, but no autograd Function of yours is in the output's graph"}
    return None


def _anyone(problem: dict[str, Any] | None, group: Any) -> bool:
    """True on every rank if any rank found a problem, so that all ranks stop at the same case."""
    flag = torch.tensor([0 if problem is None else 1])  # lslm: cpu-ok (checkers always launch on gloo/CPU)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # not watched: the checker's own collective
    return bool(flag.item())


def _check_one(fn: Callable[..., Any], ctx: Any) -> dict[str, Any] | None:
    """Every group and shape for one learner function on this rank: None, or this rank's first problem."""
    mine = dist.new_group(backend="gloo")  # the checker's flags never pair with one of the learner's collectives
    groups = [ctx.tp_group] + ([dist.group.WORLD] if ctx.world_size > TP else [])
    for g, group in enumerate(groups):
        for c, (batch, per_rank, out) in enumerate(CASES):
            problem = _case(fn, ctx, group, batch, per_rank, out, seed=100 * g + c)
            if _anyone(problem, mine):
                return problem
    return None


HINTS = {
    "error": "call it by hand first: x_local is (..., in/t), weight_local is (out, in/t), so the partial product is "
             "x_local @ weight_local.t(), of shape (..., out)",
    "error_backward": "backward must return one value per argument of forward: (the gradient for x, None for group)",
    "name": "pass every class and function your code uses to the check: "
            "check_row_parallel_forward(row_parallel_forward, ReduceFromTensorParallelRegion)",
    "shape": "return the full output y = x @ W.T + b, shape (..., out), the same on every rank",
    "no_grad": "keep the output in the autograd graph (no .detach(), no torch.no_grad()) and return the gradient "
               "from g's backward",
    "wrong_group": "pass group=group to dist.all_reduce: without it the sum runs over the default group, every "
                   "process, including the ranks of other tensor-parallel groups",
    "no_reduce": "each rank holds only its share of the sum over input features: apply g "
                 "(ReduceFromTensorParallelRegion.apply(partial, group)), whose forward all-reduces (SUM) over group",
    "bias_every_rank": "the bias went in before the all-reduce, so the sum counted it once per rank: add it once, "
                       "after g (every rank holds the whole bias)",
    "no_bias": "add the bias, once, to the summed output",
    "wrong_output": "y must be x @ W.T + b: the partial x_local @ weight_local.t(), summed over the group with "
                    "dist.all_reduce(..., op=dist.ReduceOp.SUM, group=group), then + bias",
    "backward_reduces": "g's backward must return the incoming gradient unchanged: y = sum of the partials, so "
                        "dL/dpartial = dL/dy, which every rank already holds whole; all-reducing it adds t equal "
                        "copies",
    "grad_divided": "g's backward must return the incoming gradient unchanged, not divided by the group size",
    "bias_split": "add the whole bias once, after g: a bias divided by t before the sum gives the right output, "
                  "but each rank's bias then gets only 1/t of its gradient",
    "wrong_grad": "the output is right but a gradient is not: g's backward returns grad_output unchanged (and None "
                  "for group); let autograd differentiate the matmul and the bias",
    "backward_comm": "the gradients are right, but g's backward communicates for nothing: dL/dy is the same on "
                     "every rank already, so backward is the identity, with no collective",
    "no_g": "the sum must be an autograd Function of yours (ReduceFromTensorParallelRegion.apply(partial, group)): "
            "a dist.all_reduce on a tensor that requires grad is invisible to autograd, which torch only warns "
            "about and says will stop working",
    "deadlock": "every rank of the group must call the same all-reduce, in the same order: nothing that depends on "
                "the rank around a collective",
}


def _judge(everyone: list[dict[str, Any] | None]) -> dict[str, Any]:
    for rank, p in enumerate(everyone):
        if p is not None:
            where = f"rank {rank} (rank {p['tp_rank']} of a group of {p['tp']}), x of shape {tuple(p['x'])}"
            return {"passed": False, "message": f"{where} (x_local {tuple(p['x_local'])}): {p['text']}",
                    "hint": HINTS[p["kind"]], "details": {"rank": rank, **p}}
    return {"passed": True, "message": "ok"}


def worker(module: str, name: str | list[str]) -> Any:
    """On every rank: check the learner's ``name`` (a list: each, for ``run_checks``); rank 0 returns the verdict."""
    # gloo's own timeout stays above the watchdog's, so that the watchdog, which names the stuck ranks, speaks first.
    return check_each(module, name, lambda fn, ctx: collect_and_judge(_check_one(fn, ctx), _judge), tp=TP,
                      timeout_s=3 * DEADLOCK_S)


def check_row_parallel_forward(fn: Callable[..., Any], *helpers: Any, world_sizes: tuple[int, ...] = (2, 4),
                               deadlock_s: float = DEADLOCK_S) -> Verdict:
    """Check ``row_parallel_forward(x_local, weight_local, bias, group)`` and the ``g`` it uses; print the verdict.

    Pass the autograd Function (and any other cell-defined helper) after the function:
    ``check_row_parallel_forward(row_parallel_forward, ReduceFromTensorParallelRegion)``.
    World sizes must be even: the first group has 2 ranks, then the whole world is one group.
    """
    bad = [w for w in world_sizes if not isinstance(w, int) or w < TP or w % TP]
    if bad or not world_sizes:
        raise ValueError(f"world_sizes must be even numbers of processes >= {TP}, got {tuple(world_sizes)}")
    verdict = run_check(fn, "lslm.exercises.row_parallel:worker", world_sizes, timeout=180, helpers=helpers,
                        exercise="row_parallel_forward", deadlock_s=deadlock_s)
    if verdict.details.get("kind") == "deadlock":  # the generic hint speaks of send/recv; here it is all-reduces
        verdict.hint = HINTS["deadlock"]
    return report(verdict)


register(Exercise(
    name="row_parallel_forward", notebook="05_tensor_parallel", reference=reference_row_parallel_forward,
    check=check_row_parallel_forward, reference_helpers=(ReferenceReduceFromTensorParallelRegion,),
    hints=("g's forward sums its input over the group and returns the sum; its backward returns the incoming "
           "gradient as it is (one return value per forward argument: None for group). The layer: partial product, "
           "g, then the bias",
           "forward: y = x.clone(); dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group); return y. backward: "
           "return grad_output, None. row_parallel_forward: return "
           "ReduceFromTensorParallelRegion.apply(x_local @ weight_local.t(), group) + bias"),
))
