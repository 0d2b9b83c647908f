"""The process torchrun starts for every rank of an ``lslm.launch`` job.

``python -m lslm.launcher.worker --target pkg.module:function --args-file A --result-dir D``
imports the target, calls it with the JSON arguments (none without ``--args-file``), and
writes what it returns to ``D/rank<r>.json`` (``D`` is created if missing). What the
launcher reads from ``D`` to tell what happened:

* ``rank<r>.started.json``: pid and start time, written first, so the launcher can
  notice a rank that dies without a word (SIGKILL, the out-of-memory killer, a crash).
* ``rank<r>.error.json``: if the function raises, the traceback, the message of every
  exception in the chain, and the time it failed, so the launcher can tell the
  rank that failed *first* from the ones that only lost their connection to it.
* ``rank<r>.fault.txt``: Python's :mod:`faulthandler` dump if the process crashes
  on a fatal signal (SIGSEGV, SIGABRT, ...).

Every line the rank prints is prefixed ``[rank r]``. The worker dies with its
torchrun agent (a parent-death signal), so it never outlives the job.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from lslm.launcher.agent import AGENT_PID_ENV
from lslm.launcher.process_tree import die_with_parent
from lslm.runtime.startup import exit_process

RESULT_DIR_ENV = "LSLM_RESULT_DIR"


class _PrefixedStream(io.TextIOBase):
    """A text stream that starts every line with a fixed prefix (for rank-tagged output)."""

    lslm_prefixed = True  # rank_print looks for this to avoid a double prefix

    def __init__(self, inner: TextIO, prefix: str) -> None:
        self._inner = inner
        self._prefix = prefix
        self._at_line_start = True
        self._lock = threading.Lock()

    def write(self, s: str) -> int:  # type: ignore[override]
        with self._lock:
            out = []
            for piece in s.splitlines(keepends=True):
                if self._at_line_start:
                    out.append(self._prefix)
                out.append(piece)
                self._at_line_start = piece.endswith("\n")
            self._inner.write("".join(out))
            self._inner.flush()
        return len(s)

    def flush(self) -> None:
        self._inner.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._inner, "encoding", "utf-8")

    def fileno(self) -> int:
        return self._inner.fileno()


def resolve_target(target: str) -> Callable[..., Any]:
    """Import ``"pkg.module:function"`` (or ``"pkg.module"``, meaning its ``worker``)."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    fn = getattr(module, attr or "worker", None)
    if not callable(fn):
        raise ValueError(f"{target!r}: module {module_name!r} has no callable {attr or 'worker'!r}")
    return fn


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` via a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _exception_chain(exc: BaseException) -> list[str]:
    """``"Type: message"`` of ``exc`` and every exception it was raised from or during (causes first)."""
    chain: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(f"{type(cur).__name__}: {cur}".rstrip(": "))
        cur = cur.__cause__ or cur.__context__
    return chain[::-1]


def error_record(rank: int, exc: BaseException, failed_at: float) -> dict[str, Any]:
    """What ``rank<r>.error.json`` holds: when, which exception, its chain and the formatted traceback."""
    return {
        "rank": rank,
        "pid": os.getpid(),
        "time": failed_at,
        "type": type(exc).__name__,
        "message": str(exc),
        "chain": _exception_chain(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank: run the target, write its result or its traceback."""
    parser = argparse.ArgumentParser(prog="python -m lslm.launcher.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the function every rank calls, 'package.module:function'")
    parser.add_argument("--args-file", default=None,
                        help="JSON file with the function's keyword arguments (default: none)")
    parser.add_argument("--result-dir", required=True,
                        help="folder for rank<r>.json and the status files, created if missing")
    ns = parser.parse_args(argv)
    # Checked here, before anything is written: a typo'd file ends with one line, not a traceback per rank.
    args_file = Path(ns.args_file) if ns.args_file is not None else None
    if args_file is not None and not args_file.is_file():
        parser.error(f"--args-file {ns.args_file}: no such file (write the keyword arguments as JSON, e.g. {{}})")

    # Die with the agent: SIGKILL, as there is nobody left to report to. The agent's pid
    # comes from its environment, so a worker that starts after the agent died still knows;
    # popped, so that processes this rank starts do not inherit it.
    die_with_parent(int(os.environ.pop(AGENT_PID_ENV, os.getppid())), signal.SIGKILL)
    rank = int(os.environ.get("RANK", "0"))
    result_dir = Path(ns.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)  # e.g. `--result-dir results/` on a fresh node
    os.environ[RESULT_DIR_ENV] = str(result_dir)
    write_json_atomic(result_dir / f"rank{rank}.started.json", {"rank": rank, "pid": os.getpid(), "time": time.time()})
    # Kept open for the life of the process: faulthandler writes to it from a signal handler.
    fault_file = open(result_dir / f"rank{rank}.fault.txt", "w")  # noqa: SIM115
    faulthandler.enable(file=fault_file, all_threads=True)
    sys.stdout = _PrefixedStream(sys.__stdout__, f"[rank {rank}] ")  # type: ignore[assignment]
    sys.stderr = _PrefixedStream(sys.__stderr__, f"[rank {rank}] ")  # type: ignore[assignment]
    try:
        kwargs = json.loads(args_file.read_text()) if args_file is not None else {}
        fn = resolve_target(ns.target)
        result = fn(**kwargs)
        write_json_atomic(result_dir / f"rank{rank}.json", result)
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        failed_at = time.time()
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            write_json_atomic(result_dir / f"rank{rank}.json", None)
            return 0
        record = error_record(rank, exc, failed_at)
        write_json_atomic(result_dir / f"rank{rank}.error.json", record)
        sys.stderr.write(record["traceback"])
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())  # results are written: end now (finalization skipped where gloo ran: see exit_process)
