"""What runs inside the launched processes of an exercise check.

:func:`check_each` is the body of every exercise worker; :func:`call_learner` wraps
each call of the learner's code with entered/left markers (and an optional watchdog),
so a check that hangs is reported as a deadlock naming the ranks that never returned;
:func:`collect_and_judge` gathers every rank's findings and judges them on rank 0.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKERS_ENV = "LSLM_EXERCISE_MARKERS"  # folder where call_learner leaves one marker file per rank
DEADLOCK_ENV = "LSLM_EXERCISE_DEADLOCK_S"  # seconds one call of the learner's code may take before it counts as stuck
STUCK_EXIT_CODE = 86  # exit code of a rank that call_learner's watchdog stopped


def load_learner_function(module: str, name: str) -> Callable[..., Any]:
    """Import the learner's function (or class) inside a worker (the module's folder is on PYTHONPATH)."""
    return getattr(importlib.import_module(module), name)


def call_learner(fn: Callable[..., Any], *args: Any, label: str = "", **kwargs: Any) -> Any:
    """Call the learner's ``fn`` inside a worker, leaving an entered/left marker for this rank.

    ``label`` says what the call was given (e.g. ``"M=5, torch.float32"``); it appears in
    a deadlock report. Exceptions propagate (the worker turns them into findings); the
    marker keeps the exception, so a deadlock it caused on the peers is explained. If
    :data:`DEADLOCK_ENV` is set and the call is still running after that many seconds,
    a watchdog thread marks the rank stuck and ends the process (exit code
    :data:`STUCK_EXIT_CODE`): the launcher then stops the job and :func:`run_check` reports
    the deadlock. Without :data:`MARKERS_ENV` in the environment it is a plain call.
    """
    folder = os.environ.get(MARKERS_ENV)
    if not folder:
        return fn(*args, **kwargs)
    path = Path(folder) / f"rank{int(os.environ.get('RANK', '0'))}.json"

    def mark(**state: Any) -> None:
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"label": label, **state}))
        tmp.replace(path)  # atomic: the launcher never reads half a marker

    limit = os.environ.get(DEADLOCK_ENV)
    returned = threading.Event()

    def watchdog() -> None:
        if not returned.wait(float(limit)):  # type: ignore[arg-type]
            mark(inside=True, stuck_after_s=float(limit))  # type: ignore[arg-type]
            print(f"lslm.exercises: rank {os.environ.get('RANK', '0')} still inside the learner's function after "
                  f"{limit} s: stopping it", file=sys.stderr, flush=True)
            os._exit(STUCK_EXIT_CODE)  # the learner's thread is blocked in C: nothing else would stop it

    mark(inside=True)
    if limit:
        threading.Thread(target=watchdog, daemon=True, name="lslm-exercise-watchdog").start()
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        returned.set()
        mark(inside=False, error=f"{type(exc).__name__}: {exc}"[:300])
        raise
    returned.set()
    mark(inside=False)
    return result


def check_each(module: str, name: str | list[str], check_one: Callable[[Callable[..., Any], Any], Any],
               **init_kwargs: Any) -> Any:
    """The body of every exercise worker: join the process group, judge each named learner function.

    ``check_one(fn, ctx)`` runs one learner function on this rank (through :func:`call_learner`)
    and ends with :func:`collect_and_judge`. ``name`` is one name (a check: returns that
    verdict) or a list (:func:`run_checks`: returns the list). ``init_kwargs`` go to
    :func:`lslm.runtime.init_distributed` (e.g. ``timeout_s``).
    """
    from lslm.runtime import init_distributed

    names = [name] if isinstance(name, str) else list(name)
    fns = [load_learner_function(module, n) for n in names]
    with init_distributed(**init_kwargs) as ctx:
        verdicts = [check_one(fn, ctx) for fn in fns]
    return verdicts[0] if isinstance(name, str) else verdicts


def collect_and_judge(local: Any, judge: Callable[[list[Any]], dict[str, Any]]) -> dict[str, Any] | None:
    """Gather every rank's JSON-able findings ``local`` and return ``judge(everyone)`` on rank 0.

    ``everyone[r]`` is rank ``r``'s ``local``. Other ranks return None. Every worker ends
    with this (after its calls of the learner's code), so the default process group must
    be up and no collective may be disabled.
    """
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return judge(everyone) if dist.get_rank() == 0 else None
