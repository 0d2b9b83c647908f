"""The printed side of ``lslm bench ddp``: the table, the step-time ratio and the figure.

Kept apart from the measurement (:mod:`lslm.bench.ddp`) so that notebooks and tests can
format a committed ``bench/results/ddp.json`` without launching anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lslm.harness import Report, throughput_lines

__all__ = ["plot", "print_table", "ratio"]

MIB = 1024 * 1024


def _row(rows: list[dict[str, Any]], variant: str, mb: float) -> dict[str, Any]:
    return next(r for r in rows if r["variant"] == variant and r["bucket_mb"] == mb)


def ratio(result: dict[str, Any], a: str = "bucketed", b: str = "torch") -> float:
    """Median step time of variant ``a`` over ``b`` at the common bucket size (``StopIteration`` if either is
    missing: results written before the ``buffered`` variant have none)."""
    mb = result["bucket_cap_mb"]
    return _row(result["rows"], a, mb)["step_ms"] / _row(result["rows"], b, mb)["step_ms"]


def print_table(results: dict[int, dict[str, Any]], report: Report | None = None) -> None:
    """The main comparison, the sweep and the hidden fraction, per world size (through ``report`` if given)."""
    out = report.print if report is not None else print
    for n, res in results.items():
        mb = res["bucket_cap_mb"]
        local = _row(res["rows"], "local", mb)["step_ms"]
        backend = res.get("backend", "gloo")
        out(f"\n== {n} processes ({backend}, {res['threads']} thread(s)/rank): GPT {res['num_parameters']:,} params, "
            f"{res['grad_bytes'] / MIB:.1f} MiB of gradients, {res['batch_per_rank']} x "
            f"{res['model']['block_size']} tokens per rank, medians of {res['steps']} steps ==")
        out(f"{'variant':<9} {'bucket MiB':>10} {'buckets':>7} {'step ms':>8} {'compute':>8} {'exposed':>8} "
            f"{'optim':>6} {'vs local':>8} {'vs torch':>8}  ledger bytes/step")
        torch_ms = _row(res["rows"], "torch", mb)["step_ms"]
        for r in res["rows"]:
            if r["bucket_mb"] != mb:
                continue
            if r["variant"] in ("naive", "fused", "bucketed", "buffered"):
                led = f"{r['ledger_bytes_per_step'][0]:,} = grads {r['ledger_exact']}"
            elif r["variant"] == "torch":
                led = (f"{res['torch_hook_bytes_per_step'][0]:,} = grads {res['torch_hook_exact']} "
                       "(comm-hook copy)")
            else:
                led = "no communication"
            nb = res["torch_num_buckets"] if r["variant"] == "torch" else r["num_buckets"]
            out(f"{r['variant']:<9} {r['bucket_mb']:>10g} {'-' if nb is None else nb:>7} {r['step_ms']:>8.1f} "
                f"{r['compute_ms']:>8.1f} {r['exposed_ms']:>8.1f} {r['optimizer_ms']:>6.1f} "
                f"{r['step_ms'] / local:>7.2f}x {r['step_ms'] / torch_ms:>7.2f}x  {led}")
        for line in throughput_lines([r for r in res["rows"] if r["bucket_mb"] == mb],
                                     lambda r: f"{r['variant']} {r['bucket_mb']:g} MiB"):
            out("  " + line)
        if any(r["variant"] == "buffered" for r in res["rows"]):  # absent from results written before it
            out("buffered = bucketed DDP on the gradient buffer: main_grad views into fp32 buffers, each bucket "
                "all-reduced in place (no copies)")
        out(f"bucket-size sweep: {'bucket MiB':>10} {'buckets':>7} {'bucketed ms':>11} {'torch ms':>9} "
            f"{'ratio':>6}")
        for m in sorted({r["bucket_mb"] for r in res["rows"] if r["variant"] == "bucketed"}):
            b = _row(res["rows"], "bucketed", m)
            t = next((r for r in res["rows"] if r["variant"] == "torch" and r["bucket_mb"] == m), None)
            tail = f"{t['step_ms']:>9.1f} {b['step_ms'] / t['step_ms']:>5.2f}x" if t else f"{'-':>9} {'-':>6}"
            out(f"{'':<18} {m:>10g} {b['num_buckets']:>7} {b['step_ms']:>11.1f} {tail}")
        naive = _row(res["rows"], "naive", mb)["step_ms"]
        buck = _row(res["rows"], "bucketed", mb)["step_ms"]
        exposed = _row(res["rows"], "bucketed", mb)["exposed_ms"]
        out(f"hidden fraction (bucketed, {mb:g} MiB buckets): 1 - exposed {exposed:.1f} ms"
            f" / all-reduce alone {res['comm_alone_ms']:.1f} ms = {res['hidden_fraction']:.2f}; "
            f"bucketed is {naive / buck:.2f}x faster than naive ({naive - buck:.1f} ms per step)")


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Step-time breakdown per variant, the bucket sweep and the rank timelines, one row per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lslm.plot.ddp import plot_bucket_sweep, plot_step_breakdown, plot_timeline

    worlds = sorted(results)
    fig, axes = plt.subplots(len(worlds), 3, figsize=(16, 4.2 * len(worlds)), dpi=80, squeeze=False)
    for row, n in zip(axes, worlds):
        plot_step_breakdown(results[n], ax=row[0])
        plot_bucket_sweep(results[n], ax=row[1])
        plot_timeline(results[n]["timeline"], ax=row[2],
                      title=f"bucketed, {results[n]['bucket_cap_mb']:g} MiB buckets, {n} processes: one step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
