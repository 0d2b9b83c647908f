"""The one helper every multi-process test uses to run gloo workers.

It is ``lslm.launch`` itself (free port, timeout, the failing rank's traceback in
the raised error), with quiet output and the repository root importable so that
test-only workers in ``tests/workers.py`` can be targets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lslm.runtime.launch import LaunchResults, launch

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_workers(target: str, nproc: int, *, timeout: float = 120.0, nnodes: int = 1, **kwargs: Any) -> LaunchResults:
    """Run ``target`` on ``nproc`` gloo processes and return each rank's result (raises LaunchError on failure)."""
    return launch(target, nproc=nproc, nnodes=nnodes, timeout=timeout, output="none",
                  env={"LSLM_BACKEND": "gloo", "LSLM_DEVICE": "cpu"}, pythonpath=[str(REPO_ROOT)], **kwargs)
