"""lslm.launch: results, failure propagation, timeouts, ports, bad input, multi-node.

Also the launch's robustness: the root-cause rank first (by time, a rank killed by a
signal included), no orphan when the launching Python dies, Ctrl-C and SIGTERM stop
every rank, no temporary folders left. Pure unit tests where no process is needed.
"""

from __future__ import annotations

import importlib
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lslm.launcher.launch import LaunchError, LaunchTimeout, launch
from lslm.launcher.launch_errors import RankFailure, apply_exit_codes, clean_tail, order_failures
from lslm.launcher.process_tree import is_alive
from tests.helpers import REPO_ROOT, run_workers

GLOO = {"LSLM_BACKEND": "gloo", "LSLM_DEVICE": "cpu"}


@pytest.fixture(autouse=True)
def through_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """These are torchrun's tests: the other files' launches use the fork server (conftest.py), these do not
    (tests/test_launch_forkserver.py has the fork server's)."""
    monkeypatch.setenv("LSLM_LAUNCHER", "torchrun")


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def _lslm_workers_alive(marker: str) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "lslm.launcher.worker" in cmd and marker in cmd:
            alive.append(p)
    return alive


def _launch_in(tmp: Path, monkeypatch: pytest.MonkeyPatch, target: str, nproc: int, **kwargs: object):
    """run_workers, with every temporary folder (ours and torchrun's) inside ``tmp``, to count litter exactly."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return launch(target, nproc=nproc, timeout=120, output="none", env={**GLOO, "TMPDIR": str(tmp)},
                  pythonpath=[str(REPO_ROOT)], **kwargs)


def test_results_come_back_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res = _launch_in(tmp_path, monkeypatch, "lslm.demos.smoke:worker", 2, numel=256)
    assert sorted(os.listdir(tmp_path)) == []  # no lslm-launch-*, no torchelastic_* left behind
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["ok"] for r in res)
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in res)
    assert res[0]["env"]["MASTER_PORT"] == res[1]["env"]["MASTER_PORT"]
    assert res.wall_s > 0


def test_failure_on_rank1_raises_with_its_traceback_and_leaves_no_process(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    before = _descendants()
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        _launch_in(tmp_path, monkeypatch, "lslm.demos.smoke:fail_on_rank", 2, rank=1, message="boom-7f3a")
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"failure took {elapsed:.1f} s to surface"
    err = info.value
    assert err.rank == 1 and err.signal is None
    assert "RuntimeError: boom-7f3a on rank 1" in err.traceback
    assert "fail_on_rank" in err.traceback and "boom-7f3a" in str(err)
    # The message leads with the root cause; rank 0 lost its peer (it may even have failed
    # earlier by the clock) and is listed after it, as a consequence.
    text = str(err)
    assert text.splitlines()[0] == ("rank 1 of 2 failed first running lslm.demos.smoke:fail_on_rank: "
                                    "RuntimeError: boom-7f3a on rank 1")
    assert [(f.rank, f.secondary) for f in err.failures] == [(1, False), (0, True)]
    assert text.index("as consequences") > text.index("boom-7f3a on rank 1") and "\nrank 0: " in text
    # torchrun's shutdown noise is not shown; the full output still has it.
    assert "closing signal" not in text and "SignalException" not in text and "ChildFailedError" not in text
    assert "[rank 1] RuntimeError: boom-7f3a on rank 1" in err.output
    assert sorted(os.listdir(tmp_path)) == []
    time.sleep(0.5)
    assert _descendants() - before == set()
    assert _lslm_workers_alive("fail_on_rank") == []


def test_a_rank_killed_by_a_signal_is_named_with_it() -> None:
    before = _descendants()
    with pytest.raises(LaunchError) as info:
        run_workers("tests.workers:kill_rank", 2, timeout=120, rank=1, sig=int(signal.SIGKILL))
    err = info.value
    assert err.rank == 1 and err.signal == signal.SIGKILL and err.traceback == ""
    first = str(err).splitlines()[0]
    assert first.startswith("rank 1 of 2 was killed by signal 9 (SIGKILL) while running tests.workers:kill_rank")
    assert "out-of-memory killer" in first
    assert [(f.rank, f.secondary) for f in err.failures] == [(1, False), (0, True)]
    assert "[rank 1] about to die" in str(err)  # the dead rank's last words
    time.sleep(0.5)
    assert _descendants() - before == set()


def test_timeout_kills_everything() -> None:
    before = _descendants()
    start = time.perf_counter()
    with pytest.raises(LaunchTimeout, match="did not finish within 5 s"):
        run_workers("lslm.demos.smoke:sleep_forever", 2, timeout=5)
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
    ({"nproc": 2, "timeout": -5}, "timeout must be a positive"),
    ({"nproc": 2, "timeout": float("nan")}, "timeout must be a positive"),
    ({"nproc": 2, "timeout": "10"}, "timeout must be a positive"),
    ({"nproc": 2, "timeout": True}, "timeout must be a positive"),
    ({"nproc": True}, "nproc must be an integer >= 1"),
    ({"nproc": 2.0}, "nproc must be an integer >= 1"),
    ({"nproc": "2"}, "nproc must be an integer >= 1"),
    ({"nproc": 2, "nnodes": True}, "nnodes must be an integer >= 1"),
    ({"nproc": 2, "numell": 8}, "unexpected keyword argument 'numell'.*did you mean 'numel'"),
    ({"nproc": 2, "env": {"LSLM_DEVICE": "cuda"}}, "no CUDA device is available"),
    ({"nproc": 2, "env": {"LSLM_BACKEND": "nccl"}}, "no CUDA device is available"),
    ({"nproc": 2, "env": {"LSLM_DEVICE": "cpu", "LSLM_BACKEND": "nccl"}}, "communicates CUDA tensors only"),
    ({"nproc": 2, "env": {"OMP_NUM_THREADS": 4}}, "env must map names to strings"),
    ({"nproc": 2, "tp": 3}, "does not divide world_size=2"),
    ({"nproc": 4, "tp": 2, "pp": 3}, "does not divide world_size=4"),
    ({"nproc": 2, "output": "some"}, "output must be"),
    ({"nproc": 2, "bad": object()}, "JSON-serialisable"),
])
def test_bad_input_fails_before_any_process_starts(kwargs: dict, needle: str) -> None:
    if "no CUDA device" in needle:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
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

    # (String targets run in every other launch test; one process is enough here.)
    res = launch(echo, nproc=1, output="none", b=[1, 2])
    assert [r["rank"] for r in res] == [0] and res[0]["args"] == {"b": [1, 2]}


def test_output_is_rank_prefixed(capsys: pytest.CaptureFixture[str]) -> None:
    launch("lslm.demos.smoke:worker", nproc=2, output="all", numel=8)
    out = capsys.readouterr().out
    assert "[rank 0] all_reduce of 8 ones over 2 ranks -> 2 (ok)" in out


def test_rank0_output_shows_only_rank_0(capsys: pytest.CaptureFixture[str]) -> None:
    # The filter the launcher applies to every line (a second launch would cost seconds).
    from lslm.launcher.streams import emit as _emit

    lines: list[str] = []
    for line in ("[rank 0] sleeping 0.1 s", "[rank 1] sleeping 0.1 s", "[rank 10] x"):
        _emit(line, lines, "rank0")
    out = capsys.readouterr().out
    assert out == "[rank 0] sleeping 0.1 s\n" and len(lines) == 3  # every line is kept for the error message


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


# -- input checks without processes ---------------------------------------------------------
def test_missing_argument_is_named_before_starting() -> None:
    with pytest.raises(ValueError, match="missing a required argument: 'steps'.*needs_steps\\(steps, lr=0.1\\)"):
        run_workers("tests.workers:needs_steps", 2, lr=0.5)


@pytest.mark.parametrize("timeout", [None, math.inf, 0.5, 7])
def test_timeout_none_or_inf_means_no_limit(timeout: float | None) -> None:
    from lslm.launcher.launch_checks import timeout_seconds, validate

    assert validate("lslm.demos.smoke:echo", 2, timeout=timeout) == "lslm.demos.smoke:echo"
    assert timeout_seconds(timeout) == (math.inf if timeout is None else timeout)


@pytest.mark.parametrize("kwargs,needle", [
    ({"device": "cuda"}, "no CUDA device is available"),
    ({"device": "cuda:1"}, "no CUDA device is available"),
    ({"backend": "nccl"}, "no CUDA device is available"),
    ({"device": "cpu", "backend": "nccl"}, "communicates CUDA tensors only"),
    ({"device": "gpu0"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
    ({"backend": "ncll"}, "backend must be one of"),
])
def test_device_requests_this_machine_cannot_honour(kwargs: dict, needle: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from lslm.runtime.startup import choose_device_and_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    with pytest.raises(ValueError, match=needle):
        choose_device_and_backend(0, 2, **kwargs)
    monkeypatch.setenv("LSLM_DEVICE", "cuda")
    with pytest.raises(ValueError, match=r"device='cuda' \(LSLM_DEVICE\) but no CUDA device is available"):
        choose_device_and_backend(0, 2)


# -- the root cause, from what the launcher collected (pure) ----------------------------------
def test_root_cause_is_the_first_own_failure_by_time_not_by_name() -> None:
    f = [RankFailure(2, 10.5, "ValueError: the real cause", raised=True),
         RankFailure(10, 10.2, "ValueError: an earlier one", raised=True),
         RankFailure(0, 10.1, "RuntimeError: Connection reset by peer", raised=True, secondary=True),
         RankFailure(1, 10.3, "was killed by signal 15 (SIGTERM)", exitcode=-15, secondary=True)]
    assert [x.rank for x in order_failures(f)] == [10, 2, 0, 1]  # "rank10" sorts before "rank2" by name
    assert [x.rank for x in order_failures(f[2:])] == [0, 1]  # only consequences: the earliest


SUMMARY = """\
E1123 15:05:01.388000 9436 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] \
failed (exitcode: -9) local_rank: 1 (pid: 9495) of binary: /usr/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
lslm.launcher.worker FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_15:05:01
  host      : localhost
  rank      : 12 (local_rank: 0)
  exitcode  : -15 (pid: 9494)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 9494
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_15:05:01
  host      : localhost
  rank      : 13 (local_rank: 1)
  exitcode  : -9 (pid: 9495)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 9495
