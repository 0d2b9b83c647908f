"""The exercise mechanism every notebook uses.

A learner writes a function (or a few functions and a class) in a notebook cell.
Launched processes cannot import a cell (spawn pickles functions by module and
name, and a cell has no module), so :func:`run_check` writes the objects' source,
under a small import header, to a temporary module (:func:`capture`), launches a
package worker that imports it, and lets that worker compare the learner's
function with our reference on several inputs and world sizes. The verdict comes
back as data and is printed with a hint aimed at the mistake.

Committed notebooks hold a stub (``raise NotImplementedError``): a check on a stub
launches nothing and reports "NOT ATTEMPTED YET" (:func:`not_attempted`), so the
notebook still runs green. Exercises that need no processes use :func:`run_local`.

Inside a worker: :func:`call_learner` wraps each call of the learner's code (it
leaves entered/left markers, so a deadlock is reported as one, naming the ranks
that never returned), and :func:`collect_and_judge` gathers every rank's findings
and judges them on rank 0.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lslm.exercises.launched import (
    DEADLOCK_ENV,
    MARKERS_ENV,
    STUCK_EXIT_CODE,
    call_learner,
    check_each,
    collect_and_judge,
    load_learner_function,
)
from lslm.exercises.source import is_stub, source_of, stub_names

__all__ = ["DEADLOCK_ENV", "HEADER", "MARKERS_ENV", "STUCK_EXIT_CODE", "Verdict", "call_learner", "capture",
           "check_each", "collect_and_judge", "is_stub", "load_learner_function", "materialise", "not_attempted",
           "report", "run_check", "run_checks", "run_local"]

HEADER = """\
# Written by lslm.exercises from a notebook cell; imported by launched workers.
from __future__ import annotations  # annotations naming what this header does not import stay harmless

import math
import os

import torch
import torch.distributed as dist
"""


@dataclass
class Verdict:
    """The outcome of one exercise check.

    ``passed``: accepted; ``message``: one line (which rank, which input, expected vs got);
    ``hint``: aimed at the mistake; ``details``: data for tests (e.g. ``kind``, ``rank``);
    ``attempted``: False when the learner's code is still the stub (then ``passed`` is False).
    """

    passed: bool
    message: str
    hint: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    attempted: bool = True

    @property
    def state(self) -> str:
        """``"passed"``, ``"failed"`` or ``"not attempted"``."""
        return "passed" if self.passed else ("failed" if self.attempted else "not attempted")

    def __str__(self) -> str:
        if self.passed:
            return f"PASSED: {self.message}"
        if not self.attempted:
            return f"NOT ATTEMPTED YET: {self.message}"
        return f"NOT YET: {self.message}" + (f"\n  hint: {self.hint}" if self.hint else "")

    def __bool__(self) -> bool:
        return self.passed


def _as_objects(fn: Callable[..., Any] | Sequence[Any], helpers: Iterable[Any]) -> list[Any]:
    """The main object first, then the helpers, as one list; ValueError on anything uncapturable."""
    objs = list(fn) if isinstance(fn, (tuple, list)) else [fn]
    objs += list(helpers)
    if not objs:
        raise ValueError("nothing to check: pass the function you wrote")
    for obj in objs:
        if not callable(obj) or not hasattr(obj, "__name__"):
            raise ValueError(f"expected a function or class you defined with `def`/`class`, got {obj!r}")
        if obj.__name__ == "<lambda>":
            raise ValueError("write the solution as a named function with `def`, not a lambda")
    names = [o.__name__ for o in objs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"two captured objects are both named {dupes[0]!r}: pass each once")
    return objs


def capture(objs: Sequence[Any], directory: Path | str | None = None) -> tuple[Path, str]:
    """Write the source of ``objs`` (functions and classes) under :data:`HEADER` to one module.

    Helpers are written before the main object (``objs[0]``), in the order given, so a
    class deriving from another captured class finds it. Returns ``(directory, module)``;
    without ``directory`` a new temporary folder is made and the caller removes it.
    Raises ``ValueError`` if a source cannot be read (e.g. typed at a bare prompt).
    """
    objs = _as_objects(list(objs), ())
    ordered = objs[1:] + objs[:1]
    text = HEADER + "".join("\n\n" + textwrap.dedent(source_of(o)).rstrip() + "\n" for o in ordered)
    module = "lslm_exercise_" + hashlib.sha1(text.encode()).hexdigest()[:12]
    directory = Path(directory or tempfile.mkdtemp(prefix="lslm-exercise-"))
    (directory / f"{module}.py").write_text(text)
    return directory, module


def materialise(fn: Callable[..., Any], directory: Path | None = None) -> tuple[Path, str]:
    """One object's :func:`capture` (kept for callers of the first version)."""
    return capture([fn], directory)


