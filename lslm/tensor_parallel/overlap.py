"""How much of the column-parallel input-gradient communication the weight-gradient matmul hides, from the ledger.

With ``async_grad_allreduce`` (or sequence parallelism) a column-parallel layer starts the
collective on its input gradient, computes its weight gradient while it is in flight, and
only then waits (:mod:`lslm.tensor_parallel.linear_comm`). The ledger stamps the
collective's issue and completion times (completion on request, which a layer with a log
makes; on gloo it comes from the work's future, set by gloo's own thread the moment the
operation ends); the layer logs when its weight-gradient matmul started and ended. The
*hidden* part of one collective is the intersection of the two intervals; what is left
(completion after the matmul ended) was exposed, waited for on the critical path.

On a 2-core CPU the "communication" is itself done by CPU threads competing with the
matmul for the same cores, so the overlap measured here says that the schedule allows
overlap, not what it buys on GPUs, where NCCL runs on the copy engines and its own SMs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lslm.runtime.completion import resolve
from lslm.tensor_parallel.layers import ColumnParallelLinear

__all__ = ["overlap_log", "overlap_summary"]


def overlap_log(model: nn.Module) -> list[dict[str, Any]]:
    """Make every column-parallel layer of ``model`` log its backward overlap into one list; return the list."""
    log: list[dict[str, Any]] = []
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.overlap_log = log
    return log


def overlap_summary(log: list[dict[str, Any]]) -> dict[str, float]:
    """Totals over logged backwards: communication time, the part hidden behind the weight gradient, and the
    exposed rest (seconds), plus ``hidden_fraction``. Entries whose completion time is unknown are skipped."""
    comm = hidden = 0.0
    counted = 0
    for entry in log:
        rec = entry.get("record")
        done = rec.completion_s if rec is not None else None
        if done is None:
            continue
        # The collective's start: where the stream let it run (a mark) when logged, else its host issue time.
        start = resolve(entry.get("comm_start_s")) or rec.issue_s
        w0, w1 = resolve(entry["wgrad_start_s"]), resolve(entry["wgrad_end_s"])
        if w0 is None or w1 is None:
            continue  # a CUDA event not reached yet
        end = done
        comm += end - start
        hidden += max(0.0, min(end, w1) - max(start, w0))
        counted += 1
    return {"collectives": counted, "comm_s": comm, "hidden_s": hidden, "exposed_s": comm - hidden,
            "hidden_fraction": hidden / comm if comm > 0 else 0.0}
