"""Workers for tests/test_trace.py: one launch traces DDP, ZeRO-3, TP and 1F1B in the same two processes."""

from __future__ import annotations

from typing import Any

from lslm.harness import run_in_context
from lslm.recipes.ddp import RECIPE as DDP
from lslm.recipes.pipeline import RECIPE as PIPELINE
from lslm.recipes.tp import RECIPE as TP
from lslm.recipes.zero import RECIPE as ZERO
from lslm.runtime import init_distributed, seed_everything

__all__ = ["RUNS", "traced_techniques"]

#: name -> (recipe, its settings); every run: 2 steps of the recipes' default tiny GPT, both traced.
RUNS: dict[str, tuple[Any, dict[str, Any]]] = {
    "ddp": (DDP, {"variant": "bucketed", "bucket_cap_mb": 0.5}),
    "zero3": (ZERO, {"stage": 3}),
    "tp": (TP, {"tp": 2}),
    "1f1b": (PIPELINE, {"pp": 2, "schedule": "1f1b", "microbatches": 2}),
}


def traced_techniques(trace: str, steps: int = 2, **_: Any) -> dict[str, Any]:
    """This rank's run record of each technique in :data:`RUNS`, traced into ``<trace>/<name>/``."""
    ctx = init_distributed()
    out = {}
    for name, (recipe, settings) in RUNS.items():
        seed_everything(0)
        out[name] = run_in_context(recipe, ctx, [settings], trace=f"{trace}/{name}", steps=steps, log_every=100)[0]
    return out
