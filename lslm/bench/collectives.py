"""``lslm bench collectives``: every lslm collective next to torch.distributed's, same run.

For each world size a job is launched; in it, for every message size and every
algorithm, each rank runs ``warmup`` untimed calls, then ``repeats`` timed calls,
each preceded by a barrier. A call's time is the *slowest* rank's (an all-reduce
MAX of the per-rank times); we report the median over repeats. Bandwidths use the
nccl-tests definitions: ``algbw = S / t`` and ``busbw = algbw x factor``, with the
factor of :func:`lslm.runtime.ledger.bus_factor` (2(n-1)/n for all-reduce, (n-1)/n
for all-gather/reduce-scatter/all-to-all/scatter/gather, 1 for broadcast/reduce),
so busbw is comparable across collectives and world sizes.

``S`` (the message size) is the nccl-tests one: the tensor for all-reduce,
broadcast and reduce; the gathered output for all-gather and gather; the input
for reduce-scatter, scatter and all-to-all.

Then the alpha-beta-gamma model ``t = a*alpha + b*S*beta + c*S*gamma`` is fitted
to the lslm measurements by least squares on relative error, where (a, b, c) per
algorithm come from its critical path (:func:`cost_coefficients`): alpha is the
per-message latency, beta the seconds per byte on the wire, gamma the seconds
per byte reduced.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lslm.bench.results import write_results

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB)

LSLM_ALGORITHMS = {
    "all_reduce": ("all_reduce_ring", "all_reduce_tree", "all_reduce_reduce_broadcast"),
    "broadcast": ("broadcast_tree", "broadcast_flat"),
    "reduce": ("reduce_tree",),
    "all_gather": ("all_gather_ring",),
    "reduce_scatter": ("reduce_scatter_ring",),
    "all_to_all": ("all_to_all_pairwise",),
    "scatter": ("scatter",),
    "gather": ("gather",),
}


def cost_coefficients(name: str, n: int) -> tuple[float, float, float]:
    """(alpha, beta, gamma) multipliers of algorithm ``name`` on ``n`` ranks for a message of S bytes.

    ``t = a*alpha + b*S*beta + c*S*gamma`` along the critical path (the slowest rank).
    """
    L = math.ceil(math.log2(n)) if n > 1 else 0
    k = n.bit_length() - 1
    rd = k + (2 if n != 1 << k else 0)  # recursive doubling: 2 extra rounds fold/unfold the remainder
    f = (n - 1) / n
    table = {
        "broadcast_flat": (n - 1, n - 1, 0),
        "broadcast_tree": (L, L, 0),
        "reduce_tree": (L, L, L),
        "scatter": (n - 1, f, 0),
        "gather": (n - 1, f, 0),
        "all_gather_ring": (n - 1, f, 0),
        "reduce_scatter_ring": (n - 1, f, f),
        "all_to_all_pairwise": (n - 1, f, 0),
        "all_reduce_reduce_broadcast": (2 * L, 2 * L, L),
        "all_reduce_tree": (rd, rd, k),
        "all_reduce_ring": (2 * (n - 1), 2 * f, f),
    }
    return table[name]


def _case(kind: str, name: str, size: int, n: int, rank: int, comm: Any) -> Callable[[], None]:
    """Allocate buffers for one (kind, algorithm, size) and return a zero-argument call."""
    import lslm.collectives as C

    numel = max(n, size // 4)
    numel -= numel % n  # per-rank chunks of equal size, as torch's tensor collectives require
    x = torch.randn(numel)
    native = name.startswith("torch.")
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(x)) if native else (lambda: getattr(C, name)(x, comm=comm, check=False))
    if kind == "broadcast":
        return (lambda: dist.broadcast(x, src=0)) if native else (
            lambda: getattr(C, name)(x, src=0, comm=comm, check=False))
    if kind == "reduce":
        return (lambda: dist.reduce(x, dst=0)) if native else (lambda: C.reduce_tree(x, dst=0, comm=comm, check=False))
    if kind == "all_gather":
        inp, out = torch.randn(numel // n), torch.empty(numel)
        return (lambda: comm.all_gather_into_tensor(out, inp)) if native else (
            lambda: C.all_gather_ring(out, inp, comm=comm, check=False))
    if kind == "reduce_scatter":
        out = torch.empty(numel // n)
        return (lambda: comm.reduce_scatter_tensor(out, x)) if native else (
            lambda: C.reduce_scatter_ring(out, x, comm=comm, check=False))
    if kind == "all_to_all":
        out = torch.empty(numel)
        return (lambda: dist.all_to_all_single(out, x)) if native else (
            lambda: C.all_to_all_pairwise(out, x, comm=comm, check=False))
    if kind == "scatter":
        out = torch.empty(numel // n)
        parts = list(x.chunk(n)) if rank == 0 else None
        return (lambda: dist.scatter(out, parts, src=0)) if native else (
            lambda: C.scatter(out, parts, src=0, comm=comm, check=False))
    if kind == "gather":
        inp = torch.randn(numel // n)
        parts = [torch.empty(numel // n) for _ in range(n)] if rank == 0 else None
        return (lambda: dist.gather(inp, parts, dst=0)) if native else (
            lambda: C.gather(inp, parts, dst=0, comm=comm, check=False))
    raise ValueError(f"unknown kind {kind!r}")


def worker(sizes: list[int], repeats: int = 5, warmup: int = 2, kinds: list[str] | None = None) -> dict[str, Any]:
    """One rank of the benchmark; rank 0 returns every row (others return their rank only)."""
    from lslm.runtime import init_distributed
    from lslm.runtime.ledger import bus_factor

    rows = []
    with init_distributed() as ctx:
        torch.set_num_threads(1)
        ctx.comm.ledger.enabled = False  # counting is the tests' job; keep the timed path lean
        n = ctx.world_size
        for kind in kinds or list(LSLM_ALGORITHMS):
            for name in (f"torch.{kind}", *LSLM_ALGORITHMS[kind]):
                for size in sizes:
                    call = _case(kind, name, size, n, ctx.rank, ctx.comm)
                    for _ in range(warmup):
                        call()
                    times = torch.empty(repeats, dtype=torch.float64)
                    for i in range(repeats):
                        dist.barrier()
                        t0 = time.perf_counter()
                        call()
                        times[i] = time.perf_counter() - t0
                    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each call costs what its slowest rank took
                    t = statistics.median(times.tolist())
                    real_size = (max(n, size // 4) // n * n) * 4
                    algbw = real_size / t
                    rows.append({"world_size": n, "kind": kind, "algorithm": name, "bytes": real_size,
                                 "time_s": t, "algbw_GBps": algbw / 1e9,
                                 "busbw_GBps": algbw * bus_factor(kind, n) / 1e9})
                    del call
    return {"rank": ctx.rank, "rows": rows if ctx.rank == 0 else []}


def fit_alpha_beta(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares (relative error) fit of alpha, beta, gamma to the lslm rows of one world size."""
    import numpy as np

    lslm_rows = [r for r in rows if not r["algorithm"].startswith("torch.")]
    A = np.array([[a, b * r["bytes"], c * r["bytes"]] for r in lslm_rows
                  for a, b, c in [cost_coefficients(r["algorithm"], r["world_size"])]], dtype=float)
    t = np.array([r["time_s"] for r in lslm_rows])
    cols = [0, 1, 2]
    while True:  # drop any coefficient that comes out negative (non-physical) and refit
        coef, *_ = np.linalg.lstsq(A[:, cols] / t[:, None], np.ones_like(t), rcond=None)
        if (coef >= 0).all() or len(cols) == 1:
            break
        cols = [c for c, v in zip(cols, coef) if v >= 0]
    full = dict.fromkeys(range(3), 0.0)
    full.update({c: float(v) for c, v in zip(cols, coef)})
    alpha, beta, gamma = full[0], full[1], full[2]
    pred = A @ np.array([alpha, beta, gamma])
    rel = np.abs(pred - t) / t
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "gamma_s_per_byte": gamma,
            "bandwidth_GBps": (1 / beta / 1e9) if beta > 0 else float("inf"),
            "median_rel_error": float(np.median(rel)), "max_rel_error": float(rel.max())}


