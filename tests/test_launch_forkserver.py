"""lslm.launch(launcher="forkserver"): ranks forked from a server that imported torch once, told what torchrun
tells them, and failing, timing out and dying with their launcher as torchrun's ranks do (tests/test_launch.py
has the same cases for torchrun). The other test files launch this way (conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lslm.launcher.forkserver import fork_server
from lslm.launcher.launch import LaunchError, LaunchTimeout, launch, launcher_name
from lslm.launcher.process_tree import is_alive
from tests.helpers import REPO_ROOT

GLOO = {"LSLM_BACKEND": "gloo", "LSLM_DEVICE": "cpu"}


def _forked(target: str, nproc: int, **kwargs: object):
    return launch(target, nproc=nproc, output="none", env=GLOO, pythonpath=[str(REPO_ROOT)], launcher="forkserver",
                  **kwargs)


def _ranks_alive() -> list[psutil.Process]:
    """The fork server's children still running (the ranks of a job that should be over)."""
    server = psutil.Process(fork_server()._proc.pid)
    return [p for p in server.children() if is_alive(p)]


def test_ranks_see_what_torchrun_gives_its_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # after the server started (it may have): the ranks follow the launcher's directory
    monkeypatch.setenv("LSLM_TEST_MARK", "set-after-the-server-started")
    kwargs = {"timeout": 120, "output": "none", "env": GLOO, "pythonpath": [str(REPO_ROOT)]}
    fork_server()  # started before the variable above changes nothing: each rank gets the launch's environment
    forked = launch("tests.workers:describe_rank", nproc=2, launcher="forkserver", **kwargs)
    torchrun = launch("tests.workers:describe_rank", nproc=2, launcher="torchrun", **kwargs)
    for f, t in zip(forked, torchrun):
        differ = {k for k in f["env"] if f["env"][k] != t["env"][k]}
        assert differ == {"MASTER_PORT", "TORCHELASTIC_RUN_ID"}, (f["env"], t["env"])  # one job's port and id
        assert f["env"]["LSLM_TEST_MARK"] == "set-after-the-server-started"
        assert f["cwd"] == t["cwd"] == str(tmp_path)
        assert f["threads"] == t["threads"] == int(t["env"]["OMP_NUM_THREADS"])
        assert f["sum"] == t["sum"] == 1.0
        assert str(REPO_ROOT) in f["path"]
    assert len({r["env"]["MASTER_PORT"] for r in forked}) == 1 and len({r["pid"] for r in forked}) == 2
    assert {r["ppid"] for r in forked} == {fork_server()._proc.pid}


def test_a_failing_rank_is_named_with_its_traceback_and_no_rank_is_left() -> None:
    with pytest.raises(LaunchError) as info:
        _forked("lslm.demos.smoke:fail_on_rank", 2, timeout=60, rank=1, message="boom-5c1d")
    err = info.value
    assert err.rank == 1 and err.signal is None
    assert str(err).splitlines()[0] == ("rank 1 of 2 failed first running lslm.demos.smoke:fail_on_rank: "
                                        "RuntimeError: boom-5c1d on rank 1")
    assert [(f.rank, f.secondary) for f in err.failures] == [(1, False), (0, True)]
    assert "[rank 1] RuntimeError: boom-5c1d on rank 1" in err.output
    assert _ranks_alive() == []


def test_a_rank_killed_by_a_signal_is_named_with_it() -> None:
    with pytest.raises(LaunchError) as info:
        _forked("tests.workers:kill_rank", 2, timeout=60, rank=1, sig=int(signal.SIGKILL))
    err = info.value
    assert err.rank == 1 and err.signal == signal.SIGKILL and err.traceback == ""
    assert str(err).startswith("rank 1 of 2 was killed by signal 9 (SIGKILL) while running tests.workers:kill_rank")
    assert "[rank 1] about to die" in str(err)
    assert _ranks_alive() == []


def test_timeout_kills_every_rank() -> None:
    start = time.perf_counter()
    with pytest.raises(LaunchTimeout, match="did not finish within 3 s"):
        _forked("lslm.demos.smoke:sleep_forever", 2, timeout=3)
    assert time.perf_counter() - start < 15
    assert _ranks_alive() == []


def test_output_is_rank_prefixed(capsys: pytest.CaptureFixture[str]) -> None:
    launch("lslm.demos.smoke:sleep_forever", nproc=2, output="all", env=GLOO, launcher="forkserver", seconds=0.01)
    shown = capsys.readouterr().out.splitlines()
    assert sorted(shown) == ["[rank 0] sleeping 0.01 s", "[rank 1] sleeping 0.01 s"]


def test_bad_launcher_names_are_refused_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="launcher must be one of torchrun, forkserver, got 'fork'"):
        launch("lslm.demos.smoke:worker", nproc=2, launcher="fork")
    monkeypatch.setenv("LSLM_LAUNCHER", "mpirun")
    with pytest.raises(ValueError, match="LSLM_LAUNCHER must be one of torchrun, forkserver, got 'mpirun'"):
        launch("lslm.demos.smoke:worker", nproc=2)
    with pytest.raises(ValueError, match="one machine's ranks, got nnodes=2"):
        launch("lslm.demos.smoke:worker", nproc=1, nnodes=2, launcher="forkserver")
    monkeypatch.setenv("LSLM_LAUNCHER", "forkserver")  # a default only: two nodes still go through torchrun
    assert launcher_name(None, 2) == "torchrun" and launcher_name(None, 1) == "forkserver"


def test_the_server_and_its_ranks_die_with_the_launching_python() -> None:
    code = ("from lslm.launcher.launch import launch\n"
            "launch('lslm.demos.smoke:sleep_forever', nproc=2, output='all', timeout=300, launcher='forkserver', "
            "env={'LSLM_BACKEND': 'gloo', 'LSLM_DEVICE': 'cpu'})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if sum("sleeping" in s for s in seen) == 2:
                break
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) == 3, tree  # the server and its two ranks
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(is_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in tree if is_alive(p)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
