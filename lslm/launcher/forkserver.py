"""Start one machine's ranks by forking them from a server that has already imported torch: no torchrun.

``lslm.launch(..., launcher="forkserver")`` (or ``LSLM_LAUNCHER=forkserver`` in the environment) starts its
ranks here instead of through torchrun. A torchrun job pays, every time, for one interpreter that imports
torch for the agent and one per rank that imports torch and lslm again: seconds of CPU per launch, which
dominate a short job on a laptop and a test suite of hundreds of launches. Here a server process
(:func:`serve`, started once per launching process and kept) imports torch and
lslm once, and every rank of every later job is a ``fork()`` of it, ready at once.

What a rank sees is what torchrun gives it: the same environment variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, the ``TORCHELASTIC_*``
set), the same rendezvous (a ``TCPStore`` hosted by the launching process, joined by the ranks as
torchrun's ranks join their agent's store), the same working directory, import path and thread count
(``OMP_NUM_THREADS``), and the same :mod:`lslm.launcher.worker` entry point with its result, error and
crash-dump files. What differs:

* one machine only (``nnodes == 1``), and no agent: the launcher watches the ranks itself;
* each rank's output goes to a file in the launch folder, which the launcher follows and prints;
* the modules the server imported are those of the moment it started: an edit to lslm reaches forked ranks
  after the launching process restarts (a notebook: restart the kernel).

Forking is safe here because the server never runs an operator and has one thread: no OpenMP pool, CUDA
context or gloo thread exists in it to be copied half-way (why a process that has *used* torch must not fork).
The server dies with the launching process (a parent-death signal, and the end of its request pipe), and
its ranks die with the server.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Imported once by the server: what every rank would otherwise import on its own.
PRELOAD = ("torch", "torch.distributed", "lslm.runtime", "lslm.launcher.worker")


class ForkServer:
    """The launching process's handle on its server: send fork requests, learn pids and exit codes."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from lslm.launcher.forkserver import serve; serve({os.getpid()})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))})
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self.exit_codes: dict[int, int] = {}  # pid -> exit code (negative: the signal)
        self._next = 0
        threading.Thread(target=self._read, daemon=True).start()

    def alive(self) -> bool:
        """Whether the server still runs (it is restarted when not)."""
        return self._proc.poll() is None

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._changed:
                if "code" in msg:
                    self.exit_codes[msg["pid"]] = msg["code"]
                else:
                    self._pids[msg["id"]] = msg["pid"]
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def fork(self, env: dict[str, str], cwd: str, sys_path: list[str], argv: list[str], out: str,
             timeout_s: float = 60.0) -> int:
        """Fork one rank running ``lslm.launcher.worker`` with ``argv``; return its pid."""
        assert self._proc.stdin is not None
        with self._lock:
            rid, self._next = self._next, self._next + 1
            self._proc.stdin.write(json.dumps({"id": rid, "env": env, "cwd": cwd, "sys_path": sys_path,
                                               "argv": argv, "out": out}) + "\n")
            self._proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while rid not in self._pids:
                if not self.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the lslm fork server (pid {self._proc.pid}) did not start a rank")
                self._changed.wait(0.1)
            return self._pids.pop(rid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` seconds for ``pid`` to end; its exit code, or ``None``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while pid not in self.exit_codes and self.alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(0.1 if left is None else min(left, 0.1))
            return self.exit_codes.get(pid)


_servers: dict[int, ForkServer] = {}  # this process's server, by pid (a forked child must not reuse its parent's)


def fork_server() -> ForkServer:
    """This process's fork server, started on first use (and again if it died)."""
    server = _servers.get(os.getpid())
    if server is None or not server.alive():
        server = _servers[os.getpid()] = ForkServer()
    return server


class ForkedRank:
    """One rank's process, with the few methods of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid

    def poll(self) -> int | None:
        """The exit code (negative: the signal) once the rank has ended, else ``None``."""
        code = self._server.exit_codes.get(self.pid)
        if code is None and not self._server.alive():
            return -int(signal.SIGKILL)  # the server died, and its ranks with it
        return code

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds for the rank to end; return its exit code (``None``: still running)."""
        return self._server.wait(self.pid, timeout)


class RankStore:
    """The job's rendezvous store, hosted by the launching process (as torchrun's agent hosts it)."""

    def __init__(self) -> None:
        from torch.distributed import TCPStore

        # Port 0: the system picks a free port when the server binds it, so no other job can take it between a
        # probe and the bind (the race a fixed free port has). The timeout is the server's own; each rank's
        # client uses the one its init_process_group gives.
        self.store: Any = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
        self.port = int(self.store.port)

    def close(self) -> None:
        """Drop the store (its server thread stops with the last reference)."""
        self.store = None


def rank_environment(base: dict[str, str], rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """The environment torchrun gives local rank ``rank`` of a one-node job of ``nproc`` ranks."""
    return {
        **base,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def output_file(folder: Path, rank: int) -> Path:
    """Where rank ``rank``'s stdout and stderr go (its lines already carry the ``[rank r]`` prefix)."""
    return folder / f"rank{rank}.out"


def start_ranks(worker_argv: list[str], nproc: int, folder: Path, env: dict[str, str], port: int,
                sys_path: list[str]) -> list[ForkedRank]:
    """Fork ``nproc`` ranks from the server, each running ``lslm.launcher.worker`` with ``worker_argv``.

    ``env`` is the job's whole environment (the launcher's plus its additions); ``sys_path`` goes in front of
    each rank's import path (what ``PYTHONPATH`` does for a torchrun worker); ``port`` is the store's.
    """
    server = fork_server()
    run_id = uuid.uuid4().hex[:12]
    return [ForkedRank(server, server.fork(rank_environment(env, rank, nproc, port, run_id), os.getcwd(), sys_path,
                                           worker_argv, str(output_file(folder, rank))))
            for rank in range(nproc)]


# --- the server process ---------------------------------------------------------------------------------------

def _rank_main(request: dict[str, Any]) -> None:
    """In a forked child: take the job's environment, directory, path and output file, then be the worker."""
    fd = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    import torch

    # torch read OMP_NUM_THREADS when the server imported it; this rank's share is set here instead.
    with contextlib.suppress(ValueError):
        torch.set_num_threads(max(1, int(request["env"].get("OMP_NUM_THREADS", "1"))))
    from lslm.launcher import worker
    from lslm.runtime.startup import exit_process

    exit_process(worker.main(request["argv"]))


def serve(parent: int) -> None:
    """The server's main loop (``parent``: the launching process, whose death ends it).

    Reads fork requests (JSON lines) on stdin; answers each with the child's pid, and every child's exit with
    its exit code."""
    from lslm.launcher.process_tree import die_with_parent

    die_with_parent(parent, signal.SIGTERM)
    for name in PRELOAD:
        __import__(name)
    children: set[int] = set()
    chld_r, chld_w = os.pipe()
    os.set_blocking(chld_w, False)
    signal.set_wakeup_fd(chld_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up byte is written
    stdin = sys.stdin.fileno()
    pending = b""

    def reply(msg: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    while True:
        ready, _, _ = select.select([stdin, chld_r], [], [])
        if chld_r in ready:
            os.read(chld_r, 4096)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                reply({"pid": pid, "code": os.waitstatus_to_exitcode(status)})
        if stdin in ready:
            data = os.read(stdin, 1 << 16)
            if not data:
                return  # the launcher is gone; the ranks die with us (their parent-death signal)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        os.close(chld_r)
                        os.close(chld_w)
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        os.setsid()  # its own process group, as torchrun's workers have
                        devnull = os.open(os.devnull, os.O_RDONLY)
                        os.dup2(devnull, 0)  # the request pipe is the server's alone
                        os.close(devnull)
                        _rank_main(request)
                    except SystemExit as exc:  # exit_process's normal exit (no gloo in this rank): as Python's
                        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
                        atexit._run_exitfuncs()
                    finally:
                        for stream in (sys.stdout, sys.stderr):
                            with contextlib.suppress(Exception):
                                stream.flush()
                        os._exit(code)  # never back into the server's loop
                children.add(pid)
                reply({"id": request["id"], "pid": pid})