======================================================"""


def test_signals_come_from_torchruns_exit_codes_matched_by_pid() -> None:
    failures = {13: RankFailure(13, 5.0, "died", pid=9495),
                11: RankFailure(11, 4.9, "RuntimeError: Connection closed by peer", raised=True, secondary=True)}
    apply_exit_codes(failures, {13: 9495, 11: 9400}, SUMMARY, when=6.0)
    assert failures[13].signal == signal.SIGKILL and not failures[13].secondary
    assert failures[13].summary == "was killed by signal 9 (SIGKILL)"
    assert failures[12].signal == signal.SIGTERM and failures[12].secondary  # stopped by torchrun: a consequence
    assert failures[11].exitcode is None  # it raised: its own record stands
    assert [f.rank for f in order_failures(failures.values())] == [13, 11, 12]


def test_shown_output_drops_torchruns_shutdown_noise_only() -> None:
    noise = [
        "W1123 15:01:30.635000 6947 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
        "multiprocessing/api.py:1028] Sending process 6953 closing signal SIGTERM",
        "Traceback (most recent call last):",
        '  File "torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler',
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 6947 got signal: 15",
    ]
    mine = ["[rank 0] step 3 loss 2.5", "[rank 1] Traceback (most recent call last):", "[rank 1] ValueError: x"]
    rdzv = ["Traceback (most recent call last):", '  File "run.py", line 9, in main',
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address."]
    assert clean_tail([mine[0], *noise, *mine[1:], *SUMMARY.splitlines()]) == "\n".join(mine)
    assert clean_tail(mine + rdzv, n=4) == "\n".join((mine + rdzv)[-4:])  # not torchrun's shutdown: kept
    assert clean_tail(mine, rank=1) == "\n".join(mine[1:])


def test_error_message_layout() -> None:
    root = RankFailure(3, 1.0, "ValueError: bad shape", traceback="Traceback ...\nValueError: bad shape", raised=True)
    peer = RankFailure(0, 0.9, "RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:553] Connection closed by peer",
                       raised=True, secondary=True)
    err = LaunchError("rank 3 of 4 failed first", rank=3, traceback=root.traceback, output="a\nb",
                      failures=[root, peer], shown="")
    assert str(err) == ("rank 3 of 4 failed first\n\n--- traceback of rank 3 ---\nTraceback ...\nValueError: bad shape"
                        "\n\n--- then, as consequences ---\nrank 0: RuntimeError: Connection closed by peer")


# Ctrl-C as a learner presses it: SIGINT raises KeyboardInterrupt (Python's default handler).
# The tests set that disposition themselves instead of inheriting it: a background job of a
# non-interactive shell (`make test &`, `nohup make test`) starts with SIGINT ignored, and
# Python then leaves it ignored. The launcher deliberately does not restore it: it runs inside
# the learner's own process (kernel or shell), whose disposition is the learner's choice (a
# `nohup` run asked for SIGINT to be ignored), and its agents and workers run in a session of
# their own, stopped by the launcher with SIGTERM, so their SIGINT disposition plays no part.
SET_CTRL_C = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in this process while the test runs, however pytest was started."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_a_second_interrupt_waits_for_the_clean_up() -> None:
    from lslm.launcher.process_tree import deferred_signals

    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_signals():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler would have run by now
            done.append("clean-up finished")
    assert done == ["clean-up finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_signals_keep_an_ignored_interrupt_ignored() -> None:
    # Under nohup SIGINT is ignored: a SIGINT during clean-up is held back, then delivered to the
    # disposition the process had, so it stays ignored (no KeyboardInterrupt the user opted out of).
    from lslm.launcher.process_tree import deferred_signals

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deferred_signals():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        time.sleep(0.05)  # a KeyboardInterrupt would surface here
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


# -- no orphans, interrupts, signals (real processes) -----------------------------------------
def _start(args: list[str]) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def _wait_for(lines: queue.Queue[str], needles: set[str], limit_s: float = 90.0) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + limit_s
    while needles - {n for n in needles if any(n in s for s in seen)}:
        try:
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            raise AssertionError(f"never saw {needles}; output so far:\n" + "\n".join(seen)) from None
    return seen


def _all_gone(procs: list[psutil.Process], limit_s: float = 10.0) -> list[psutil.Process]:
    """Wait (up to ``limit_s``) until none of ``procs`` runs; return the ones still running."""
    deadline = time.monotonic() + limit_s
    while any(is_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in procs if is_alive(p)]


def _module_of(p: psutil.Process) -> str:
    """The module a ``python [-u] -m module ...`` process runs."""
    cmd = p.cmdline()
    return cmd[cmd.index("-m") + 1] if "-m" in cmd else ""


SLEEPERS = ("from lslm.launcher.launch import launch\n"
            "launch('lslm.demos.smoke:sleep_forever', nproc={nproc}, nnodes={nnodes}, output='all', timeout=300, "
            "env={{'LSLM_BACKEND': 'gloo', 'LSLM_DEVICE': 'cpu'}})\n")
READY = {"[rank 0] sleeping 3600.0 s", "[rank 1] sleeping 3600.0 s"}


def test_no_orphans_when_the_launching_python_is_killed() -> None:
    # Two nodes of one rank each, to test both links at once: agent 1 and the launcher are
    # SIGKILLed (in that order, so agent 1 dies before its own parent-death SIGTERM can make it
    # clean up): worker 1 must notice its agent's death on its own, and agent 0 must stop its
    # worker and remove the launch folder when the launcher dies.
    proc, lines = _start(["-c", SLEEPERS.format(nproc=1, nnodes=2)])
    try:
        _wait_for(lines, READY)
        tree = psutil.Process(proc.pid).children(recursive=True)
        agents = [p for p in tree if _module_of(p) == "lslm.launcher.agent"]
        workers = [p for p in tree if _module_of(p) == "lslm.launcher.worker"]
        assert (len(agents), len(workers)) == (2, 2)
        folder = Path(workers[0].cmdline()[workers[0].cmdline().index("--result-dir") + 1])
        assert folder.is_dir()
        agents[1].kill()
        proc.kill()
        proc.wait()
        assert _all_gone(tree) == []
        deadline = time.monotonic() + 5
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not folder.exists()  # agent 0 removed the launch folder the dead launcher left
    finally:
        proc.kill()


def test_interrupt_stops_every_rank_and_reraises_keyboard_interrupt() -> None:
    sleepers = SLEEPERS.format(nproc=2, nnodes=1).splitlines()
    code = (SET_CTRL_C + "try:\n" + "".join("    " + line + "\n" for line in sleepers)
            + "except KeyboardInterrupt:\n    print('caught KeyboardInterrupt', flush=True)\n")
    proc, lines = _start(["-c", code])
    try:
        _wait_for(lines, READY)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) == 3  # one agent, two workers
        proc.send_signal(signal.SIGINT)
        tail = _wait_for(lines, {"caught KeyboardInterrupt"}, limit_s=15)
        assert proc.wait(timeout=10) == 0
        assert _all_gone(tree) == []
        assert any("interrupted; every rank of the job was stopped" in s for s in tail)
    finally:
        proc.kill()


def test_cli_launch_stops_every_rank_on_sigterm() -> None:
    proc, lines = _start(["-m", "lslm.cli", "launch", "lslm.demos.smoke:sleep_forever", "--nproc", "2",
                          "--backend", "gloo", "--device", "cpu"])
    try:
        _wait_for(lines, READY)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) == 3
        proc.send_signal(signal.SIGTERM)
        _wait_for(lines, {"lslm launch: stopped by SIGTERM"}, limit_s=15)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert _all_gone(tree) == []
    finally:
        proc.kill()


def test_cli_launch_takes_worker_arguments_after_options(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    launch_module = importlib.import_module("lslm.launcher.launch")  # the attribute of that name is the function
    from lslm.cli import main

    calls = []
    monkeypatch.setattr(launch_module, "launch", lambda target, **kw: calls.append((target, kw)) or [{"ok": 1}])
    assert main(["launch", "pkg.mod:fn", "--nproc", "3", "numel=8", "name=x", "--device", "cpu"]) == 0
    assert calls == [("pkg.mod:fn", {"nproc": 3, "nnodes": 1, "timeout": 600.0, "output": "all",
                                     "env": {"LSLM_DEVICE": "cpu"}, "numel": 8, "name": "x"})]
    assert '"ok": 1' in capsys.readouterr().out


# -- exercises leave no temporary folder ------------------------------------------------------
@pytest.mark.parametrize("outcome", ["passed", "failed", "crashed", "interrupted"])
def test_exercise_checks_leave_no_temporary_folder(outcome: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    launch_module = importlib.import_module("lslm.launcher.launch")  # the attribute of that name is the function
    from lslm.exercises.core import run_check

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen: list[Path] = []

    def fake_launch(target: str, *, pythonpath: list[str], module: str, **kw: object) -> list[dict]:
        folder = Path(pythonpath[0])
        assert (folder / f"{module}.py").is_file()
        seen.append(folder)
        if outcome == "crashed":
            raise LaunchError("rank 1 failed", rank=1, traceback="ValueError: x")
        if outcome == "interrupted":
            raise KeyboardInterrupt
        return [{"passed": outcome == "passed", "message": "m"}]

    monkeypatch.setattr(launch_module, "launch", fake_launch)

    def solution(x: int) -> int:
        return x

    if outcome == "interrupted":
        with pytest.raises(KeyboardInterrupt):
            run_check(solution, "pkg.mod:checker", [2, 3])
    else:
        assert bool(run_check(solution, "pkg.mod:checker", [2, 3])) == (outcome == "passed")
    assert len(seen) == (2 if outcome == "passed" else 1) and seen[0].parent == tmp_path
    assert os.listdir(tmp_path) == []
