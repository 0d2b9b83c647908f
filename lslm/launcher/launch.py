"""Launch a multi-process job from a notebook or a script, and fail loudly when it fails.

``!torchrun`` in a notebook does not fail the cell when the job fails, and
``mp.spawn`` cannot start a function defined in a cell. :func:`launch` runs
``python -m torch.distributed.run`` as a subprocess on a free port, streams each
rank's output (prefixed ``[rank r]``), enforces a timeout, and returns what every
rank's worker function returned.

**When something goes wrong**, every process of the job is stopped (SIGTERM, then
SIGKILL after 2 s) and nothing is left behind: not a process, not a temporary
folder (torchrun's logs go inside the launch's own folder, removed on every exit).

* *A rank fails.* :class:`LaunchError` names the rank that failed **first** for a
  reason of its own, by time (each rank records when it failed), with its
  traceback. Its peers' errors ("connection closed by peer": they lost it) follow
  as consequences, one line each. A rank that dies without a word (SIGKILL from the
  out-of-memory killer, a segfault) is named with its signal, from torchrun's exit
  codes, and with Python's crash dump when there is one. torchrun's own shutdown
  noise is left out of the message; ``err.output`` keeps the full output.
* *The job runs past ``timeout``.* :class:`LaunchTimeout`, everything killed.
* *Interrupt* (Ctrl-C, the notebook's stop button). Every rank is stopped within
  seconds and ``KeyboardInterrupt`` propagates. ``lslm launch`` in a shell does the
  same on SIGTERM and SIGHUP (what ``timeout``, SLURM and a closed terminal send).
* *The launching Python dies* without any clean-up (a kernel restarted or
  SIGKILLed). The kernel sends each torchrun agent SIGTERM (a parent-death signal),
  the agent stops its workers, and each worker is tied to its agent the same way:
  nothing survives its parent by more than a moment (see ``process_tree``).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil

from lslm.launcher.forkserver import ForkedRank, RankStore, output_file, start_ranks
from lslm.launcher.launch_checks import timeout_seconds, validate
from lslm.launcher.launch_errors import (
    LaunchError,
    LaunchTimeout,
    RankFailure,
    apply_exit_codes,
    apply_rank_exit_codes,
    build_error,
    death_summary,
    is_peer_lost,
)
from lslm.launcher.process_tree import deferred_signals, is_alive, kill_tree
from lslm.launcher.streams import drain, finish_reading, read_lines, tail_lines
from lslm.runtime.startup import free_port

__all__ = ["LaunchError", "LaunchResults", "LaunchTimeout", "launch", "torchrun_command", "validate"]

_PORT_IN_USE = re.compile(r"address already in use|EADDRINUSE|errno 98", re.IGNORECASE)
_RANK_FILE = re.compile(r"^rank(\d+)\.(started\.json|json|error\.json)$")
LAUNCHER_ENV = "LSLM_LAUNCHER"  # the default launcher where launch() is not told one
LAUNCHERS = ("torchrun", "forkserver")
FAILURE_GRACE_S = 3.0  # after a first failure: how long torchrun may take to stop the job itself (and say why)
# Forked ranks have no agent to stop them: after a first failure the launcher does, as torchrun would at once, a
# moment later (so that a peer blocked in a collective can record that it lost the failed rank).
FORKED_FAILURE_GRACE_S = 0.3


class LaunchResults(list):
    """Each rank's return value, indexed by global rank, plus facts about the run."""

    wall_s: float = 0.0
    output: list[str]
    command: list[list[str]]


