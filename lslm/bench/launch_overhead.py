"""How long does starting a job take? Wall time of ``lslm.launch`` for trivial jobs.

``echo`` starts torchrun and N Python workers that import lslm and return at once
(no process group); ``smoke`` also joins a gloo group, all-reduces 4 KiB and tears
down. Medians of ``repeats`` runs; this is the fixed cost every notebook cell pays.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lslm.runtime.launch import launch


def measure(nprocs: tuple[int, ...] = (2, 4), repeats: int = 5) -> list[dict[str, Any]]:
    """Median wall seconds of a trivial launch per world size, for the echo and smoke jobs."""
    rows = []
    for n in nprocs:
        for job, target in (("echo", "lslm.demos.smoke:echo"), ("smoke", "lslm.demos.smoke:worker")):
            walls = [launch(target, nproc=n, output="none").wall_s for _ in range(repeats)]
            rows.append({"nproc": n, "job": job, "median_s": statistics.median(walls), "min_s": min(walls),
                         "max_s": max(walls), "repeats": repeats})
    return rows


def main(out: str | None = None, nprocs: tuple[int, ...] = (2, 4), repeats: int = 5) -> list[dict[str, Any]]:
    """Print the table; write JSON to ``out`` if given."""
    rows = measure(nprocs, repeats)
    print(f"{'nproc':>5} {'job':<6} {'median s':>9} {'min s':>7} {'max s':>7}")
    for r in rows:
        print(f"{r['nproc']:>5} {r['job']:<6} {r['median_s']:>9.2f} {r['min_s']:>7.2f} {r['max_s']:>7.2f}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(rows, indent=1))
    return rows
