"""Notebook 06's exercise: a rank's 1F1B order, judged on the simulator (no processes)."""

from __future__ import annotations

import pytest

from lslm.exercises.one_f_one_b import check_one_f_one_b_order, reference_one_f_one_b_order
from lslm.pipeline.schedules import build_schedule


def gpipe_order(p, m, rank):
    return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]


def warmup_one_too_many(p, m, rank):
    w = min(p - rank, m)
    order = [f"F{i}" for i in range(w)]
    for i in range(m - w):
        order += [f"F{w + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - w, m)]


def warmup_without_min(p, m, rank):
    w = p - 1 - rank  # right for m >= p; with m < p it asks for micro-batches that do not exist
    order = [f"F{i}" for i in range(w)]
    for i in range(m - w):
        order += [f"F{w + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - w, m)]


def naive_order(p, m, rank):
    return [x for i in range(m) for x in (f"F{i}", f"B{i}")]


def backwards_reversed(p, m, rank):
    w = min(p - 1 - rank, m)
    order = [f"F{i}" for i in range(w)]
    for i in range(m - w):
        order += [f"F{w + i}", f"B{i}"]
    tail = [f"B{i}" for i in range(m - w, m)]
    return order + tail[::-1]


def forgets_cooldown(p, m, rank):
    w = min(p - 1 - rank, m)
    order = [f"F{i}" for i in range(w)]
    for i in range(m - w):
        order += [f"F{w + i}", f"B{i}"]
    return order


def backward_first(p, m, rank):
    return [x for i in range(m) for x in (f"B{i}", f"F{i}")]


def returns_tuples(p, m, rank):
    return [("F", i) for i in range(m)]


def stub(p, m, rank):
    """The order of rank's forwards and backwards."""
    raise NotImplementedError


def test_reference_equals_lslm_schedule_and_passes(capsys) -> None:
    for p in range(1, 6):
        for m in range(p, 10):
            sched = build_schedule("1f1b", p, m)
            for rank in range(p):
                want = [f"{a.kind}{a.mb}" for a in sched.compute[rank]]
                assert reference_one_f_one_b_order(p, m, rank) == want
    assert check_one_f_one_b_order(reference_one_f_one_b_order).passed
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("candidate, kind", [
    (gpipe_order, "gpipe"), (warmup_one_too_many, "in_flight"), (warmup_without_min, "few_microbatches"),
    (naive_order, "slow"),
    (backwards_reversed, "stuck"), (forgets_cooldown, "count"), (backward_first, "b_before_f"),
    (returns_tuples, "type"),
])
def test_plausible_wrong_orders_are_rejected_with_their_hint(candidate, kind) -> None:
    verdict = check_one_f_one_b_order(candidate)
    assert not verdict.passed and verdict.attempted
    assert verdict.details["kind"] == kind, verdict


def test_the_checker_has_cases_with_fewer_microbatches_than_stages() -> None:
    from lslm.exercises.one_f_one_b import CASES

    assert any(m < p - 1 for p, m in CASES)  # m <= p - 2: rank 0's unclamped warm-up overruns m
    verdict = check_one_f_one_b_order(warmup_without_min)
    assert verdict.details["m"] < verdict.details["p"] and "min(p - 1 - rank, m)" in verdict.hint


def test_stub_is_not_attempted() -> None:
    verdict = check_one_f_one_b_order(stub)
    assert not verdict.attempted and not verdict.passed
