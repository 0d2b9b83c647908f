"""The exercise mechanism: stubs, capture of several cell objects, the registry, and notebook 01's checker.

The launched checks of ``shard_range`` run in one launch per world size (``run_checks``),
each judging every candidate below, so the many wrong answers cost two launches.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from lslm.exercises import check_shard_range, hint, materialise, reference_shard_range, solution
from lslm.exercises.core import Verdict, capture, not_attempted, run_checks, run_local
from lslm.exercises.registry import exercises, get
from lslm.exercises.source import is_stub

SHARDING = "lslm.exercises.sharding:worker"


# --- candidate solutions of shard_range (module level: the checker reads their source) ---

def shard_range(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    base, extra = divmod(n_items, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_range_drops_remainder(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    per = n_items // world_size
    return rank * per, (rank + 1) * per


def shard_range_stop_misses_extra(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    base, extra = divmod(n_items, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base  # off by one: an extra rank's stop forgets its extra item


def shard_range_inclusive_stop(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    base, extra = divmod(n_items, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0) - 1


def shard_range_overlaps(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    per = -(-n_items // world_size)  # ceil for every rank, start not shifted: ranges overlap
    start = rank * (n_items // world_size)
    return start, min(n_items, start + per)


def shard_range_reversed(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    base, extra = divmod(n_items, world_size)
    r = world_size - 1 - rank
    start = r * base + min(r, extra)
    return start, start + base + (1 if r < extra else 0)


def shard_range_last_takes_rest(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    per = n_items // world_size
    return rank * per, n_items if rank == world_size - 1 else (rank + 1) * per


def shard_range_crashes(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    raise ZeroDivisionError("oops")


def shard_range_stub(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return (start, stop) of this rank's share."""
    raise NotImplementedError


WRONG = {  # candidate -> the kind of mistake its verdict must name
    shard_range_drops_remainder: "remainder_dropped",
    shard_range_stop_misses_extra: "off_by_one_stop",
    shard_range_inclusive_stop: "inclusive_stop",
    shard_range_overlaps: "overlap",
    shard_range_reversed: "order",
    shard_range_last_takes_rest: "uneven",
    shard_range_crashes: "error",
}


@pytest.fixture(scope="module")
def sharding_verdicts() -> dict[int, dict[str, Verdict]]:
    """Every candidate judged at 2 and at 3 processes: one launch per world size."""
    out = {}
    for world in (2, 3):
        fns = [shard_range, *WRONG, shard_range_stub]
        out[world] = {f.__name__: v for f, v in zip(fns, run_checks(fns, SHARDING, world))}
    return out


# --- mechanism, no processes ---

