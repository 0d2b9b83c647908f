"""Workers for tests/test_three_d.py: every 3D check at 8 processes in one launch (processes start once).

:func:`suite` runs, in the same process group: lslm's 3D cases and torch's own composition
(:func:`lslm.demos.three_d_demo.run_suite`, the code notebook 09 launches), then the 3D recipe's
runs (:mod:`lslm.recipes.three_d`, through the harness's :func:`~lslm.harness.run_in_context`, as
its ``compare`` target runs them in a launch of its own).
"""

from __future__ import annotations

from typing import Any

from lslm.demos.three_d_demo import run_suite
from lslm.harness import run_in_context
from lslm.recipes.three_d import RECIPE
from lslm.runtime import init_distributed, seed_everything

__all__ = ["suite"]


def suite(cases: list[dict[str, Any]], torch_native: list[dict[str, Any]], recipe_runs: list[dict[str, Any]],
          recipe_common: dict[str, Any], **_: Any) -> dict[str, Any]:
    """This rank's results: ``cases`` and ``torch`` (:func:`run_suite`), ``recipe`` (one record per run)."""
    ctx = init_distributed()
    out = run_suite(ctx, cases, torch_native=torch_native)
    seed_everything(recipe_common.get("seed", 0))  # as the recipe's own launch starts: init_distributed(seed=...)
    out["recipe"] = run_in_context(RECIPE, ctx, recipe_runs, **recipe_common)
    return out
