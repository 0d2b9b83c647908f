"""Launch a multi-process job from a notebook or a script, and fail loudly when it fails.

``!torchrun`` in a notebook does not fail the cell when the job fails, and
``mp.spawn`` cannot start a function defined in a cell. :func:`launch` runs
``python -m torch.distributed.run`` as a subprocess on a free port, streams each
rank's output (prefixed ``[rank r]``), enforces a timeout, and returns what every
rank's worker function returned. When any rank raises, the whole process tree is
killed and :class:`LaunchError` carries that rank's traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from lslm.runtime.startup import free_port

_RANK_LINE = re.compile(r"^\[rank (\d+)\] ")
_PORT_IN_USE = re.compile(r"address already in use|EADDRINUSE|errno 98", re.IGNORECASE)


class LaunchError(RuntimeError):
    """A launched job failed. ``rank`` is the first failing rank (None if unknown),
    ``traceback`` its Python traceback, ``output`` the last lines of the job's output."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "", output: str = "") -> None:
        self.rank = rank
        self.traceback = traceback
        self.output = output
        text = message
        if traceback:
            text += f"\n\n--- traceback of rank {rank} ---\n{traceback.rstrip()}"
        elif output:
            text += f"\n\n--- last output ---\n{output.rstrip()}"
        super().__init__(text)


class LaunchTimeout(LaunchError):
    """The job ran past its ``timeout`` and was killed."""


class LaunchResults(list):
    """Each rank's return value, indexed by global rank, plus facts about the run."""

    wall_s: float = 0.0
    output: list[str]
    command: list[list[str]]


@dataclass(frozen=True)
class _Plan:
    target: str
    nproc: int
    nnodes: int
    world_size: int


def _target_string(target: str | Callable[..., Any]) -> str:
    if callable(target):
        module = getattr(target, "__module__", None)
        name = getattr(target, "__qualname__", "")
        if module in (None, "__main__") or "<locals>" in name or "<lambda>" in name:
            raise ValueError(
                f"{target!r} is defined in a notebook cell or __main__; launched processes cannot import it. "
                "Put the worker in a module (lslm.recipes has many) and pass 'package.module:function', "
                "or use lslm.exercises to run a cell-defined function.")
        return f"{module}:{name}"
    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be 'package.module:function' or a module-level function, got {target!r}")
    return target


def _check_target(target: str, extra_path: Iterable[str]) -> None:
    module_name, _, attr = target.partition(":")
    added = [p for p in extra_path if p not in sys.path]
    sys.path[:0] = added
    try:
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise ValueError(f"unknown target {target!r}: no module named {module_name!r} can be imported")
        module = importlib.import_module(module_name)
        fn = getattr(module, attr or "worker", None)
        if not callable(fn):
            raise ValueError(f"unknown target {target!r}: {module_name!r} has no function {attr or 'worker'!r}")
    finally:
        for p in added:
            sys.path.remove(p)


