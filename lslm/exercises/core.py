"""The exercise mechanism every notebook uses.

A learner writes a function in a notebook cell. Launched processes cannot import
a cell (spawn pickles functions by module and name, and a cell has no module), so
:func:`run_check` writes the function's source, under a small import header, to a
temporary module, launches a package worker that imports it, and lets that worker
compare the learner's function with our reference on several inputs and world
sizes. The verdict comes back as data and is printed with a hint on failure.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import tempfile
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = """\
# Written by lslm.exercises from a notebook cell; imported by launched workers.
import math
import os

import torch
import torch.distributed as dist
"""


@dataclass
class Verdict:
    """The outcome of one exercise check: ``passed``, a one-line ``message`` and a ``hint``."""

    passed: bool
    message: str
    hint: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.passed:
            return f"PASSED: {self.message}"
        return f"NOT YET: {self.message}" + (f"\n  hint: {self.hint}" if self.hint else "")

    def __bool__(self) -> bool:
        return self.passed


def materialise(fn: Callable[..., Any], directory: Path | None = None) -> tuple[Path, str]:
    """Write ``fn``'s source (with :data:`HEADER`) to ``directory/<module>.py``; return (directory, module).

    Without ``directory``, a new temporary folder is made: the caller removes it.

    Raises ``ValueError`` if the source cannot be read (e.g. a lambda typed at a prompt).
    """
    if not callable(fn) or not hasattr(fn, "__name__"):
        raise ValueError(f"expected the function you wrote, got {fn!r}")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise ValueError(f"cannot read the source of {fn.__name__}: define it with `def` in a cell") from exc
    if fn.__name__ == "<lambda>":
        raise ValueError("write the solution as a named function with `def`, not a lambda")
    text = HEADER + "\n\n" + source
    module = "lslm_exercise_" + hashlib.sha1(text.encode()).hexdigest()[:12]
    directory = Path(directory or tempfile.mkdtemp(prefix="lslm-exercise-"))
    (directory / f"{module}.py").write_text(text)
    return directory, module


def load_learner_function(module: str, name: str) -> Callable[..., Any]:
    """Import the learner's function inside a worker (the module's folder is on PYTHONPATH)."""
    return getattr(importlib.import_module(module), name)


def run_check(fn: Callable[..., Any], checker: str, world_sizes: Iterable[int], timeout: float = 120.0,
              **checker_args: Any) -> Verdict:
    """Launch ``checker`` (a package worker) at each world size on the learner's ``fn``.

    The checker is called as ``checker(module=..., name=..., **checker_args)`` on every
    rank and returns a verdict dict (``passed``, ``message``, ``hint``) from rank 0.
    Stops at the first failing world size. A crash of the learner's code is reported
    as a failed verdict with the rank's exception, not as an error of the notebook.
    """
    from lslm.runtime.launch import LaunchError, launch

    # The learner's module lives in a temporary folder that goes away on every exit path
    # (a verdict, a crash, an interrupt): repeated checks leave nothing behind.
    with tempfile.TemporaryDirectory(prefix="lslm-exercise-") as tmp:
        directory, module = materialise(fn, Path(tmp))
        checked = []
        for world in world_sizes:
            try:
                results = launch(checker, nproc=world, timeout=timeout, output="none", pythonpath=[str(directory)],
                                 env={"LSLM_BACKEND": "gloo", "LSLM_DEVICE": "cpu"}, module=module,
                                 name=fn.__name__, **checker_args)
            except LaunchError as exc:
                last = (exc.traceback or exc.output).strip().splitlines()
                return Verdict(False, f"your function raised on rank {exc.rank} with {world} processes: "
                                      f"{last[-1] if last else 'no output'}",
                               hint="run it by hand in a cell with small inputs first", details={"world_size": world})
            verdict = results[0]
            if not verdict["passed"]:
                return Verdict(False, f"with {world} processes: {verdict['message']}", verdict.get("hint", ""),
                               {"world_size": world, **verdict.get("details", {})})
            checked.append(world)
    return Verdict(True, f"matches the reference on {', '.join(map(str, checked))} processes")


def report(verdict: Verdict) -> Verdict:
    """Print the verdict (one line, plus a hint when it failed) and return it."""
    print(verdict)
    return verdict
