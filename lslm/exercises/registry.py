"""The exercises of the course by name: their reference solution, hints and checker.

Each exercise module calls :func:`register` at import time; :func:`exercises`
imports every module of ``lslm.exercises`` once, so a new exercise module needs
no edit here. A learner reaches the answers only on request::

    hint("shard_range")      # prints the hints, first the gentle one
    solution("shard_range")  # prints our reference source
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lslm.exercises.core import Verdict

# Modules of lslm.exercises that hold no exercise (the mechanism and its helpers).
_INFRASTRUCTURE = {"core", "launched", "recorded", "registry", "source"}


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``name`` (the function the learner writes), where it lives, how it is judged.

    ``reference``: our solution (its source is what :func:`solution` prints, followed by
    that of ``reference_helpers``); ``hints``: from gentle to explicit; ``check``: the
    ``check_<name>`` function a notebook calls; ``notebook``: e.g. ``"01_multiprocessing"``.
    """

    name: str
    notebook: str
    reference: Callable[..., Any]
    hints: tuple[str, ...]
    check: Callable[..., Verdict]
    reference_helpers: tuple[Any, ...] = ()


_REGISTRY: dict[str, Exercise] = {}
_discovered = False


def register(exercise: Exercise) -> Exercise:
    """Add ``exercise`` to the registry (at import of its module) and return it."""
    if not exercise.hints:
        raise ValueError(f"exercise {exercise.name!r} needs at least one hint")
    old = _REGISTRY.get(exercise.name)
    if old is not None and old.check.__module__ != exercise.check.__module__:
        raise ValueError(f"exercise {exercise.name!r} is registered twice ({old.check.__module__}, "
                         f"{exercise.check.__module__})")
    _REGISTRY[exercise.name] = exercise
    return exercise


def exercise_modules() -> list[str]:
    """Full names of the modules of ``lslm.exercises`` that may hold exercises."""
    import lslm.exercises as package

    return [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)
            if not m.name.startswith("_") and m.name not in _INFRASTRUCTURE]


def exercises() -> dict[str, Exercise]:
    """Every registered exercise by name (importing the exercise modules the first time)."""
    global _discovered
    if not _discovered:
        for module in exercise_modules():
            importlib.import_module(module)
        _discovered = True
    return dict(_REGISTRY)


def get(name: str) -> Exercise:
    """The exercise called ``name``; ``ValueError`` listing the known names otherwise."""
    known = exercises()
    if name not in known:
        raise ValueError(f"no exercise called {name!r}; known exercises: {', '.join(sorted(known))}")
    return known[name]


def solution(name: str) -> None:
    """Print our reference solution of exercise ``name`` (its source, helpers included)."""
    ex = get(name)
    parts = [ex.reference, *ex.reference_helpers]
    print("\n\n".join(textwrap.dedent(inspect.getsource(p)).rstrip() for p in parts))


def hint(name: str) -> None:
    """Print the hints of exercise ``name``, numbered, from gentle to explicit."""
    ex = get(name)
    print("\n".join(f"hint {i}: {h}" for i, h in enumerate(ex.hints, 1)))
