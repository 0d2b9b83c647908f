"""Exercises with automatic checks, one mechanism for every notebook (see ``core``).

``check_<name>(fn)`` checks the learner's function; ``hint(name)`` and ``solution(name)``
reveal help on request. Any public name of an exercise module (``check_*``,
``reference_*``) is also reachable from here, e.g. ``from lslm.exercises import check_grad_sync``.
"""

from __future__ import annotations

import importlib
from typing import Any

from lslm.exercises.core import Verdict, capture, materialise, run_check, run_local
from lslm.exercises.model_state_bytes import check_predict_model_state_bytes, reference_predict_model_state_bytes
from lslm.exercises.registry import exercises, hint, solution
from lslm.exercises.ring_all_gather import check_ring_all_gather, reference_ring_all_gather
from lslm.exercises.sharding import check_shard_range, reference_shard_range

__all__ = ["Verdict", "capture", "check_predict_model_state_bytes", "check_ring_all_gather", "check_shard_range",
           "exercises", "hint", "materialise", "reference_predict_model_state_bytes", "reference_ring_all_gather",
           "reference_shard_range", "run_check", "run_local", "solution"]


def __getattr__(name: str) -> Any:
    """Find ``name`` in the exercise modules (those written after this file, e.g. notebook 04's)."""
    from lslm.exercises.registry import exercise_modules

    if not name.startswith("_"):
        for module in exercise_modules():
            value = getattr(importlib.import_module(module), name, None)
            if value is not None:
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
