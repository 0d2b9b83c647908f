"""The process torchrun starts for every rank of an ``lslm.launch`` job.

``python -m lslm.runtime.worker --target pkg.module:function --args-file A --result-dir D``
imports the target, calls it with the JSON arguments, and writes what it returns
to ``D/rank<r>.json``. If it raises, the traceback goes to ``D/rank<r>.error.txt``
first, so the launcher can kill the job and show the right traceback at once.
Every line the rank prints is prefixed ``[rank r]``.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

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


def _die_with_parent() -> None:
    # If the torchrun agent is killed hard, its workers (in their own sessions) would
    # be orphaned; exit as soon as our parent changes.
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="lslm-parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank: run the target, write its result or its traceback."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--args-file", required=True)
    parser.add_argument("--result-dir", required=True)
    ns = parser.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    sys.stdout = _PrefixedStream(sys.__stdout__, f"[rank {rank}] ")  # type: ignore[assignment]
    sys.stderr = _PrefixedStream(sys.__stderr__, f"[rank {rank}] ")  # type: ignore[assignment]
    _die_with_parent()
    result_dir = Path(ns.result_dir)
    os.environ[RESULT_DIR_ENV] = str(result_dir)
    try:
        kwargs = json.loads(Path(ns.args_file).read_text())
        fn = resolve_target(ns.target)
        result = fn(**kwargs)
        write_json_atomic(result_dir / f"rank{rank}.json", result)
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            write_json_atomic(result_dir / f"rank{rank}.json", None)
            return 0
        tb = traceback.format_exc()
        err = result_dir / f"rank{rank}.error.txt"
        tmp = err.with_name(err.name + ".tmp")
        tmp.write_text(tb)
        os.replace(tmp, err)
        sys.stderr.write(tb)
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
