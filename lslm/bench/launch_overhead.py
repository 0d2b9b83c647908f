"""How long does starting a job take? Wall time of ``lslm.launch`` for trivial jobs.

``echo`` starts N workers that import lslm and return at once (no process group); ``smoke``
also joins a gloo group, all-reduces 4 KiB and tears down. Each through both launchers:
``torchrun`` (an agent and N fresh interpreters, each importing torch: the fixed cost every
notebook cell pays) and ``forkserver`` (:mod:`lslm.launcher.forkserver`: the ranks forked from a
server that imported torch once; its first launch, which starts the server, is the row ``first``).
Medians of ``repeats`` runs. The table, ``launch_overhead.json`` and ``launch_overhead.png`` are
written together (:class:`lslm.harness.Report`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from lslm.bench.checks import at_least, world_sizes
from lslm.harness import Report
from lslm.launcher.launch import LAUNCHERS, launch

__all__ = ["main", "measure", "plot", "print_table"]


def measure(nprocs: tuple[int, ...] = (2, 4), repeats: int = 5) -> list[dict[str, Any]]:
    """Median wall seconds of a trivial launch per world size, for the echo and smoke jobs."""
    nprocs = world_sizes(nprocs)  # before any process starts
    at_least("repeats", repeats, 1)
    rows = []
    for launcher in LAUNCHERS:
        for n in nprocs:
            if launcher == "forkserver" and n == nprocs[0]:
                first = launch("lslm.demos.smoke:echo", nproc=n, output="none", launcher=launcher).wall_s
                rows.append({"launcher": launcher, "nproc": n, "job": "first", "median_s": first, "min_s": first,
                             "max_s": first, "repeats": 1})
            for job, target in (("echo", "lslm.demos.smoke:echo"), ("smoke", "lslm.demos.smoke:worker")):
                walls = [launch(target, nproc=n, output="none", launcher=launcher).wall_s for _ in range(repeats)]
                rows.append({"launcher": launcher, "nproc": n, "job": job, "median_s": statistics.median(walls),
                             "min_s": min(walls), "max_s": max(walls), "repeats": repeats})
    return rows


def print_table(rows: list[dict[str, Any]], report: Report | None = None) -> None:
    """One line per (world size, job): median, min and max seconds."""
    out = report.print if report is not None else print
    out(f"{'launcher':<11} {'nproc':>5} {'job':<6} {'median s':>9} {'min s':>7} {'max s':>7}")
    for r in rows:
        out(f"{r['launcher']:<11} {r['nproc']:>5} {r['job']:<6} {r['median_s']:>9.2f} {r['min_s']:>7.2f} "
            f"{r['max_s']:>7.2f}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Median launch time per world size, echo and smoke side by side, min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nprocs = sorted({r["nproc"] for r in rows})
    bars = [(launcher, job) for launcher in LAUNCHERS for job in ("echo", "smoke")]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=80)
    for k, (launcher, job) in enumerate(bars):
        pts = [next(r for r in rows if r["nproc"] == n and r["job"] == job and r["launcher"] == launcher)
               for n in nprocs]
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(nprocs))]
        med = [p["median_s"] for p in pts]
        err = [[m - p["min_s"] for m, p in zip(med, pts)], [p["max_s"] - m for m, p in zip(med, pts)]]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=f"{launcher}: {job}")
    ax.set_xticks(range(len(nprocs)), [f"{n} processes" for n in nprocs])
    ax.set_ylabel("wall time of lslm.launch (s)")
    ax.set_title("start-up cost of a job (median, min-max)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(out_dir: str | Path | None = None, nprocs: tuple[int, ...] = (2, 4), repeats: int = 5) -> list[dict[str, Any]]:
    """Measure, print the table; write ``launch_overhead.txt``, ``.json`` and ``.png`` to ``out_dir`` if given."""
    rows = measure(nprocs, repeats)
    with Report("launch_overhead", out_dir) as report:
        print_table(rows, report)
        report.write(rows, plot)
    return rows
