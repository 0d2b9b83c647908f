"""Notebook 04's exercise: a correct gradient sync passes, the classic mistakes are caught with the right hint."""

from __future__ import annotations

from lslm.exercises.grad_sync import check_grad_sync


def sync_gradients(model, world_size):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # noqa: F821 - dist comes from the exercise header
            p.grad /= world_size


def sync_gradients_no_divide(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # noqa: F821


def sync_gradients_no_sync(model, world_size):
    for p in model.parameters():
        p.grad /= 1


def sync_gradients_reduces_the_parameter(model, world_size):
    # picotron's naive-DP bug: a hook that receives the parameter treats it as the gradient.
    for p in model.parameters():
        dist.all_reduce(p.data, op=dist.ReduceOp.SUM)  # noqa: F821
        p.data /= world_size


def test_correct_solution_passes(capsys) -> None:
    verdict = check_grad_sync(sync_gradients)
    assert verdict.passed, verdict
    assert "2, 3 processes" in verdict.message
    assert capsys.readouterr().out.startswith("PASSED")


def test_forgetting_to_divide_is_rejected() -> None:
    verdict = check_grad_sync(sync_gradients_no_divide, world_sizes=(2,))
    assert not verdict.passed
    assert "divide by world_size" in verdict.hint
    assert verdict.details["kind"] == "no_divide"


def test_no_communication_is_rejected() -> None:
    verdict = check_grad_sync(sync_gradients_no_sync, world_sizes=(2,))
    assert not verdict.passed and verdict.details["kind"] == "unsynced"
    assert "expected" in verdict.message and "dist.all_reduce" in verdict.hint


def test_reducing_the_parameter_instead_of_its_grad_is_rejected() -> None:
    verdict = check_grad_sync(sync_gradients_reduces_the_parameter, world_sizes=(2,))
    assert not verdict.passed and verdict.details["kind"] == "param"
    assert "not its gradient" in verdict.hint
