"""A job's output, streamed: one reader thread per process, lines printed as they come and all of them kept.

:func:`lslm.launch` and :func:`lslm.integrations.torchrun_file.torchrun_file` both stream torchrun's merged output
this way: :func:`read_lines` in a daemon thread per process feeds a queue, :func:`drain` prints what is queued
between polls, :func:`finish_reading` collects the last lines once the processes have exited. Ranks forked by
:mod:`lslm.launcher.forkserver` write to a file each instead of a pipe: :func:`tail_lines` follows such a file.
"""

from __future__ import annotations

import queue
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["drain", "emit", "finish_reading", "read_lines", "tail_lines"]


def read_lines(proc: subprocess.Popen[str], q: queue.Queue[str | None]) -> None:
    """Put every line of ``proc``'s stdout on ``q`` (newline stripped), then ``None`` (run it in a thread)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        q.put(line.rstrip("\n"))
    q.put(None)


def tail_lines(path: Path, ended: Callable[[], bool], q: queue.Queue[str | None], poll_s: float = 0.02) -> None:
    """Put every line written to the file ``path`` on ``q`` as it grows, then ``None`` once ``ended()`` is true and
    the file is read to its end (run it in a thread; a forked rank writes its output to such a file)."""
    pending = ""
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            done = ended()  # asked before reading: what was written before the end is read below
            chunk = f.read()
            if chunk:
                *complete, pending = (pending + chunk).split("\n")
                for line in complete:
                    q.put(line)
            elif done:
                if pending:
                    q.put(pending)
                q.put(None)
                return
            else:
                time.sleep(poll_s)


def emit(line: str, lines: list[str], output: str) -> None:
    """Keep ``line`` (for the error message) and print it if ``output`` says so: "all", "rank0" or "none"."""
    lines.append(line)
    if output == "all" or (output == "rank0" and line.startswith("[rank 0] ")):
        print(line, flush=True)


def drain(q: queue.Queue[str | None], lines: list[str], output: str) -> int:
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
            emit(item, lines, output)


def finish_reading(q: queue.Queue[str | None], lines: list[str], output: str, open_streams: int) -> None:
    """Print the last lines of a finished job (its pipes close once every process has exited)."""
    deadline = time.perf_counter() + 2.0
    while open_streams > 0 and time.perf_counter() < deadline:
        try:
            item = q.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            break
        if item is None:
            open_streams -= 1
        else:
            emit(item, lines, output)

