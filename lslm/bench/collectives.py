"""``lslm bench collectives``: every lslm collective next to torch.distributed's, same run.

For each world size a job is launched; in it, for every kind of collective and every
message size, torch's call and every lslm algorithm are handed to the bench runner
(:func:`lslm.harness.run_variants`): ``warmup`` untimed rounds, then ``repeats`` rounds
in which the algorithms take turns (interleaved), each call preceded by a barrier.
A call's time is the *slowest* rank's; we report the median over repeats. Bandwidths use the
nccl-tests definitions: ``algbw = S / t`` and ``busbw = algbw x factor``, with the
factor of :func:`lslm.runtime.ledger.bus_factor` (2(n-1)/n for all-reduce, (n-1)/n
for all-gather/reduce-scatter/all-to-all/scatter/gather, 1 for broadcast/reduce),
so busbw is comparable across collectives and world sizes.

``S`` (the message size) is the nccl-tests one: the tensor for all-reduce,
broadcast and reduce; the gathered output for all-gather and gather; the input
for reduce-scatter, scatter and all-to-all.

Then the alpha-beta-gamma model ``t = a*alpha + b*S*beta + c*S*gamma`` is fitted
to the lslm measurements by least squares on relative error, where (a, b, c) per
algorithm come from its critical path (:func:`lslm.metrics.collective_costs.cost_coefficients`): alpha is the
per-message latency, beta the seconds per byte on the wire, gamma the seconds
per byte reduced. The device is a parameter (``"cpu"``: gloo, ``"cuda"``: NCCL); the
table, ``collectives.json`` and ``collectives.png`` are written together
(:class:`lslm.harness.Report`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lslm.bench.checks import at_least, world_sizes
from lslm.bench.devices import device_env
from lslm.harness import Report, Variant, run_variants
from lslm.metrics.collective_costs import fit_alpha_beta

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB)

LSLM_ALGORITHMS = {
    # [paired]: the ring posting each step's receive and send together, as on NCCL (on gloo the
    # plain ring posts receives ahead; on NCCL the two are the same code).
    "all_reduce": ("all_reduce_ring", "all_reduce_ring[paired]", "all_reduce_tree", "all_reduce_reduce_broadcast"),
    "broadcast": ("broadcast_tree", "broadcast_flat"),
    "reduce": ("reduce_tree",),
    "all_gather": ("all_gather_ring",),
    "reduce_scatter": ("reduce_scatter_ring",),
    "all_to_all": ("all_to_all_pairwise",),
    "scatter": ("scatter",),
    "gather": ("gather",),
}


def _numel(size: int, n: int) -> int:
    numel = max(n, size // 4)
    return numel - numel % n  # per-rank chunks of equal size, as torch's tensor collectives require


def _case(kind: str, name: str, size: int, n: int, rank: int, comm: Any,
          device: torch.device | str = "cpu") -> Callable[[], None]:
    """Allocate buffers for one (kind, algorithm, size) on ``device`` and return a zero-argument call."""
    import lslm.collectives as C

    numel = _numel(size, n)
    dev = torch.device(device)

    def randn(k: int) -> torch.Tensor:
        return torch.randn(k, device=dev)

    def empty(k: int) -> torch.Tensor:
        return torch.empty(k, device=dev)

    x = randn(numel)
    native = name.startswith("torch.")
    if kind == "all_reduce":
        if name == "all_reduce_ring[paired]":
            return lambda: C.all_reduce_ring(x, comm=comm, check=False, post_ahead=False)
        return (lambda: dist.all_reduce(x)) if native else (lambda: getattr(C, name)(x, comm=comm, check=False))
    if kind == "broadcast":
        return (lambda: dist.broadcast(x, src=0)) if native else (
            lambda: getattr(C, name)(x, src=0, comm=comm, check=False))
    if kind == "reduce":
        return (lambda: dist.reduce(x, dst=0)) if native else (lambda: C.reduce_tree(x, dst=0, comm=comm, check=False))
    if kind == "all_gather":
        inp, out = randn(numel // n), empty(numel)
        return (lambda: comm.all_gather_into_tensor(out, inp)) if native else (
            lambda: C.all_gather_ring(out, inp, comm=comm, check=False))
    if kind == "reduce_scatter":
        out = empty(numel // n)
        return (lambda: comm.reduce_scatter_tensor(out, x)) if native else (
            lambda: C.reduce_scatter_ring(out, x, comm=comm, check=False))
    if kind == "all_to_all":
        out = empty(numel)
        return (lambda: dist.all_to_all_single(out, x)) if native else (
            lambda: C.all_to_all_pairwise(out, x, comm=comm, check=False))
    if kind == "scatter":
        out = empty(numel // n)
        parts = list(x.chunk(n)) if rank == 0 else None
        return (lambda: dist.scatter(out, parts, src=0)) if native else (
            lambda: C.scatter(out, parts, src=0, comm=comm, check=False))
    if kind == "gather":
        inp = randn(numel // n)
        parts = [empty(numel // n) for _ in range(n)] if rank == 0 else None
        return (lambda: dist.gather(inp, parts, dst=0)) if native else (
            lambda: C.gather(inp, parts, dst=0, comm=comm, check=False))
    raise ValueError(f"unknown kind {kind!r}")


def worker(sizes: list[int], repeats: int = 5, warmup: int = 2, kinds: list[str] | None = None,
           device: str | None = None) -> dict[str, Any]:
    """One rank of the benchmark; rank 0 returns every row (the others an empty list).

    ``device`` is passed to :func:`lslm.runtime.init_distributed` (``None``: its choice,
    or ``LSLM_DEVICE``). Per (kind, size), torch's call and the lslm algorithms run
    interleaved through :func:`lslm.harness.run_variants`.
    """
    from lslm.runtime import init_distributed
    from lslm.runtime.ledger import bus_factor

    found: dict[tuple[str, str, int], dict[str, Any]] = {}
    with init_distributed(device=device) as ctx:
        torch.set_num_threads(1)
        ctx.comm.ledger.enabled = False  # counting is the tests' job; keep the timed path lean
        n = ctx.world_size
        kinds = kinds or list(LSLM_ALGORITHMS)
        for kind in kinds:
            names = (f"torch.{kind}", *LSLM_ALGORITHMS[kind])
            for size in sizes:
                calls = {name: _case(kind, name, size, n, ctx.rank, ctx.comm, ctx.device) for name in names}
                variants = [Variant(name, lambda timer, i, call=call: call()) for name, call in calls.items()]
                timings = run_variants(variants, steps=repeats, warmup=warmup, device=ctx.device)
                real_size = _numel(size, n) * 4
                for name in names:
                    t = timings[name].median()
                    algbw = real_size / t
                    found[(kind, name, size)] = {
                        "world_size": n, "kind": kind, "algorithm": name, "bytes": real_size, "time_s": t,
                        "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * bus_factor(kind, n) / 1e9}
                del calls, variants
        # The table's order: by kind, then algorithm, then size.
        rows = [found[(k, name, size)] for k in kinds for name in (f"torch.{k}", *LSLM_ALGORITHMS[k])
                for size in sizes]
        return {"rank": ctx.rank, "backend": ctx.backend, "device": str(ctx.device),
                "rows": rows if ctx.rank == 0 else []}


def ring_to_native_ratio(rows: list[dict[str, Any]], size: int | None = None, name: str = "all_reduce_ring") -> float:
    """busbw of lslm ring all-reduce (or the all-reduce ``name``) over torch's all-reduce at ``size`` (default: the
    largest)."""
    ar = {r["algorithm"]: r for r in rows if r["kind"] == "all_reduce" and (size is None or r["bytes"] == size)}
    if size is None:
        biggest = max(r["bytes"] for r in rows if r["kind"] == "all_reduce")
        ar = {r["algorithm"]: r for r in rows if r["kind"] == "all_reduce" and r["bytes"] == biggest}
    native = ar["torch.all_reduce"]["busbw_GBps"]
    return ar[name]["busbw_GBps"] / native if native else float("nan")  # one rank: no bus traffic


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Write :func:`lslm.plot.collectives.plot_collectives` (bus bandwidth; measured vs fitted model) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lslm.plot.collectives import plot_collectives  # one figure for the notebook and the bench

    fig = plot_collectives(results)
    fig.savefig(path)
    plt.close(fig)


def run(nprocs: tuple[int, ...] = (2, 4), sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5,
        warmup: int = 2, out_dir: str | Path | None = "bench/results", kinds: list[str] | None = None,
        timeout: float = 900.0, device: str = "cpu") -> dict[int, dict[str, Any]]:
    """Launch the benchmark at each world size on ``device``, fit the model; print the table and write
    ``collectives.txt`` (the printed text), ``.json`` and ``.png`` to ``out_dir`` (``None``: print only)."""
    from lslm.launcher.launch import launch

    nprocs = world_sizes(nprocs)  # every check before any process starts
    sizes = tuple(sizes)
    if not sizes:
        raise ValueError("sizes is empty: give at least one message size in bytes")
    for size in sizes:
        at_least("message sizes (bytes)", size, 1)
    at_least("repeats", repeats, 1)
    at_least("warmup", warmup, 0)
    env = device_env(device, max(nprocs))
    results: dict[int, dict[str, Any]] = {}
    for n in nprocs:
        res = launch("lslm.bench.collectives:worker", nproc=n, timeout=timeout, output="none", sizes=list(sizes),
                     repeats=repeats, warmup=warmup, kinds=kinds, env=env)
        rows = res[0]["rows"]
        results[n] = {"rows": rows, "fit": fit_alpha_beta(rows), "backend": res[0]["backend"],
                      "device": res[0]["device"]}
    with Report("collectives", out_dir) as report:
        print_table(results, report)
        report.write(results, plot)
        if all("all_reduce" in {r["kind"] for r in v["rows"]} for v in results.values()):
            # One line per size from 16 MiB up (the bandwidth-bound sizes), else the largest size.
            for size in [z for z in sorted(set(sizes)) if z >= 16 * MIB] or [max(sizes)]:
                ratios = ", ".join(
                    f"{n} processes {ring_to_native_ratio(v['rows'], _numel(size, n) * 4):.2f} (paired steps "
                    f"{ring_to_native_ratio(v['rows'], _numel(size, n) * 4, 'all_reduce_ring[paired]'):.2f})"
                    for n, v in results.items())
                report.print(f"ring all-reduce / torch all_reduce bus bandwidth at {size / MIB:g} MiB: {ratios}")
    return results


def print_table(results: dict[int, dict[str, Any]], report: Report | None = None) -> None:
    """One table per world size: time, algbw and busbw of every (kind, algorithm, size), then the fit."""
    out = report.print if report is not None else print
    for n, res in results.items():
        out(f"\n== {n} processes ({res.get('backend', 'gloo')}) ==")
        out(f"{'kind':<15} {'algorithm':<28} {'size':>9} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for r in res["rows"]:
            size = f"{r['bytes'] / MIB:g} MiB" if r["bytes"] >= MIB else f"{r['bytes'] / KIB:g} KiB"
            out(f"{r['kind']:<15} {r['algorithm']:<28} {size:>9} {r['time_s'] * 1e3:>9.3f} "
                f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}")
        f = res["fit"]
        out(f"fit: alpha = {f['alpha_s'] * 1e6:.1f} us, beta = {f['beta_s_per_byte'] * 1e9:.3f} ns/B "
            f"(1/beta = {f['bandwidth_GBps']:.2f} GB/s), gamma = {f['gamma_s_per_byte'] * 1e9:.3f} ns/B; "
            f"median |error| {f['median_rel_error'] * 100:.0f}%")
