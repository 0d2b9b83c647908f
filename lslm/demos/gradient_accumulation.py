"""Launch target of notebook 04b: the global-batch identity ``gbs = mbs x k x dp`` checked across processes.

``lslm.launch("lslm.demos.gradient_accumulation:gbs_worker", nproc=2, gbs=8)`` runs
:func:`lslm.data_parallel.accumulation.gbs_check` (torch DDP with ``no_sync`` for every ``(mbs, k, dp)``) on
every rank and returns its rows.
"""

from __future__ import annotations

from typing import Any

from lslm.data_parallel.accumulation import gbs_check
from lslm.runtime.startup import init_distributed

__all__ = ["gbs_worker"]


def gbs_worker(gbs: int = 8, **setup: Any) -> list[dict[str, Any]]:
    """One rank of a launched job (``lslm.launch(..., nproc=2)``): join the group, run ``gbs_check``, leave."""
    with init_distributed(device="cpu"):
        return gbs_check(gbs, **setup)
