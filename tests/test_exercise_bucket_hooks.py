"""Notebook 04's exercise: bucketed all-reduce overlapped with backward.

The reference passes; each classic mistake is rejected with the message and hint aimed at it. All candidates
are judged in ONE 2-process launch (``run_checks``), so the whole file costs one launch.
"""

from __future__ import annotations

import pytest

from lslm.exercises.bucket_hooks import check_install_bucket_hooks, reference_install_bucket_hooks
from lslm.exercises.core import run_checks

# The wrong solutions below use `dist` and `torch` from the capture header, as a notebook cell would.
# ruff: noqa: F821


def naive_after_backward(buckets, world_size):
    # The naive sync of section 3 moved into finish(): correct gradients, nothing overlaps.
    def finish():
        for bucket in buckets:
            for p in bucket:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world_size
    return finish


def one_allreduce_per_parameter(buckets, world_size):
    works = []

    def hook(p):
        works.append((p, dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True)))

    for bucket in buckets:
        for p in bucket:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for p, work in works:
            work.wait()
            p.grad /= world_size
        works.clear()
    return finish


def _bucketed(buckets, world_size, *, blocking=False, wait_in_hook=False, divide=True, reset=True, at_end=False):
    # One parametrised bucketed solution: each flag is one classic mistake.
    missing = [len(b) for b in buckets]
    flats, works = [None] * len(buckets), [None] * len(buckets)
    where = {id(p): i for i, b in enumerate(buckets) for p in b}
    seen = []

    def launch(b):
        flats[b] = torch.cat([p.grad.reshape(-1) for p in buckets[b]])
        works[b] = dist.all_reduce(flats[b], op=dist.ReduceOp.SUM, async_op=not blocking)
        if wait_in_hook:
            works[b].wait()

    def hook(param):
        seen.append(param)
        if at_end:
            if len(seen) == len(where):
                for b in range(len(buckets)):
                    launch(b)
            return
        b = where[id(param)]
        missing[b] -= 1
        if missing[b] == 0:
            launch(b)

    for bucket in buckets:
        for p in bucket:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for b, bucket in enumerate(buckets):
            if works[b] is not None:
                works[b].wait()
            if divide:
                flats[b] /= world_size
            offset = 0
            for p in bucket:
                p.grad.copy_(flats[b][offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            if reset:
                missing[b] = len(bucket)
        seen.clear()
    return finish


def blocking_allreduce_in_hook(buckets, world_size):
    return _bucketed(buckets, world_size, blocking=True)


def waits_in_hook(buckets, world_size):
    return _bucketed(buckets, world_size, wait_in_hook=True)


def forgets_to_divide(buckets, world_size):
    return _bucketed(buckets, world_size, divide=False)


def never_resets(buckets, world_size):
    return _bucketed(buckets, world_size, reset=False)


def launches_all_at_the_end(buckets, world_size):
    return _bucketed(buckets, world_size, at_end=True)


def install_bucket_hooks(buckets, world_size):
    """The notebook's stub."""
    raise NotImplementedError


CANDIDATES = [reference_install_bucket_hooks, naive_after_backward, one_allreduce_per_parameter,
              blocking_allreduce_in_hook, waits_in_hook, forgets_to_divide, never_resets, launches_all_at_the_end]


@pytest.fixture(scope="module")
def verdicts() -> dict:
    # _bucketed is captured with the candidates that call it (a helper, as a notebook cell may have).
    found = run_checks(CANDIDATES, "lslm.exercises.bucket_hooks:worker", 2, timeout=180, helpers=[_bucketed])
    return {fn.__name__: v for fn, v in zip(CANDIDATES, found)}


def test_reference_passes(verdicts) -> None:
    assert verdicts["reference_install_bucket_hooks"].passed, verdicts["reference_install_bucket_hooks"]


@pytest.mark.parametrize("name, kind, message, hint", [
    ("naive_after_backward", "after_backward", "all 6 all-reduces were issued after backward returned",
     "naive sync, nothing overlaps"),
    ("one_allreduce_per_parameter", "per_param", "6 all-reduces for 3 buckets", "once per bucket"),
    ("blocking_allreduce_in_hook", "blocking", "without async_op=True", "pass async_op=True"),
    ("waits_in_hook", "wait_in_hook", "waited on before backward returned", "wait on them in finish()"),
    ("forgets_to_divide", "no_divide", "world_size times the mean", "divide by world_size"),
    ("never_resets", "reset", "step 2", "reset each bucket's count"),
    ("launches_all_at_the_end", "late", "issued when 6 of 6 gradients were ready", "as soon as its own last"),
])
def test_mistake_is_named(verdicts, name, kind, message, hint) -> None:
    v = verdicts[name]
    assert not v.passed and v.details["kind"] == kind, v
    assert message in v.message and hint in v.hint, v


def test_stub_is_not_attempted_and_launches_nothing(capsys) -> None:
    v = check_install_bucket_hooks(install_bucket_hooks)
    assert v.state == "not attempted"
    assert 'hint("install_bucket_hooks")' in capsys.readouterr().out
