"""The DDP step-time model (:mod:`lslm.metrics.step_time`) against a measurement, both from one run.

:func:`run` launches :func:`worker` (2 processes by default). In one job, on the same
machine state, every rank:

1. trains a ``local`` copy of the GPT (no communication: forward, backward and optimizer
   times, the model's inputs) and one :class:`~lslm.data_parallel.ddp.BucketedDDP` copy
   per bucket cap, round-robin through the bench runner (:func:`lslm.harness.run_variants`:
   barrier, slowest rank per step, phases on the rank with the longest compute, medians);
2. all-reduces each cap's buckets back to back with nothing else running (the
   communication the step would expose without overlap);
3. times ``dist.all_reduce`` over a sweep of sizes (4 KiB up to the largest bucket) and
   fits alpha and a per-byte cost to it (:func:`~lslm.metrics.step_time.fit_ring`).

:func:`compare` then predicts each cap's step from the real bucket sizes, the ``local`` compute and
the measured back-to-back time of that cap's buckets (step 2; shared over the buckets with the
alpha-beta shape fitted on all caps, :func:`~lslm.metrics.step_time.fit_ring_totals`), so the model
is tested on the overlap, not on the constants; the same prediction with the sweep's fit shows what
the constants alone would have cost. Whether a cap is *communication-bound* is read from the
measurement alone: its buckets back to back took longer than the ``local`` backward.
Timings vary from run to run; tests check only that the fields are there and consistent.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from lslm.harness import Variant, run_variants
from lslm.metrics.step_time import LinkCost, fit_ring, fit_ring_totals, predict_step, ring_all_reduce_s

__all__ = ["PHASES", "compare", "run", "worker"]

#: Spans between the marks lslm.bench.ddp's step sets.
PHASES = {"forward": ("start", "forward_end"), "backward": ("forward_end", "backward_end"),
          "compute": ("start", "backward_end"), "exposed": ("backward_end", "sync_end"),
          "optimizer": ("sync_end", "end")}
KIB = 1024


def _sweep_sizes(bucket_bytes: list[int]) -> list[int]:
    """A geometric ladder 4 KiB, 16 KiB, ... up to the first size >= the largest bucket: alpha and beta both pinned."""
    sizes = [4 * KIB]
    while sizes[-1] < max(bucket_bytes):
        sizes.append(sizes[-1] * 4)
    return sizes


def worker(model: dict[str, Any], bucket_caps_mb: list[float], batch_per_rank: int = 2, steps: int = 5,
           warmup: int = 1, comm_repeats: int = 5, threads: int = 1, seed: int = 0,
           device: str | None = None) -> dict[str, Any]:
    """One rank of the measurement (module doc); rank 0 returns everything, the others ``{"rank"}``."""
    from lslm.bench.ddp import _one_step  # the bench's timed step: the same marks, so the same phases
    from lslm.data_parallel.ddp import make_ddp
    from lslm.models.gpt import GPT, GPTConfig
    from lslm.precision import PlainOptimizer
    from lslm.runtime import init_distributed

    wall = {"start": time.perf_counter()}  # where the job's own time goes (the notebook has a budget)
    with init_distributed(device=device, seed=seed) as ctx:
        torch.set_num_threads(threads)
        ctx.comm.ledger.enabled = False  # counting is the DDP tests' job; keep the timed path lean
        n, dev = ctx.world_size, ctx.device
        # Random token ids: the time of a step does not depend on which tokens it sees, and this
        # spares every rank the seconds that importing the corpus tooling (datasets) takes.
        gen = torch.Generator().manual_seed(seed + ctx.rank)
        shape = (batch_per_rank, model["block_size"] + 1)
        data = [torch.randint(model["vocab_size"], shape, generator=gen).to(dev)  # lslm: cpu-ok (host RNG, then moved)
                for _ in range(warmup + steps)]

        entries: list[tuple[str, Any, Any, Any]] = []
        for mb in [None, *bucket_caps_mb]:
            torch.manual_seed(seed)
            net = GPT(GPTConfig(**model)).to(dev)
            ddp = None if mb is None else make_ddp(net, ctx, variant="bucketed", bucket_cap_mb=mb)
            opt = PlainOptimizer(net, torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False))  # as _one_step wants
            entries.append(("local" if mb is None else f"bucketed {mb:g}", net, ddp, opt))

        def step_of(net: Any, ddp: Any, opt: Any) -> Any:
            return lambda timer, i: _one_step(net, ddp, opt, data[i], timer)

        wall["setup"] = time.perf_counter()
        timings = run_variants([Variant(name, step_of(net, ddp, opt)) for name, net, ddp, opt in entries],
                               steps=steps, warmup=warmup, phases=PHASES, critical="compute", device=dev)

        wall["steps"] = time.perf_counter()
        # Each cap's buckets, all-reduced back to back alone; then the sweep for the fit.
        def back_to_back(bufs: list[torch.Tensor]) -> Any:
            return lambda timer, i: [dist.all_reduce(b) for b in bufs]

        sizes: dict[str, list[int]] = {}
        alone_variants = []
        for name, net, ddp, _ in entries[1:]:
            numel = {nm: p.numel() for nm, p in net.named_parameters()}
            bufs = [torch.zeros(sum(numel[nm] for nm in names), device=dev) for names in ddp.buckets]
            sizes[name] = [b.numel() * b.element_size() for b in bufs]
            alone_variants.append(Variant(name, back_to_back(bufs)))
        alone = run_variants(alone_variants, steps=comm_repeats, warmup=1, device=dev)
        wall["comm_alone"] = time.perf_counter()
        sweep_bytes = _sweep_sizes([b for bs in sizes.values() for b in bs])
        sweep = run_variants([Variant(str(s), back_to_back([torch.zeros(s // 4, device=dev)])) for s in sweep_bytes],
                             steps=comm_repeats, warmup=1, device=dev)

        wall["sweep"] = time.perf_counter()
        rows = []
        for name, t in timings.items():
            rows.append({"name": name, "bucket_bytes": sizes.get(name, []),
                         "step_s": t.median(), **{f"{p}_s": t.median(p) for p in PHASES},
                         "comm_alone_s": alone[name].median() if name in alone else 0.0})
        result = {"world_size": n, "model": model, "batch_per_rank": batch_per_rank, "steps": steps,
                  "threads": torch.get_num_threads(), "backend": ctx.backend, "device": str(dev),
                  "grad_bytes": sum(p.numel() * p.element_size() for p in entries[0][1].parameters()),
                  "wall_s": {k: wall[k] - wall[p] for p, k in zip(wall, list(wall)[1:])},
                  "rows": rows, "sweep": [{"bytes": s, "time_s": sweep[str(s)].median()} for s in sweep_bytes]}
    return {"rank": ctx.rank, **(result if ctx.rank == 0 else {})}


def _rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas > 0 else float("nan")


def compare(result: dict[str, Any], link: LinkCost | None = None) -> dict[str, Any]:
    """Predictions next to the measurements of :func:`worker`'s ``result``; relative error = (pred - meas) / meas.

    The model's compute, backward share and optimizer time are the ``local`` entry's (no
    communication running). Each cap's per-bucket all-reduce times have the alpha-beta shape of
    ``link`` and are scaled so that they add up to that cap's *measured* back-to-back time (the
    row's ``link``): the model is then given the communication of the very buckets it schedules,
    and what it is tested on is the overlap (assumptions 1-3). ``sweep_predicted_step_s`` is the
    same model with the sweep's fit instead (``sweep_link``): the difference between the two is
    what the alpha-beta constants alone cost, the rest of the error is the overlap's.

    ``link`` defaults to the fit on the caps' own buckets back to back (``link_source``
    ``"buckets"``; with fewer than two different bucket counts, alpha is the sweep's and only beta
    is fitted); ``comm_rel_error`` is its error on each cap, ``sweep_comm_rel_error`` the sweep
    fit's. ``comm_bound`` is measured: the buckets back to back took longer than the local backward.
    """
    n = result["world_size"]
    sweep = result["sweep"]
    sweep_link = fit_ring([r["bytes"] for r in sweep], [r["time_s"] for r in sweep], n)
    sweep_err = [_rel(ring_all_reduce_s(r["bytes"], n, sweep_link), r["time_s"]) for r in sweep]
    caps = [r for r in result["rows"] if r["bucket_bytes"] and r["comm_alone_s"] > 0]
    source = "given"
    if link is None:
        lists, totals = [r["bucket_bytes"] for r in caps], [r["comm_alone_s"] for r in caps]
        if len({len(b) for b in lists}) >= 2:
            link, source = fit_ring_totals(lists, totals, n), "buckets"
        elif caps:
            link, source = fit_ring_totals(lists, totals, n, alpha_s=sweep_link.alpha_s), "buckets, sweep's alpha"
        else:
            link, source = sweep_link, "sweep"
    local = next(r for r in result["rows"] if r["name"] == "local")
    compute = local["compute_s"]
    bw_frac = local["backward_s"] / compute if compute > 0 else 2 / 3
    out = []
    for row in result["rows"]:
        if not row["bucket_bytes"]:
            continue
        fitted = sum(ring_all_reduce_s(b, n, link) for b in row["bucket_bytes"])
        scale = row["comm_alone_s"] / fitted if fitted > 0 and row["comm_alone_s"] > 0 else 1.0
        row_link = LinkCost(link.alpha_s * scale, link.beta_s_per_byte * scale, link.gamma_s_per_byte * scale)

        def predict(with_link: LinkCost, buckets: list[int] = row["bucket_bytes"]) -> Any:
            return predict_step(buckets, n, with_link, compute, backward_fraction=bw_frac,
                                optimizer_s=local["optimizer_s"])

        p, p_sweep = predict(row_link), predict(sweep_link)
        out.append({"name": row["name"], "num_buckets": len(row["bucket_bytes"]),
                    "bucket_bytes": row["bucket_bytes"], "link": row_link, "last_bucket_s": p.per_bucket_s[-1],
                    "predicted_step_s": p.step_s, "measured_step_s": row["step_s"],
                    "step_rel_error": _rel(p.step_s, row["step_s"]),
                    "sweep_predicted_step_s": p_sweep.step_s,
                    "sweep_step_rel_error": _rel(p_sweep.step_s, row["step_s"]),
                    "predicted_exposed_s": p.exposed_s, "measured_exposed_s": row["exposed_s"],
                    "predicted_comm_s": p.comm_s, "measured_comm_alone_s": row["comm_alone_s"],
                    "fit_comm_s": fitted, "comm_rel_error": _rel(fitted, row["comm_alone_s"]),
                    "sweep_comm_s": p_sweep.comm_s, "sweep_comm_rel_error": _rel(p_sweep.comm_s, row["comm_alone_s"]),
                    "measured_compute_s": row["compute_s"], "model_compute_s": compute,
                    "measured_backward_s": row["backward_s"], "model_backward_s": local["backward_s"],
                    "only_last_exposed_backward_s": p.only_last_exposed_backward_s,
                    "comm_bound": row["comm_alone_s"] > local["backward_s"], "model_comm_bound": p.comm_bound})
    return {"world_size": n, "link": link, "link_source": source, "sweep_link": sweep_link,
            "backward_fraction": bw_frac, "local": local,
            "optimizer_s": local["optimizer_s"], "sweep_rel_error": sweep_err, "rows": out,
            "median_abs_step_error": _median([abs(r["step_rel_error"]) for r in out]),
            "median_abs_sweep_step_error": _median([abs(r["sweep_step_rel_error"]) for r in out])}


def _median(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs) if xs else float("nan")


def run(model: dict[str, Any] | None = None, bucket_caps_mb: tuple[float, ...] = (0.25, 1.0, 4.0), nproc: int = 2,
        *, steps: int = 5, warmup: int = 1, comm_repeats: int = 5, timeout: float = 300.0,
        device: str = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """Launch :func:`worker` on ``nproc`` processes and return ``(measured, compare(measured))``.

    ``model`` defaults to :data:`lslm.bench.ddp.BENCH_MODEL` (14 MiB of fp32 gradients).
    """
    from lslm.bench.ddp import BENCH_MODEL
    from lslm.bench.devices import device_env
    from lslm.data_parallel.ddp import cap_bytes
    from lslm.launcher.launch import launch

    for mb in bucket_caps_mb:
        cap_bytes(mb)  # ValueError before any process starts
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise ValueError(f"nproc must be an int >= 2 (data parallelism needs peers), got {nproc!r}")
    if not bucket_caps_mb:
        raise ValueError("give at least one bucket cap (MiB)")
    if steps < 1 or warmup < 0 or comm_repeats < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0, comm_repeats >= 1; got {steps}, {warmup}, {comm_repeats}")
    res = launch("lslm.bench.step_time_check:worker", nproc=nproc, timeout=timeout, output="none",
                 model=dict(model or BENCH_MODEL), bucket_caps_mb=list(bucket_caps_mb), steps=steps, warmup=warmup,
                 comm_repeats=comm_repeats, env=device_env(device, nproc))
    return res[0], compare(res[0])



def plot(measured: dict[str, Any], compared: dict[str, Any], n_max: int = 256) -> Any:
    """Three panels: step time model vs measurement per bucket cap; exposed and back-to-back communication,
    model vs measurement; the model extrapolated over world size (the largest cap), where it turns
    communication-bound. Every series has its own colour. Returns the figure."""
    import matplotlib.pyplot as plt

    from lslm.metrics.step_time import critical_world_size, exposed_comm_s

    rows, link, n = compared["rows"], compared["link"], compared["world_size"]
    colours = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    ms = 1e3
    labels = [f"{r['name'].split()[-1]} MiB\n{r['num_buckets']} buckets" for r in rows]
    x = range(len(rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.8), dpi=80)
    w = 0.38
    a.bar([i - w / 2 for i in x], [r["predicted_step_s"] * ms for r in rows], w, label="model", color=next(colours))
    a.bar([i + w / 2 for i in x], [r["measured_step_s"] * ms for r in rows], w, label="measured", color=next(colours))
    no_comm = (compared["local"]["compute_s"] + compared["optimizer_s"]) * ms
    a.axhline(no_comm, color="black", ls="--", lw=1, label="no communication (local, measured)")
    a.set(xticks=list(x), xticklabels=labels, ylabel="step time (ms)", xlabel="bucket cap",
          title=f"bucketed DDP step, {n} processes ({measured['backend']})")
    a.margins(y=0.3)  # headroom: the legend sits above the bars
    a.legend(fontsize=9, loc="upper left")
    w = 0.16
    series = [("predicted_exposed_s", "exposed: model"), ("measured_exposed_s", "exposed: measured"),
              ("fit_comm_s", "all buckets back to back: alpha-beta fit on every cap's buckets"),
              ("sweep_comm_s", "all buckets back to back: alpha-beta fit on the sweep"),
              ("measured_comm_alone_s", "all buckets back to back: measured")]
    for k, (key, label) in enumerate(series):
        b.bar([i + (k - 2) * w for i in x], [r[key] * ms for r in rows], w, label=label, color=next(colours))
    b.set(xticks=list(x), xticklabels=labels, ylabel="communication time (ms)", xlabel="bucket cap",
          title="communication per step: exposed vs back to back")
    b.margins(y=0.45)
    b.legend(fontsize=8, loc="upper right")
    big = max(rows, key=lambda r: r["bucket_bytes"][0])
    backward = compared["local"]["backward_s"]
    ns = list(range(2, n_max + 1))
    back_to_back = [sum(ring_all_reduce_s(s, k, link) for s in big["bucket_bytes"]) * ms for k in ns]
    c.plot(ns, back_to_back, label="all buckets back to back (model)", color=next(colours))
    c.plot(ns, [exposed_comm_s(big["bucket_bytes"], k, link, backward) * ms for k in ns],
           label="exposed (model)", color=next(colours))
    c.axhline(backward * ms, color=next(colours), ls=":", label="backward (local, measured)")
    crit = critical_world_size(big["bucket_bytes"], link, backward, n_max)
    if crit is not None:
        c.axvline(crit, color="black", ls="--",
                  label=f"communication-bound from n = {crit} (back to back > backward)")
    c.set(xscale="log", yscale="log", xlabel="world size n (processes)", ylabel="time per step (ms)",
          title=f"model extrapolated over n ({big['name'].split()[-1]} MiB buckets, this machine's fit)")
    c.set_ylim(top=max(back_to_back[-1], backward * ms) * 30)  # log axis: headroom for the legend
    c.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    return fig
