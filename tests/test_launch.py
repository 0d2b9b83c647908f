"""lslm.launch: results, failure propagation, timeouts, ports, bad input, multi-node."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

from lslm.runtime.launch import LaunchError, LaunchTimeout, launch
from tests.helpers import run_workers


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def _lslm_workers_alive(marker: str) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "lslm.runtime.worker" in cmd and marker in cmd:
            alive.append(p)
    return alive


def test_results_come_back_per_rank() -> None:
    res = run_workers("lslm.demos.smoke:worker", 2, numel=256)
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["ok"] for r in res)
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in res)
    assert res[0]["env"]["MASTER_PORT"] == res[1]["env"]["MASTER_PORT"]
    assert res.wall_s > 0


def test_failure_on_rank1_raises_with_its_traceback_and_leaves_no_process() -> None:
    before = _descendants()
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        run_workers("lslm.demos.smoke:fail_on_rank", 2, timeout=120, rank=1, message="boom-7f3a")
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"failure took {elapsed:.1f} s to surface"
    err = info.value
    assert err.rank == 1
    assert "RuntimeError: boom-7f3a on rank 1" in err.traceback
    assert "fail_on_rank" in err.traceback and "boom-7f3a" in str(err)
    time.sleep(0.5)
    assert _descendants() - before == set()
    assert _lslm_workers_alive("fail_on_rank") == []


def test_timeout_kills_everything() -> None:
    before = _descendants()
    start = time.perf_counter()
    with pytest.raises(LaunchTimeout, match="did not finish within 8 s"):
        run_workers("lslm.demos.smoke:sleep_forever", 2, timeout=8)
    assert time.perf_counter() - start < 20
    time.sleep(0.5)
    assert _descendants() - before == set()
    assert _lslm_workers_alive("sleep_forever") == []


def test_two_concurrent_launches_do_not_collide() -> None:
    results: dict[int, object] = {}

    def go(i: int) -> None:
        try:
            results[i] = run_workers("lslm.demos.smoke:worker", 2, numel=16 + i)
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ports = set()
    for i in range(2):
        res = results[i]
        assert not isinstance(res, Exception), res
        assert all(r["ok"] for r in res)  # type: ignore[union-attr]
        assert res[0]["ledger"]["all_reduce"]["bytes"] == (16 + i) * 4  # type: ignore[index]
        ports.add(res[0]["env"]["MASTER_PORT"])  # type: ignore[index]
    assert len(ports) == 2


@pytest.mark.parametrize("kwargs,needle", [
    ({"nproc": 0}, "nproc must be an integer >= 1"),
    ({"nproc": -2}, "nproc must be an integer >= 1"),
    ({"nproc": 2, "nnodes": 0}, "nnodes must be an integer >= 1"),
    ({"nproc": 2, "timeout": 0}, "timeout must be a positive"),
    ({"nproc": 2, "tp": 3}, "does not divide world_size=2"),
    ({"nproc": 4, "tp": 2, "pp": 3}, "does not divide world_size=4"),
    ({"nproc": 2, "output": "some"}, "output must be"),
    ({"nproc": 2, "bad": object()}, "JSON-serialisable"),
])
def test_bad_input_fails_before_any_process_starts(kwargs: dict, needle: str) -> None:
    before = _descendants()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=needle):
        launch("lslm.demos.smoke:worker", **kwargs)
    assert time.perf_counter() - start < 2
    assert _descendants() - before == set()


@pytest.mark.parametrize("target,needle", [
    ("lslm.recipes.no_such_module:worker", "no module named 'lslm.recipes.no_such_module'"),
    ("lslm.demos.smoke:no_such_function", "has no function 'no_such_function'"),
    ("", "target must be"),
])
def test_unknown_target(target: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        launch(target, nproc=2)


def test_cell_defined_function_is_refused_with_a_hint() -> None:
    def local_fn() -> None:
        pass

    with pytest.raises(ValueError, match="notebook cell"):
        launch(local_fn, nproc=2)


def test_module_level_function_object_is_accepted() -> None:
    from lslm.demos.smoke import echo

    res = run_workers(echo.__module__ + ":echo", 2, a=1)
    assert [r["rank"] for r in res] == [0, 1] and res[1]["args"] == {"a": 1}
    res2 = launch(echo, nproc=1, output="none", b=[1, 2])
    assert res2[0]["args"] == {"b": [1, 2]}


def test_output_is_rank_prefixed(capsys: pytest.CaptureFixture[str]) -> None:
    launch("lslm.demos.smoke:worker", nproc=2, output="all", numel=8)
    out = capsys.readouterr().out
    assert "[rank 0] all_reduce of 8 ones over 2 ranks -> 2 (ok)" in out
    launch("lslm.demos.smoke:sleep_forever", nproc=2, output="rank0", seconds=0.1)
    out = capsys.readouterr().out
    assert "[rank 0] sleeping 0.1 s" in out and "[rank 1]" not in out


def test_two_nodes_of_two_processes() -> None:
    res = run_workers("lslm.demos.smoke:worker", 2, nnodes=2, timeout=180)
    assert len(res) == 4
    assert sorted(r["rank"] for r in res) == [0, 1, 2, 3]
    assert all(r["ok"] and r["world_size"] == 4 for r in res)
    assert sorted((r["node_rank"], r["local_rank"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # c10d hands out global ranks node by node: the two ranks of one node are consecutive.
    by_node: dict[int, list[int]] = {}
    for r in res:
        by_node.setdefault(r["node_rank"], []).append(r["rank"])
    assert sorted(sorted(v) for v in by_node.values()) == [[0, 1], [2, 3]]