def not_attempted(objs: Sequence[Any], exercise: str) -> Verdict | None:
    """A "not attempted" verdict if any of ``objs`` is still a stub, else None (nothing is run).

    A stub is a function (or a class method) whose body is only a docstring and/or
    ``raise NotImplementedError``: what committed notebooks hold.
    """
    stubs = stub_names(objs)
    return _not_attempted_verdict(stubs, exercise) if stubs else None


def _not_attempted_verdict(stubs: list[str], exercise: str) -> Verdict:
    listed = ", ".join(f"`{s}`" for s in stubs)
    return Verdict(False, f"{listed} still raise{'s' if len(stubs) == 1 else ''} NotImplementedError. "
                          f"Write {'it' if len(stubs) == 1 else 'them'} and run this cell again; "
                          f'`hint("{exercise}")` for a hint, `solution("{exercise}")` for ours.',
                   details={"kind": "not_attempted", "stubs": stubs}, attempted=False)


def run_local(fn: Callable[..., Any] | Sequence[Any], judge: Callable[[Callable[..., Any]], dict[str, Any]], *,
              exercise: str | None = None, helpers: Iterable[Any] = ()) -> Verdict:
    """Check in this process (no launch): ``judge(main_object)`` returns a verdict dict.

    The verdict dict has ``passed``, ``message`` and optionally ``hint`` and ``details``.
    A stub gives "not attempted"; an exception of the learner's code becomes a failed verdict.
    """
    objs = _as_objects(fn, helpers)
    exercise = exercise or objs[0].__name__
    skipped = not_attempted(objs, exercise)
    if skipped is not None:
        return skipped
    try:
        result = judge(objs[0])
    except NotImplementedError:  # a stub whose source could not be read: the same answer as a detected one
        return _not_attempted_verdict([objs[0].__name__], exercise)
    except Exception as exc:  # noqa: BLE001 - the learner's error becomes the verdict
        return Verdict(False, f"your function raised {type(exc).__name__}: {exc}",
                       hint="run it by hand in a cell with small inputs first", details={"kind": "error"})
    return Verdict(bool(result["passed"]), result["message"], result.get("hint", ""), result.get("details", {}))


def run_check(fn: Callable[..., Any] | Sequence[Any], checker: str, world_sizes: Iterable[int],
              timeout: float = 120.0, *, exercise: str | None = None, helpers: Iterable[Any] = (),
              deadlock_s: float | None = None, **checker_args: Any) -> Verdict:
    """Launch ``checker`` (a package worker) at each world size on the learner's code.

    ``fn`` is the learner's main function, or a tuple ``(main, helper, SomeClass, ...)``;
    ``helpers`` adds more cell-defined objects. All are captured into one module. The
    checker is called as ``checker(module=..., name=<main's name>, **checker_args)`` on
    every rank and returns a verdict dict (``passed``, ``message``, ``hint``, ``details``)
    from rank 0 (see :func:`check_each`, :func:`collect_and_judge`). Stops at the first
    failing world size.

    A stub launches nothing ("not attempted", :func:`not_attempted`). A crash of the
    learner's code is a failed verdict naming the rank. With ``deadlock_s``, a call of the
    learner's code (:func:`call_learner`) still running after that many seconds stops
    its rank; that, or a launch running past ``timeout``, is reported as a deadlock naming
    the ranks that never returned from the learner's function (from the call markers).
    ``deadlock_s`` counts from the call, not from the launch, so slow start-up never
    passes for a deadlock.
    """
    objs = _as_objects(fn, helpers)
    name = objs[0].__name__
    skipped = not_attempted(objs, exercise or name)
    if skipped is not None:
        return skipped
    checked = []
    # The learner's module lives in a temporary folder that goes away on every exit path
    # (a verdict, a crash, an interrupt): repeated checks leave nothing behind.
    with tempfile.TemporaryDirectory(prefix="lslm-exercise-") as tmp:
        directory, module = capture(objs, Path(tmp))
        for world in world_sizes:
            outcome = _launch(checker, world, Path(tmp), module, name, name, timeout, deadlock_s, checker_args)
            if isinstance(outcome, Verdict):
                return outcome
            if not outcome["passed"]:
                return Verdict(False, f"with {world} processes: {outcome['message']}", outcome.get("hint", ""),
                               {"world_size": world, **outcome.get("details", {})})
            checked.append(world)
    return Verdict(True, f"matches the reference on {', '.join(map(str, checked))} processes")