def torchrun_command(nproc: int, nnodes: int = 1, node_rank: int = 0, port: int | None = None,
                     rdzv_id: str = "lslm", host: str = "127.0.0.1", log_dir: str | None = None) -> list[str]:
    """The ``torchrun`` arguments lslm uses (printable, e.g. to copy onto a real cluster).

    One node: a static rendezvous on ``host:port``. Several nodes: the c10d
    rendezvous, where ranks are assigned in order of arrival. ``log_dir``: where
    torchrun keeps its per-run log folders (default: a new ``/tmp/torchelastic_*``).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--max-restarts=0",
           "--monitor-interval=0.1"]
    if log_dir is not None:
        cmd.append(f"--log-dir={log_dir}")
    if nnodes == 1:
        cmd += ["--nnodes=1", "--node-rank=0", f"--master-addr={host}", f"--master-port={port or 29500}"]
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port or 29500}",
                f"--rdzv-id={rdzv_id}"]
    return cmd


def launch(target: str | Callable[..., Any], nproc: int = 2, *, nnodes: int = 1, timeout: float | None = 300.0,
           output: str = "all", env: dict[str, str] | None = None, pythonpath: Iterable[str] = (),
           launcher: str | None = None, **args: Any) -> LaunchResults:
    """Run ``target`` on ``nproc`` processes (per node) with torchrun; return each rank's result.

    ``target`` is ``"package.module:function"`` (or a module-level function object):
    every rank calls ``function(**args)`` and its JSON-serialisable return value
    becomes ``results[rank]``. ``output`` is ``"all"`` (every rank's lines, prefixed
    ``[rank r]``), ``"rank0"`` or ``"none"``. ``nnodes > 1`` starts that many torchrun
    agents on this machine with a c10d rendezvous, exactly as on a real cluster.
    ``timeout`` is in seconds (``None``: no limit). ``env`` adds environment variables;
    ``pythonpath`` adds import paths. ``launcher``: ``"torchrun"`` (the default) or ``"forkserver"``, which
    forks one machine's ranks from a process that has imported torch once (:mod:`lslm.launcher.forkserver`:
    the same worker and environment, a fraction of a second to start instead of seconds); ``None`` reads
    ``LSLM_LAUNCHER`` from the environment.

    Raises ``ValueError`` for bad input before starting anything (see
    :func:`~lslm.launcher.launch_checks.validate`), :class:`LaunchError` as soon as any
    rank fails, :class:`LaunchTimeout` after ``timeout`` seconds, and re-raises
    ``KeyboardInterrupt``; in every case all processes are stopped first (module doc).
    """
    if output not in ("all", "rank0", "none"):
        raise ValueError(f"output must be 'all', 'rank0' or 'none', got {output!r}")
    env = dict(env or {})
    bad_env = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad_env:
        raise ValueError(f"env must map names to strings, got {bad_env!r}")
    pythonpath = [str(p) for p in pythonpath]
    launcher = launcher_name(launcher, nnodes)
    tgt = validate(target, nproc, nnodes, timeout, args, pythonpath, env={**os.environ, **env})
    last_error: LaunchError | None = None
    for _attempt in range(3):
        try:
            return _run(tgt, int(nproc), int(nnodes), timeout_seconds(timeout), output, env, pythonpath, args,
                        launcher)
        except _PortTaken as exc:
            last_error = exc  # another job took the port between our probe and torchrun's bind
        except KeyboardInterrupt:
            print("lslm.launch: interrupted; every rank of the job was stopped", file=sys.stderr, flush=True)
            raise
    assert last_error is not None
    raise last_error


class _PortTaken(LaunchError):
    pass


class _Ranks:
    """What the launcher knows of each rank, from the files its worker writes and from its process."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: dict[int, psutil.Process | None] = {}  # rank -> its worker (None: already gone)
        self.pids: dict[int, int] = {}
        self.finished: set[int] = set()
        self.failures: dict[int, RankFailure] = {}

    def scan(self) -> None:
        """Read the new started / result / error files."""
        for entry in os.scandir(self.folder):
            m = _RANK_FILE.match(entry.name)
            if not m:
                continue
            rank, kind = int(m.group(1)), m.group(2)
            if kind == "json":
                self.finished.add(rank)
            elif kind == "started.json" and rank not in self.pids:
                self.pids[rank] = json.loads(Path(entry.path).read_text())["pid"]
                try:
                    self.procs[rank] = psutil.Process(self.pids[rank])
                except psutil.Error:
                    self.procs[rank] = None
            elif kind == "error.json" and not (rank in self.failures and self.failures[rank].raised):
                rec = json.loads(Path(entry.path).read_text())
                self.failures[rank] = RankFailure(rank, rec["time"], rec["chain"][-1], traceback=rec["traceback"],
                                                  pid=rec["pid"], secondary=is_peer_lost(rec["chain"]), raised=True)

    def notice_deaths(self) -> None:
        """Record every rank whose process ended without writing a result or an error (killed, crashed)."""
        for rank, proc in self.procs.items():
            if rank in self.finished or rank in self.failures or (proc is not None and is_alive(proc)):
                continue
            # It may have written its file between our scan and its exit: only then is it silent.
            if any((self.folder / f"rank{rank}.{k}").exists() for k in ("json", "error.json")):
                continue
            dump = self.folder / f"rank{rank}.fault.txt"
            crash = dump.read_text().strip() if dump.exists() else ""
            self.failures[rank] = RankFailure(rank, time.time(), death_summary(None), traceback=crash,
                                              pid=self.pids[rank])


