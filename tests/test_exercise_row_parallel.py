"""Notebook 05's exercise: a row-parallel linear (its g and its forward) against nn.Linear's slices.

The reference passes and each plausible mistake gets its own diagnosis and hint. Candidates
are judged in one launch per world size (``run_checks``): 2 processes (one group of 2) and
4 processes (two groups of 2, then the world as one group of 4), where a reduction over
the default group instead of ``group`` shows. The public check runs once, on the reference (2 processes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lslm.exercises import check_row_parallel_forward, hint, solution
from lslm.exercises.core import Verdict, run_checks
from lslm.exercises.registry import get
from lslm.exercises.row_parallel import ReferenceReduceFromTensorParallelRegion, reference_row_parallel_forward

WORKER = "lslm.exercises.row_parallel:worker"

# In the captured module, `torch` and `dist` come from the exercise header, as for a learner's cell.


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(fn, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(fn, grad_output):
        return grad_output, None


def row_parallel_forward(x_local, weight_local, bias, group):
    return ReduceFromTensorParallelRegion.apply(x_local @ weight_local.t(), group) + bias


class InPlaceReduce(torch.autograd.Function):  # Megatron's way: all-reduce the input in place and return it
    @staticmethod
    def forward(fn, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(fn, grad_output):
        return grad_output, None


def row_parallel_in_place(x_local, weight_local, bias, group):
    return InPlaceReduce.apply(x_local @ weight_local.t(), group) + bias


class ForgetsToReduce(torch.autograd.Function):  # (a) forward without the all-reduce
    @staticmethod
    def forward(fn, x, group):
        return x.clone()

    @staticmethod
    def backward(fn, grad_output):
        return grad_output, None


def partial_sums(x_local, weight_local, bias, group):
    return ForgetsToReduce.apply(x_local @ weight_local.t(), group) + bias


def bias_on_every_rank(x_local, weight_local, bias, group):  # (b) bias inside the sum
    return ReduceFromTensorParallelRegion.apply(x_local @ weight_local.t() + bias, group)


class ReducesBothWays(torch.autograd.Function):  # (c) the backward all-reduces too
    @staticmethod
    def forward(fn, x, group):
        fn.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(fn, grad_output):
        grad = grad_output.clone()
        dist.all_reduce(grad, group=fn.group)
        return grad, None


def backward_reduces(x_local, weight_local, bias, group):
    return ReducesBothWays.apply(x_local @ weight_local.t(), group) + bias


class AveragesInBackward(torch.autograd.Function):  # right numbers (dy is replicated), a wasted all-reduce
    @staticmethod
    def forward(fn, x, group):
        fn.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(fn, grad_output):
        grad = grad_output.clone()
        dist.all_reduce(grad, group=fn.group)
        return grad / dist.get_world_size(fn.group), None


def backward_averages(x_local, weight_local, bias, group):
    return AveragesInBackward.apply(x_local @ weight_local.t(), group) + bias


def bias_split(x_local, weight_local, bias, group):
    return ReduceFromTensorParallelRegion.apply(x_local @ weight_local.t() + bias / dist.get_world_size(group), group)


def no_autograd_function(x_local, weight_local, bias, group):
    partial = x_local @ weight_local.t()
    dist.all_reduce(partial, group=group)  # invisible to autograd: right numbers, only a warning
    return partial + bias


class WorldReduce(torch.autograd.Function):
    @staticmethod
    def forward(fn, x, group):
        y = x.clone()
        dist.all_reduce(y)  # forgot group=group: the default group, every process
        return y

    @staticmethod
    def backward(fn, grad_output):
        return grad_output, None


def reduces_over_world(x_local, weight_local, bias, group):
    return WorldReduce.apply(x_local @ weight_local.t(), group) + bias


class OneReturnValue(torch.autograd.Function):
    @staticmethod
    def forward(fn, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(fn, grad_output):
        return grad_output  # forgets the None for group


def backward_one_value(x_local, weight_local, bias, group):
    return OneReturnValue.apply(x_local @ weight_local.t(), group) + bias


def g_not_passed(x_local, weight_local, bias, group):
    return NotCaptured.apply(x_local @ weight_local.t(), group) + bias  # noqa: F821 - not passed to the check


class StubReduce(torch.autograd.Function):
    """g: forward sums x over group; backward passes the gradient through."""

    @staticmethod
    def forward(fn, x, group):
        raise NotImplementedError

    @staticmethod
    def backward(fn, grad_output):
        raise NotImplementedError


def row_parallel_stub(x_local, weight_local, bias, group):
    """y = x @ W.T + b from this rank's shards."""
    raise NotImplementedError


HELPERS = (ReferenceReduceFromTensorParallelRegion, ReduceFromTensorParallelRegion, InPlaceReduce, ForgetsToReduce,
           ReducesBothWays, AveragesInBackward, WorldReduce, OneReturnValue)