def run_checks(fns: Sequence[Callable[..., Any]], checker: str, world_size: int, timeout: float = 120.0, *,
               helpers: Iterable[Any] = (), deadlock_s: float | None = None, **checker_args: Any) -> list[Verdict]:
    """Judge several candidate functions in ONE launch of ``world_size`` processes (for tests).

    Every candidate (and every helper) is captured into one module, so their names must
    differ; the checker receives ``name`` as a list (see :func:`check_each`). Verdicts come
    back in the order of ``fns``; a stub candidate is "not attempted" and is not run. A crash
    or deadlock of one candidate ends the launch, so keep those in a launch of their own.
    """
    fns = list(fns)
    objs = _as_objects(fns, helpers)
    skipped = {f.__name__: not_attempted([f], f.__name__) for f in fns}
    names = [f.__name__ for f in fns if skipped[f.__name__] is None]
    outcomes: dict[str, Verdict] = {}
    if names:
        with tempfile.TemporaryDirectory(prefix="lslm-exercise-") as tmp:
            directory, module = capture(objs, Path(tmp))
            outcome = _launch(checker, world_size, Path(tmp), module, names, names[0], timeout, deadlock_s,
                              checker_args)
        if isinstance(outcome, Verdict):
            raise RuntimeError(f"the batch launch failed, judge that candidate on its own: {outcome}")
        for n, o in zip(names, outcome):
            outcomes[n] = Verdict(bool(o["passed"]), o["message"], o.get("hint", ""),
                                  {"world_size": world_size, **o.get("details", {})})
    return [outcomes[f.__name__] if skipped[f.__name__] is None else skipped[f.__name__] for f in fns]  # type: ignore[misc]


def _launch(checker: str, world: int, folder: Path, module: str, names: str | list[str], shown: str,
            timeout: float, deadlock_s: float | None, checker_args: dict[str, Any]) -> Any:
    """One launch of ``checker``; rank 0's result, or a Verdict if the launch itself failed."""
    from lslm.launcher.launch import LaunchError, LaunchTimeout, launch

    markers = folder / f"markers-{world}"
    markers.mkdir(exist_ok=True)
    env = {"LSLM_BACKEND": "gloo", "LSLM_DEVICE": "cpu", MARKERS_ENV: str(markers)}
    if deadlock_s is not None:
        env[DEADLOCK_ENV] = str(float(deadlock_s))
    try:
        results = launch(checker, nproc=world, timeout=timeout, output="none", pythonpath=[str(folder)],
                         env=env, module=module, name=names, **checker_args)
    except LaunchError as exc:
        stuck = _deadlock_verdict(markers, world, shown)
        if stuck is not None:
            return stuck
        if isinstance(exc, LaunchTimeout):
            return Verdict(False, f"with {world} processes the check did not finish within {timeout:g} s, "
                                  f"while no rank was inside your {shown}",
                           hint="run it by hand in a cell with small inputs first",
                           details={"kind": "timeout", "world_size": world})
        last = (exc.traceback or exc.output).strip().splitlines()
        return Verdict(False, f"your function raised on rank {exc.rank} with {world} processes: "
                              f"{last[-1] if last else 'no output'}",
                       hint="run it by hand in a cell with small inputs first",
                       details={"kind": "error", "world_size": world, "rank": exc.rank})
    return results[0]


def _read_markers(folder: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for path in folder.glob("rank*.json"):
        try:
            found[int(path.stem[4:])] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue  # a marker being rewritten as the job was killed: treat the rank as unknown
    return found


def _deadlock_verdict(markers: Path, world: int, name: str) -> Verdict | None:
    """A deadlock verdict if some rank entered the learner's function and never left it, else None."""
    state = _read_markers(markers)
    stuck = sorted(r for r, m in state.items() if m.get("inside"))
    if not stuck:
        return None
    label = state[stuck[0]].get("label", "")
    waited = max((m.get("stuck_after_s", 0.0) for m in state.values()), default=0.0)
    raised = {r: m["error"] for r, m in state.items() if m.get("error") and r not in stuck}
    done = sorted(r for r in range(world) if r not in stuck and r not in raised)
    s = "s" if len(stuck) > 1 else ""
    message = (f"DEADLOCK with {world} processes: rank{s} {', '.join(map(str, stuck))} never returned from your "
               f"{name}" + (f" ({label})" if label else "") + (f" within {waited:g} s" if waited else ""))
    if raised:
        first = min(raised)
        message += f"; rank {first} had raised {raised[first]} in it, so its peers waited for it in vain"
    elif done:
        message += f"; rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} did"
    return Verdict(False, message,
                   hint="every blocking send must meet a receive that is already posted on its peer: if every "
                        "rank sends first, all of them wait forever; post the send and the receive of a step "
                        "together (dist.batch_isend_irecv) or order them by rank parity",
                   details={"kind": "deadlock", "world_size": world, "stuck": stuck})


def report(verdict: Verdict) -> Verdict:
    """Print the verdict (one line, plus a hint when it failed) and return it."""
    print(verdict)
    return verdict