def _run(target: str, nproc: int, nnodes: int, timeout: float, output: str, extra_env: dict[str, str],
         pythonpath: list[str], args: dict[str, Any], launcher: str = "torchrun") -> LaunchResults:
    folder = Path(tempfile.mkdtemp(prefix="lslm-launch-"))
    world_size = nproc * nnodes
    procs: list[Any] = []  # torchrun agents (subprocess.Popen), or forked ranks (forkserver.ForkedRank)
    ranks = _Ranks(folder)
    lines: list[str] = []
    store: RankStore | None = None
    try:
        (folder / "args.json").write_text(json.dumps(args))
        if launcher == "forkserver":
            store = RankStore()
        port = store.port if store is not None else free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        env.setdefault("LOGLEVEL", "ERROR")  # torchrun's agent is chatty at WARNING
        # The launching directory first, as `python -m` would see it, then any extra paths.
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
        worker = ["-m", "lslm.launcher.worker", "--target", target, "--args-file", str(folder / "args.json"),
                  "--result-dir", str(folder)]
        q: queue.Queue[str | None] = queue.Queue()
        start = time.perf_counter()
        if store is not None:
            commands = [[sys.executable, *worker]]  # what each rank runs, for results.command
            with deferred_signals():  # a Ctrl-C right now must not leave a forked rank untracked
                procs.extend(_start_forked(worker[2:], nproc, folder, env, store.port, pythonpath, q))
        else:
            # Each agent is torchrun run by lslm.launcher.agent, which dies with this process.
            agent = [sys.executable, "-m", "lslm.launcher.agent", "--parent", str(os.getpid()), "--launch-dir",
                     str(folder), "--"]
            rdzv_id = uuid.uuid4().hex[:12]
            commands = [agent + torchrun_command(nproc, nnodes, node, port, rdzv_id,
                                                 log_dir=str(folder / "torchrun"))[3:] + worker
                        for node in range(nnodes)]
            with deferred_signals():  # a Ctrl-C right now must not leave a started agent untracked
                for cmd in commands:
                    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, text=True, bufsize=1, env=env,
                                         start_new_session=True)
                    procs.append(p)
                    threading.Thread(target=read_lines, args=(p, q), daemon=True).start()
        open_streams, failed_at, timed_out = len(procs), None, False
        grace = FAILURE_GRACE_S if store is None else FORKED_FAILURE_GRACE_S
        while True:
            # Print from this thread: in Jupyter, output from other threads can land in the wrong cell.
            open_streams -= drain(q, lines, output)
            ranks.scan()
            ranks.notice_deaths()
            if ranks.failures and failed_at is None:
                failed_at = time.perf_counter()
            if all(p.poll() is not None for p in procs):
                break
            now = time.perf_counter()
            if failed_at is not None and now - failed_at > grace:
                break  # torchrun did not stop the job by itself in time (or there is no torchrun): we will
            if now - start > timeout:
                timed_out = True
                break
            time.sleep(0.02)
        wall = time.perf_counter() - start
        _stop(procs, ranks)
        finish_reading(q, lines, output, open_streams)
        if not timed_out:
            ranks.scan()  # errors written while torchrun stopped the job (after a timeout, our kill caused them)
        codes = [p.poll() for p in procs]
        if timed_out and not ranks.failures:  # what the kill itself caused is no failure of the job
            raise LaunchTimeout(f"{target} on {world_size} processes did not finish within {timeout:g} s; "
                                "all its processes were killed", output="\n".join(lines))
        if store is not None:
            apply_rank_exit_codes(ranks.failures, dict(enumerate(codes)), ranks.finished, time.time())
        else:
            apply_exit_codes(ranks.failures, ranks.pids, "\n".join(lines), time.time())
        if ranks.failures:
            raise build_error(ranks.failures, world_size, target, lines)
        if any(c != 0 for c in codes):
            text = "\n".join(lines)
            if _PORT_IN_USE.search(text) and not ranks.pids:
                raise _PortTaken(f"port {port} was taken", output=text)
            who = "torchrun" if store is None else "the ranks"
            raise LaunchError(f"{who} exited with codes {codes} running {target} "
                              "(a rendezvous or start-up error: see the output below)", output=text)
        missing = [r for r in range(world_size) if r not in ranks.finished]
        if missing:
            raise LaunchError(f"ranks {missing} exited cleanly but wrote no result", output="\n".join(lines))
        results = LaunchResults(json.loads((folder / f"rank{r}.json").read_text()) for r in range(world_size))
        results.wall_s, results.output, results.command = wall, lines, commands
        return results
    finally:
        _stop(procs, ranks)  # KeyboardInterrupt in a notebook, or any error above
        if store is not None:
            store.close()
        shutil.rmtree(folder, ignore_errors=True)


