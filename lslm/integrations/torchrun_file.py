"""Run a training *script file* under torchrun from Python, and fail loudly when it fails.

:func:`lslm.launch` runs a function (``"package.module:function"``) and returns what
each rank returned; a script written for ``torchrun script.py --flag value`` has no
such function to call. :func:`torchrun_file` runs exactly that command line
(``python -m torch.distributed.run`` is what the ``torchrun`` executable runs), on a free
port, streams its output, and raises :class:`~lslm.launcher.launch_errors.LaunchError`
when torchrun exits with an error, so a notebook cell fails with the job (``!torchrun``
in a cell would not). On a timeout or an interrupt every process of the job is stopped;
torchrun runs inside :mod:`lslm.launcher.agent`, as for ``lslm.launch``, so it also dies with
this process.
"""

from __future__ import annotations

import os
import queue
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from lslm.launcher.launch import torchrun_command
from lslm.launcher.launch_checks import positive_int, timeout_seconds
from lslm.launcher.launch_errors import LaunchError, LaunchTimeout
from lslm.launcher.process_tree import deferred_signals, kill_tree
from lslm.launcher.streams import drain, finish_reading, read_lines
from lslm.runtime.startup import free_port

__all__ = ["shell_line", "torchrun_file"]


def shell_line(script: str | os.PathLike[str], args: Sequence[str] = (), nproc: int = 2) -> str:
    """The ``torchrun`` command you would type in a shell for ``script`` (one node, ``nproc`` processes)."""
    return shlex.join(["torchrun", f"--nproc-per-node={nproc}", str(script), *args])


def torchrun_file(script: str | os.PathLike[str], args: Sequence[str] = (), nproc: int = 2, *,
                  timeout: float | None = 300.0, env: dict[str, str] | None = None, quiet: bool = False) -> list[str]:
    """Run ``torchrun --nproc-per-node=nproc script *args`` on this machine; return its output lines.

    Output is printed as it arrives (unless ``quiet``). Raises ``ValueError`` for a
    missing script or a bad ``nproc`` / ``timeout`` (before anything starts),
    :class:`LaunchError` when the job exits with an error (with its output) and
    :class:`LaunchTimeout` after ``timeout`` seconds; every process of the job is
    stopped in both cases and on ``KeyboardInterrupt``.
    """
    path = Path(script)
    if not path.is_file():
        raise ValueError(f"no script at {path.resolve()}; pass the path of a .py file")
    nproc = positive_int("nproc", nproc)
    limit = timeout_seconds(timeout)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "ERROR", **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # torchrun runs inside lslm's agent, as for lslm.launch: if this Python dies (a kernel restarted),
    # the agent gets a parent-death signal and torchrun stops the workers; no orphans.
    # torchrun's log folders go into a folder of ours, removed on every exit path (by the agent if we die).
    logs = tempfile.mkdtemp(prefix="lslm-torchrun-")
    agent = [sys.executable, "-m", "lslm.launcher.agent", "--parent", str(os.getpid()), "--launch-dir", logs, "--"]
    cmd = [*agent, *torchrun_command(nproc, port=free_port(), log_dir=logs)[3:], str(path), *map(str, args)]
    lines: list[str] = []
    q: queue.Queue[str | None] = queue.Queue()
    output = "none" if quiet else "all"
    with deferred_signals():  # a Ctrl-C right now must not leave a started agent untracked
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, bufsize=1, env=full_env, start_new_session=True)
        threading.Thread(target=read_lines, args=(proc, q), daemon=True).start()
    start = time.perf_counter()
    try:
        # Print from this thread: in Jupyter, output printed by other threads can land in another cell.
        while proc.poll() is None:
            if time.perf_counter() - start > limit:
                raise LaunchTimeout(f"{path.name} on {nproc} processes did not finish within {limit:g} s; "
                                    "all its processes were stopped", output="\n".join(lines))
            drain(q, lines, output)
            time.sleep(0.02)
        finish_reading(q, lines, output, 1)
        code = proc.returncode
    finally:
        if proc.poll() is None:
            with deferred_signals():  # a second Ctrl-C must not cut the clean-up short
                kill_tree([proc.pid])
                proc.wait(timeout=5.0)
        shutil.rmtree(logs, ignore_errors=True)
    if code != 0:
        tail = "\n".join(lines[-20:])
        raise LaunchError(f"torchrun {path.name} exited with code {code}; last lines:\n{tail}", output="\n".join(lines))
    return lines