def validate(target: str | Callable[..., Any], nproc: int, nnodes: int = 1, timeout: float = 300.0,
             args: dict[str, Any] | None = None, pythonpath: Iterable[str] = ()) -> str:
    """Check a launch request before any process starts; return the target as a string.

    Raises ``ValueError`` for ``nproc < 1``, ``nnodes < 1``, a non-positive timeout, an
    unknown target, or worker arguments that are not JSON-serialisable.
    """
    for name, value in (("nproc", nproc), ("nnodes", nnodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    tgt = _target_string(target)
    _check_target(tgt, pythonpath)
    grid_sizes = {k: (args or {}).get(k) for k in ("tp", "pp", "dp") if (args or {}).get(k) is not None}
    if grid_sizes:
        # Workers take the grid sizes as tp/pp/dp by convention: reject a grid that
        # cannot tile the world now, not after N processes have started.
        from lslm.runtime.grid import resolve_sizes

        resolve_sizes(nproc * nnodes, **grid_sizes)
    try:
        json.dumps(args or {})
    except TypeError as exc:
        raise ValueError(f"worker arguments must be JSON-serialisable (numbers, strings, lists, dicts): {exc}") from exc
    return tgt


def torchrun_command(nproc: int, nnodes: int = 1, node_rank: int = 0, port: int | None = None,
                     rdzv_id: str = "lslm", host: str = "127.0.0.1") -> list[str]:
    """The ``torchrun`` arguments lslm uses (printable, e.g. to copy onto a real cluster).

    One node: a static rendezvous on ``host:port``. Several nodes: the c10d
    rendezvous, where ranks are assigned in order of arrival.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--max-restarts=0",
           "--monitor-interval=0.1"]
    if nnodes == 1:
        cmd += ["--nnodes=1", "--node-rank=0", f"--master-addr={host}", f"--master-port={port or 29500}"]
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port or 29500}",
                f"--rdzv-id={rdzv_id}"]
    return cmd


def _kill_tree(procs: list[subprocess.Popen[str]], grace_s: float = 2.0) -> None:
    """Terminate every process we started and all their descendants (workers run in their own sessions)."""
    victims: list[psutil.Process] = []
    for p in procs:
        try:
            root = psutil.Process(p.pid)
            victims += root.children(recursive=True)
            victims.append(root)
        except psutil.NoSuchProcess:
            continue
    for v in victims:
        try:
            v.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=grace_s)
    for v in alive:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:  # pragma: no cover - killed above
            pass


def _reader(proc: subprocess.Popen[str], q: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        q.put(line.rstrip("\n"))
    q.put(None)


def launch(target: str | Callable[..., Any], nproc: int = 2, *, nnodes: int = 1, timeout: float = 300.0,
           output: str = "all", env: dict[str, str] | None = None, pythonpath: Iterable[str] = (),
           **args: Any) -> LaunchResults:
    """Run ``target`` on ``nproc`` processes (per node) with torchrun; return each rank's result.

    ``target`` is ``"package.module:function"`` (or a module-level function object):
    every rank calls ``function(**args)`` and its JSON-serialisable return value
    becomes ``results[rank]``. ``output`` is ``"all"`` (every rank's lines, prefixed
    ``[rank r]``), ``"rank0"`` or ``"none"``. ``nnodes > 1`` starts that many torchrun
    agents on this machine with a c10d rendezvous, exactly as on a real cluster.
    ``env`` adds environment variables; ``pythonpath`` adds import paths.

    Raises ``ValueError`` for bad input before starting anything, :class:`LaunchError`
    as soon as any rank fails (with its traceback, all processes killed), and
    :class:`LaunchTimeout` after ``timeout`` seconds.
    """
    if output not in ("all", "rank0", "none"):
        raise ValueError(f"output must be 'all', 'rank0' or 'none', got {output!r}")
    pythonpath = [str(p) for p in pythonpath]
    tgt = validate(target, nproc, nnodes, timeout, args, pythonpath)
    plan = _Plan(target=tgt, nproc=nproc, nnodes=nnodes, world_size=nproc * nnodes)
    last_error: LaunchError | None = None
    for _attempt in range(3):
        try:
            return _run(plan, timeout, output, env or {}, pythonpath, args)
        except _PortTaken as exc:
            last_error = exc  # another job took the port between our probe and torchrun's bind
    assert last_error is not None
    raise last_error


class _PortTaken(LaunchError):
    pass


def _run(plan: _Plan, timeout: float, output: str, extra_env: dict[str, str], pythonpath: list[str],
         args: dict[str, Any]) -> LaunchResults:
    result_dir = Path(tempfile.mkdtemp(prefix="lslm-launch-"))
    args_file = result_dir / "args.json"
    args_file.write_text(json.dumps(args))
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, plan.nproc))))
    env.setdefault("LOGLEVEL", "ERROR")  # torchrun's agent is chatty at WARNING
    # The launching directory first, as `python -m` would see it, then any extra paths.
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
    worker = ["-m", "lslm.runtime.worker", "--target", plan.target, "--args-file", str(args_file),
              "--result-dir", str(result_dir)]
    rdzv_id = uuid.uuid4().hex[:12]
    commands = [torchrun_command(plan.nproc, plan.nnodes, node, port, rdzv_id) + worker for node in range(plan.nnodes)]

    lines: list[str] = []
    q: queue.Queue[str | None] = queue.Queue()
    procs: list[subprocess.Popen[str]] = []
    start = time.perf_counter()
    try:
        for cmd in commands:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 text=True, bufsize=1, env=env, start_new_session=True)
            procs.append(p)
            threading.Thread(target=_reader, args=(p, q), daemon=True).start()
        open_streams = len(procs)
        while True:
            # Print from this thread: in Jupyter, output from other threads can land in the wrong cell.
            open_streams -= _drain(q, lines, output)
            failed = sorted(result_dir.glob("rank*.error.txt"))
            if failed:
                rank = int(re.findall(r"\d+", failed[0].name)[0])
                time.sleep(0.2)  # let the other ranks' last words arrive before we kill them
                _kill_tree(procs)
                _drain(q, lines, output)
                raise LaunchError(f"rank {rank} of {plan.world_size} failed running {plan.target}", rank=rank,
                                  traceback=failed[0].read_text(), output="\n".join(lines[-40:]))
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                while open_streams > 0:
                    try:
                        item = q.get(timeout=2.0)
                    except queue.Empty:
                        break
                    if item is None:
                        open_streams -= 1
                    else:
                        _emit(item, lines, output)
                break
            if time.perf_counter() - start > timeout:
                _kill_tree(procs)
                _drain(q, lines, output)
                raise LaunchTimeout(f"{plan.target} on {plan.world_size} processes did not finish within "
                                    f"{timeout:g} s; all its processes were killed", output="\n".join(lines[-40:]))
            time.sleep(0.02)
        wall = time.perf_counter() - start
        failed = sorted(result_dir.glob("rank*.error.txt"))
        if failed:
            rank = int(re.findall(r"\d+", failed[0].name)[0])
            raise LaunchError(f"rank {rank} of {plan.world_size} failed running {plan.target}", rank=rank,
                              traceback=failed[0].read_text(), output="\n".join(lines[-40:]))
        if any(c != 0 for c in codes):
            tail = "\n".join(lines[-40:])
            if _PORT_IN_USE.search(tail) and not list(result_dir.glob("rank*.json")):
                raise _PortTaken(f"port {port} was taken", output=tail)
            raise LaunchError(f"torchrun exited with codes {codes} running {plan.target} "
                              f"(a rank died without a Python traceback: killed, out of memory, or a rendezvous error)",
                              output=tail)
        results = LaunchResults()
        for r in range(plan.world_size):
            path = result_dir / f"rank{r}.json"
            if not path.exists():
                raise LaunchError(f"rank {r} exited cleanly but wrote no result", output="\n".join(lines[-40:]))
            results.append(json.loads(path.read_text()))
        results.wall_s = wall
        results.output = lines
        results.command = commands
        return results
    finally:
        if any(p.poll() is None for p in procs):
            _kill_tree(procs)  # KeyboardInterrupt in a notebook, or any error above
        shutil.rmtree(result_dir, ignore_errors=True)


def _emit(line: str, lines: list[str], output: str) -> None:
    lines.append(line)
    if output == "all" or (output == "rank0" and line.startswith("[rank 0] ")):
        print(line, flush=True)


def _drain(q: queue.Queue[str | None], lines: list[str], output: str) -> int:
    """Print everything queued so far; return how many streams ended."""
    ended = 0
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return ended
        if item is None:
            ended += 1
        else:
            _emit(item, lines, output)