def launcher_name(launcher: str | None, nnodes: int) -> str:
    """``launcher``, or ``LSLM_LAUNCHER``, or ``"torchrun"``; ``ValueError`` for another name, or for the
    forkserver asked for several nodes (it starts one machine's ranks). ``LSLM_LAUNCHER`` is a default: a
    job of several nodes still goes through torchrun under ``LSLM_LAUNCHER=forkserver``."""
    name = launcher if launcher is not None else os.environ.get(LAUNCHER_ENV, "torchrun")
    if name not in LAUNCHERS:
        source = "launcher" if launcher is not None else LAUNCHER_ENV
        raise ValueError(f"{source} must be one of {', '.join(LAUNCHERS)}, got {name!r}")
    if name == "forkserver" and nnodes != 1 and launcher is None:
        return "torchrun"
    if name == "forkserver" and nnodes != 1:
        raise ValueError(f"the forkserver launcher starts one machine's ranks, got nnodes={nnodes!r}: "
                         "use launcher='torchrun' for several nodes")
    return name


def _start_forked(worker_argv: list[str], nproc: int, folder: Path, env: dict[str, str], port: int,
                  pythonpath: list[str], q: queue.Queue[str | None]) -> list[ForkedRank]:
    """Fork the ranks (see :mod:`lslm.launcher.forkserver`) and follow each one's output file into ``q``."""
    for rank in range(nproc):
        output_file(folder, rank).touch()  # the reader opens it before the rank writes
    forked = start_ranks(worker_argv, nproc, folder, env, port, [*pythonpath, os.getcwd()])
    for rank, proc in enumerate(forked):
        threading.Thread(target=tail_lines, args=(output_file(folder, rank), lambda p=proc: p.poll() is not None, q),
                         daemon=True).start()
    return forked


def _stop(procs: list[Any], ranks: _Ranks) -> None:
    """Kill what is left of the job (agents, their workers, and workers whose agent is gone), then reap."""
    workers = [p for p in ranks.procs.values() if p is not None]
    if not any(p.poll() is None for p in procs) and not any(is_alive(w) for w in workers):
        return
    with deferred_signals():  # a second Ctrl-C must not cut the clean-up short
        kill_tree([p.pid for p in procs if p.poll() is None], extra=workers)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=2.0)