GOOD = (reference_row_parallel_forward, row_parallel_forward, row_parallel_in_place)
WRONG = {  # world size -> candidate -> the kind its verdict must name
    2: {partial_sums: "no_reduce", bias_on_every_rank: "bias_every_rank", backward_reduces: "backward_reduces",
        backward_averages: "backward_comm", bias_split: "bias_split", no_autograd_function: "no_g",
        backward_one_value: "error_backward", g_not_passed: "name"},
    4: {reduces_over_world: "wrong_group", partial_sums: "no_reduce", bias_on_every_rank: "bias_every_rank",
        backward_reduces: "backward_reduces"},
}


@pytest.fixture(scope="module")
def verdicts() -> dict[int, dict[str, Verdict]]:
    """Every candidate at 2 and 4 processes, one launch per world size."""
    out = {}
    for world, wrong in WRONG.items():
        fns = [*GOOD, *wrong, row_parallel_stub]
        out[world] = {f.__name__: v for f, v in zip(fns, run_checks(fns, WORKER, world, helpers=HELPERS))}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_reference_and_a_learner_style_answer_pass(verdicts, world) -> None:
    for fn in GOOD:
        assert verdicts[world][fn.__name__].passed, verdicts[world][fn.__name__]
    assert verdicts[world]["row_parallel_stub"].state == "not attempted"


@pytest.mark.parametrize("world, candidate", [(w, f) for w, fs in WRONG.items() for f in fs],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_each_mistake_gets_its_own_diagnosis(verdicts, world, candidate) -> None:
    verdict = verdicts[world][candidate.__name__]
    assert not verdict.passed and verdict.details["kind"] == WRONG[world][candidate], verdict


def test_messages_name_rank_input_expected_and_got_and_hints_aim_at_the_mistake(verdicts) -> None:
    v = verdicts[2]["partial_sums"]
    assert v.message.startswith("rank 0 (rank 0 of a group of 2), x of shape (4, 8) (x_local (4, 4)): output[")
    assert "expected" in v.message and ", got " in v.message and "nothing was summed" in v.message
    assert "all-reduces (SUM) over group" in v.hint
    v = verdicts[2]["bias_on_every_rank"]
    assert "x @ W.T + 2 * bias" in v.message and "add it once, after g" in v.hint
    v = verdicts[2]["backward_reduces"]
    assert "grad of x_local[" in v.message and "(2 times too big)" in v.message
    assert "return the incoming gradient unchanged" in v.hint
    v = verdicts[4]["backward_reduces"]
    assert "(2 times too big)" in v.message  # groups of 2 on 4 processes: the factor is the group's size
    assert "backward called dist.all_reduce" in verdicts[2]["backward_averages"].message
    assert "(2 times too small)" in verdicts[2]["bias_split"].message
    assert "invisible to autograd" in verdicts[2]["no_autograd_function"].hint
    assert "None for group" in verdicts[2]["backward_one_value"].hint
    assert "NotCaptured" in verdicts[2]["g_not_passed"].message
    assert "check_row_parallel_forward(row_parallel_forward, ReduceFromTensorParallelRegion)" \
        in verdicts[2]["g_not_passed"].hint
    v = verdicts[4]["reduces_over_world"]
    assert "the all-reduce ran over ranks [0, 1, 2, 3]; this tensor-parallel group is [0, 1]" in v.message
    assert "group=group" in v.hint


def test_the_public_check_accepts_the_reference(capsys) -> None:
    # 2 processes only: the batch launches above already judge the reference on 4.
    v = check_row_parallel_forward(reference_row_parallel_forward, ReferenceReduceFromTensorParallelRegion,
                                   world_sizes=(2,))
    assert v.passed, v
    assert capsys.readouterr().out == "PASSED: matches the reference on 2 processes\n"


def test_stubs_are_not_attempted_and_nothing_is_launched(capsys) -> None:
    v = check_row_parallel_forward(row_parallel_stub, StubReduce, world_sizes=(2,))
    assert v.state == "not attempted"
    assert v.details["stubs"] == ["row_parallel_stub", "StubReduce.forward", "StubReduce.backward"]
    assert capsys.readouterr().out.startswith("NOT ATTEMPTED YET: `row_parallel_stub`, `StubReduce.forward`")


def test_world_sizes_are_validated_before_any_launch() -> None:
    with pytest.raises(ValueError, match="even numbers of processes"):
        check_row_parallel_forward(row_parallel_forward, ReduceFromTensorParallelRegion, world_sizes=(3,))


def test_hint_and_solution_are_registered(capsys) -> None:
    assert get("row_parallel_forward").notebook == "05_tensor_parallel"
    hint("row_parallel_forward")
    assert "hint 2:" in capsys.readouterr().out
    solution("row_parallel_forward")
    out = capsys.readouterr().out
    assert "def reference_row_parallel_forward" in out and "class ReferenceReduceFromTensorParallelRegion" in out