def model_time(fit: dict[str, float], name: str, n: int, size: int) -> float:
    """Time the fitted model predicts for ``name`` on ``n`` ranks and ``size`` bytes."""
    a, b, c = cost_coefficients(name, n)
    return a * fit["alpha_s"] + b * size * fit["beta_s_per_byte"] + c * size * fit["gamma_s_per_byte"]


def ring_to_native_ratio(rows: list[dict[str, Any]], size: int | None = None) -> float:
    """busbw of lslm ring all-reduce over torch's all-reduce at ``size`` (default: the largest)."""
    ar = {r["algorithm"]: r for r in rows if r["kind"] == "all_reduce" and (size is None or r["bytes"] == size)}
    if size is None:
        biggest = max(r["bytes"] for r in rows if r["kind"] == "all_reduce")
        ar = {r["algorithm"]: r for r in rows if r["kind"] == "all_reduce" and r["bytes"] == biggest}
    return ar["all_reduce_ring"]["busbw_GBps"] / ar["torch.all_reduce"]["busbw_GBps"]


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Left: all-reduce bus bandwidth vs size, lslm vs torch. Right: measured vs fitted model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted(results)
    fig, axes = plt.subplots(len(worlds), 2, figsize=(12, 4.2 * len(worlds)), dpi=80, squeeze=False)
    for row_axes, n in zip(axes, worlds):
        rows, fit = results[n]["rows"], results[n]["fit"]
        ax = row_axes[0]
        for name in ("torch.all_reduce", *LSLM_ALGORITHMS["all_reduce"]):
            pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if r["algorithm"] == name)
            ax.plot([p[0] / MIB for p in pts], [p[1] for p in pts], marker="o", label=name,
                    lw=2.5 if name.startswith("torch") else 1.5)
        ax.set_xscale("log")
        ax.set_xlabel("message size (MiB)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"all-reduce bus bandwidth, {n} processes (gloo)")
        ax.legend(fontsize=8)
        ax = row_axes[1]
        for name in [a for names in LSLM_ALGORITHMS.values() for a in names]:
            pts = sorted((r["bytes"], r["time_s"]) for r in rows if r["algorithm"] == name)
            line, = ax.plot([p[0] / MIB for p in pts], [p[1] * 1e3 for p in pts], "o", ms=4, label=name)
            xs = [p[0] for p in pts]
            ax.plot([x / MIB for x in xs], [model_time(fit, name, n, x) * 1e3 for x in xs], "-",
                    color=line.get_color(), lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message size (MiB)")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"measured (dots) vs alpha-beta-gamma model (lines), {n} processes\n"
                     f"alpha={fit['alpha_s'] * 1e6:.0f} us, 1/beta={fit['bandwidth_GBps']:.2f} GB/s, "
                     f"gamma={fit['gamma_s_per_byte'] * 1e9:.2f} ns/B", fontsize=10)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(nprocs: tuple[int, ...] = (2, 4), sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5,
        warmup: int = 2, out_dir: str | Path | None = "bench/results", kinds: list[str] | None = None,
        timeout: float = 900.0) -> dict[int, dict[str, Any]]:
    """Launch the benchmark at each world size, fit the model, print the table, write JSON and PNG."""
    from lslm.runtime.launch import launch

    results: dict[int, dict[str, Any]] = {}
    for n in nprocs:
        res = launch("lslm.bench.collectives:worker", nproc=n, timeout=timeout, output="none", sizes=list(sizes),
                     repeats=repeats, warmup=warmup, kinds=kinds, env={"LSLM_BACKEND": "gloo", "LSLM_DEVICE": "cpu"})
        rows = res[0]["rows"]
        results[n] = {"rows": rows, "fit": fit_alpha_beta(rows)}
    _print_table(results)
    if out_dir is not None:
        write_results(results, out_dir, "collectives", plot)
    if all("all_reduce" in {r["kind"] for r in v["rows"]} for v in results.values()):
        ratios = ", ".join(f"{n} processes {ring_to_native_ratio(v['rows']):.2f}" for n, v in results.items())
        biggest = max(sizes) / MIB
        print(f"ring all-reduce / torch all_reduce bus bandwidth at {biggest:g} MiB: {ratios}")
    return results


def _print_table(results: dict[int, dict[str, Any]]) -> None:
    for n, res in results.items():
        print(f"\n== {n} processes (gloo) ==")
        print(f"{'kind':<15} {'algorithm':<28} {'size':>9} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for r in res["rows"]:
            size = f"{r['bytes'] / MIB:g} MiB" if r["bytes"] >= MIB else f"{r['bytes'] / KIB:g} KiB"
            print(f"{r['kind']:<15} {r['algorithm']:<28} {size:>9} {r['time_s'] * 1e3:>9.3f} "
                  f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}")
        f = res["fit"]
        print(f"fit: alpha = {f['alpha_s'] * 1e6:.1f} us, beta = {f['beta_s_per_byte'] * 1e9:.3f} ns/B "
              f"(1/beta = {f['bandwidth_GBps']:.2f} GB/s), gamma = {f['gamma_s_per_byte'] * 1e9:.3f} ns/B; "
              f"median |error| {f['median_rel_error'] * 100:.0f}%")