def test_reference_covers_everything_once() -> None:
    for world in range(1, 6):
        for n in range(0, 23):
            shards = [reference_shard_range(n, r, world) for r in range(world)]
            assert shards[0][0] == 0 and shards[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
            sizes = [b - a for a, b in shards]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_materialise_writes_an_importable_module(tmp_path) -> None:
    directory, module = materialise(shard_range, tmp_path)
    text = (directory / f"{module}.py").read_text()
    assert "import torch" in text and "def shard_range" in text


def stub_with_docstring(x):
    """Only a docstring and the raise."""
    raise NotImplementedError("write me")


def stub_bare(x):
    raise NotImplementedError


def not_a_stub(x):
    if x < 0:
        raise NotImplementedError
    return x


class HalfDone:
    def done(self):
        return 1

    def todo(self):
        """To write."""
        raise NotImplementedError


def test_stubs_are_detected_statically() -> None:
    assert is_stub(stub_with_docstring) and is_stub(stub_bare) and is_stub(HalfDone)
    assert not is_stub(not_a_stub) and not is_stub(shard_range)
    verdict = not_attempted([shard_range, HalfDone], "shard_range")
    assert verdict is not None and verdict.details["stubs"] == ["HalfDone.todo"]


def test_a_stub_is_not_attempted_and_launches_nothing(capsys) -> None:
    verdict = check_shard_range(shard_range_stub)  # would take seconds if it launched
    assert not verdict.passed and not verdict.attempted and verdict.state == "not attempted"
    assert capsys.readouterr().out == (
        'NOT ATTEMPTED YET: `shard_range_stub` still raises NotImplementedError. Write it and run this cell again; '
        '`hint("shard_range")` for a hint, `solution("shard_range")` for ours.\n')


# A learner's helper function and class, used by the learner's main function.
class Counter:
    def __init__(self, start: int) -> None:
        self.value = start

    def add(self, k: int) -> int:
        self.value += k
        return self.value


def double(x: int) -> int:
    return 2 * x


def uses_helpers(x: int) -> int:
    return Counter(double(x)).add(1)


def test_capture_of_several_objects_is_self_contained(tmp_path) -> None:
    directory, module = capture([uses_helpers, double, Counter], tmp_path)
    text = (directory / f"{module}.py").read_text()
    assert text.index("class Counter") < text.index("def uses_helpers")  # helpers first, main last
    sys.path.insert(0, str(directory))
    try:
        assert importlib.import_module(module).uses_helpers(3) == 7  # only what was captured
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop(module, None)
    with pytest.raises(ValueError, match="both named"):
        capture([uses_helpers, uses_helpers], tmp_path)
    with pytest.raises(ValueError, match="lambda"):
        capture([lambda x: x], tmp_path)


def test_a_class_typed_in_an_ipython_cell_is_captured(tmp_path) -> None:
    shell_mod = pytest.importorskip("IPython.core.interactiveshell")
    shell = shell_mod.InteractiveShell()
    shell.run_cell("class Box:\n    def __init__(self, v):\n        self.v = v\n\n"
                   "def unbox(x):\n    return Box(x).v + 1\n")
    ns = shell.user_ns
    directory, module = capture([ns["unbox"], ns["Box"]], tmp_path)
    assert "class Box" in (directory / f"{module}.py").read_text()


def test_run_local_reports_stub_error_and_verdict() -> None:
    def judge(fn):
        return {"passed": fn(2) == 4, "message": "twice", "hint": "multiply by two"}

    assert run_local(stub_bare, judge, exercise="x").state == "not attempted"
    assert run_local(double, judge).passed
    assert run_local(lambda_free_error, judge).details["kind"] == "error"
    wrong = run_local(not_a_stub, judge)
    assert wrong.state == "failed" and wrong.hint == "multiply by two"


def lambda_free_error(x):
    return x / 0


def test_registry_hint_and_solution(capsys) -> None:
    assert {"shard_range", "ring_all_gather", "predict_model_state_bytes"} <= set(exercises())
    hint("shard_range")
    assert capsys.readouterr().out.startswith("hint 1: ")
    solution("shard_range")
    assert "def reference_shard_range" in capsys.readouterr().out
    with pytest.raises(ValueError, match="known exercises: .*shard_range"):
        get("shard_rnage")
    for ex in exercises().values():
        assert ex.hints and callable(ex.check) and ex.notebook[:2].isdigit()


# --- notebook 01's checker on real processes ---

def test_correct_solution_passes_end_to_end(capsys) -> None:
    verdict = check_shard_range(shard_range, world_sizes=(2,))
    assert verdict.passed, verdict
    assert capsys.readouterr().out.startswith("PASSED")


@pytest.mark.parametrize("world", [2, 3])
def test_reference_passes(sharding_verdicts, world) -> None:
    assert sharding_verdicts[world]["shard_range"].passed
    assert sharding_verdicts[world]["shard_range_stub"].state == "not attempted"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("candidate", list(WRONG), ids=lambda f: f.__name__)
def test_each_mistake_gets_its_own_hint(sharding_verdicts, world, candidate) -> None:
    verdict = sharding_verdicts[world][candidate.__name__]
    assert not verdict.passed and verdict.details["kind"] == WRONG[candidate], verdict
    remainder_hint = "n_items % world_size ranks take one extra item"
    assert (remainder_hint in verdict.hint) == (WRONG[candidate] == "remainder_dropped")


def test_wrong_solution_names_rank_and_input(sharding_verdicts) -> None:
    verdict = sharding_verdicts[2]["shard_range_drops_remainder"]
    assert verdict.details["rank"] == 0 and verdict.details["n_items"] == 1
    assert "rank 0, n_items=1: expected (0, 1), got (0, 0) (all ranks: (0, 0), (0, 0))" in verdict.message
    assert str(verdict).startswith("NOT YET")
    crash = sharding_verdicts[2]["shard_range_crashes"]
    assert "ZeroDivisionError" in crash.message
    inclusive = sharding_verdicts[2]["shard_range_inclusive_stop"]
    assert "stop is exclusive" in inclusive.hint
