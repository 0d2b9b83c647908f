"""Notebook 04b's exercise: exposed communication of bucketed DDP, judged against lslm.metrics.step_time."""

from __future__ import annotations

import pytest

from lslm.exercises import hint, solution
from lslm.exercises.exposed_comm import CASES, check_exposed_comm, reference_exposed_comm
from lslm.metrics.step_time import LinkCost, exposed_comm_s


def _t(size, n, alpha, beta):
    return 0.0 if n == 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * size * beta


def no_overlap(buckets, n, alpha, beta, backward_s):
    return sum(_t(s, n, alpha, beta) for s in buckets)


def perfect_overlap(buckets, n, alpha, beta, backward_s):
    return max(0.0, sum(_t(s, n, alpha, beta) for s in buckets) - backward_s)


def no_queue(buckets, n, alpha, beta, backward_s):
    total, done, last = sum(buckets), 0.0, 0.0
    for s in buckets:
        done += s
        last = max(last, backward_s * done / total + _t(s, n, alpha, beta))  # each bucket starts when ready
    return last - backward_s


def point_to_point_cost(buckets, n, alpha, beta, backward_s):
    total, done, end = sum(buckets), 0.0, 0.0
    for s in buckets:
        done += s
        end = max(backward_s * done / total, end) + alpha + s * beta  # one message, not a ring
    return end - backward_s


def returns_milliseconds_as_text(buckets, n, alpha, beta, backward_s):
    return f"{reference_exposed_comm(buckets, n, alpha, beta, backward_s) * 1e3:.1f} ms"


def exposed_comm(buckets, n, alpha, beta, backward_s):
    """The exposed communication in seconds."""
    raise NotImplementedError


def test_reference_equals_the_model_and_passes(capsys) -> None:
    for buckets, n, alpha, beta, backward in CASES:
        want = exposed_comm_s(list(buckets), n, LinkCost(alpha, beta), backward)
        assert reference_exposed_comm(list(buckets), n, alpha, beta, backward) == pytest.approx(want, rel=1e-12)
    verdict = check_exposed_comm(reference_exposed_comm)
    assert verdict.passed, verdict
    assert capsys.readouterr().out.startswith("PASSED")


@pytest.mark.parametrize("candidate, kind", [
    (no_overlap, "no_overlap"), (perfect_overlap, "perfect_overlap"), (no_queue, "no_queue"),
    (point_to_point_cost, "ring_cost"), (returns_milliseconds_as_text, "type"),
])
def test_plausible_wrong_answers_are_rejected_with_their_hint(candidate, kind) -> None:
    verdict = check_exposed_comm(candidate)
    assert not verdict.passed and verdict.attempted
    assert verdict.details["kind"] == kind, verdict


def test_stub_is_not_attempted_and_help_is_there(capsys) -> None:
    verdict = check_exposed_comm(exposed_comm)
    assert verdict.state == "not attempted"
    hint("exposed_comm")
    solution("exposed_comm")
    out = capsys.readouterr().out
    assert "hint 2:" in out and "def reference_exposed_comm" in out
