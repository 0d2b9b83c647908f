"""``lslm bench pipeline``: lslm's pipeline schedules next to ``torch.distributed.pipelining``'s, same GPT, same data.

One job per pipeline size ``p`` (= world size). For each number of micro-batches ``m``,
every rank builds from one seed, for each schedule pair, the lslm pipeline
(:func:`~lslm.pipeline.apply.apply_pipeline`) and torch's
(:class:`~lslm.pipeline.torch_reference.TorchPipeline`) over the *same* stages (the same
``"layers"`` cut of the same GPT):

==================  =================  ==================================  ========
pair                lslm schedule      torch class                         v
==================  =================  ==================================  ========
GPipe               ``gpipe``          ``ScheduleGPipe``                   1
1F1B                ``1f1b``           ``Schedule1F1B``                    1
Interleaved1F1B     ``interleaved``    ``ScheduleInterleaved1F1B``         2
ZB-H1               ``zb-h1``          ``ScheduleInterleavedZeroBubble``   1
DualPipeV           ``dualpipev``      ``ScheduleDualPipeV``               2
==================  =================  ==================================  ========

The bench runner (:func:`lslm.harness.run_variants`) runs the ten round-robin on the same
batches, a barrier before each step, a step costing its slowest rank's time, medians
after warm-up rounds. A step is ``zero_grad`` + the pipelined forward and backward of the
whole batch (the optimizer, the same on both sides, is left out). A pair whose ``(p, m)``
either side refuses (DualPipeV needs ``m >= 2p``, interleaved ``m`` a multiple of ``p``) is
listed as skipped.

From lslm's runs also, per schedule: the **measured bubble fraction** (median over
``timeline_steps`` extra steps recorded with ``PipelinePlan.record_timeline``; definition in
:mod:`lslm.pipeline.timeline`), and the **simulated** one of the same ``(p, m, v)``
(:func:`~lslm.pipeline.simulator.simulate`) with unit costs ``F=1, B=2, I=W=1`` and with the
median measured ``F``/``B``/``I``/``W`` durations; one measured timeline is kept in the
JSON for Gantt charts. The last line printed is the lslm / torch step-time ratio per pair.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import torch

from lslm.bench.checks import at_least, world_sizes
from lslm.bench.devices import device_env
from lslm.harness import Report, StepTimer, Variant, run_variants

__all__ = ["BENCH_BATCH", "BENCH_MODEL", "PAIRS", "QUICK_MODEL", "plot", "print_table", "ratio_line", "run",
           "valid_pairs", "worker"]

#: 8 blocks of width 128 (interleaved and DualPipeV at p = 4 need 8 stages), 1.9 M parameters; a batch of
#: 16 x 64 tokens: ~0.2 s of forward + backward for the whole model on one CPU core.
BENCH_MODEL = dict(vocab_size=1024, block_size=64, n_layer=8, n_head=4, n_embd=128)
BENCH_BATCH = 16
QUICK_MODEL = dict(vocab_size=128, block_size=16, n_layer=4, n_head=2, n_embd=32)
QUICK_BATCH = 8

#: (name in the report, lslm schedule, torch schedule, stages per rank)
PAIRS: tuple[tuple[str, str, str, int], ...] = (
    ("GPipe", "gpipe", "GPipe", 1),
    ("1F1B", "1f1b", "1F1B", 1),
    ("Interleaved1F1B", "interleaved", "Interleaved1F1B", 2),
    ("ZB-H1", "zb-h1", "InterleavedZeroBubble", 1),
    ("DualPipeV", "dualpipev", "DualPipeV", 2),
)


def valid_pairs(p: int, m: int, n_layer: int, batch: int) -> tuple[list[tuple[str, str, str, int]], dict[str, str]]:
    """The pairs both lslm and torch can run at ``(p, m)`` on ``n_layer`` blocks and ``batch`` rows, and why the
    others cannot (``{name: reason}``)."""
    from lslm.pipeline.schedules import check_schedule_config
    from lslm.pipeline.torch_reference import check_torch_config

    ok, skipped = [], {}
    for pair in PAIRS:
        name, ours, theirs, v = pair
        try:
            if batch % m:
                raise ValueError(f"a batch of {batch} rows does not split into {m} micro-batches")
            check_schedule_config(ours, p, m, v, num_layers=n_layer)
            check_torch_config(theirs, p, m, v, n_layer=n_layer, batch_size=batch)
        except ValueError as exc:
            skipped[name] = str(exc)
            continue
        ok.append(pair)
    return ok, skipped


def _median_costs(timeline: Any) -> dict[str, float]:
    """Median measured duration of each compute kind (seconds) over all ranks of ``timeline``."""
    by_kind: dict[str, list[float]] = {}
    for e in timeline.compute():
        by_kind.setdefault(e.kind, []).append(e.duration)
    return {k: statistics.median(v) for k, v in by_kind.items()}


def _bubbles(pipe: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, Any]:
    """Measured (median of ``steps`` recorded steps) and simulated bubble fractions of an lslm pipeline."""
    from lslm.pipeline.simulator import simulate

    pipe.plan.record_timeline = True
    recorded = []
    for _ in range(steps):
        for p in pipe.parameters():
            p.grad = None
        pipe.step(x, y)
        recorded.append(pipe.gather_timeline())
    pipe.plan.record_timeline = False
    recorded.sort(key=lambda t: t.bubble_fraction())
    middle = recorded[len(recorded) // 2]
    costs = _median_costs(middle)
    sim_unit = simulate(pipe.schedule)
    sim_meas = simulate(pipe.schedule, costs={k: c / costs["F"] for k, c in costs.items()})
    return {"bubble_measured": middle.bubble_fraction(),
            "bubble_measured_all": [t.bubble_fraction() for t in recorded],
            "bubble_simulated": sim_unit.timeline.bubble_fraction() if sim_unit.completed else None,
            "bubble_simulated_measured_costs": sim_meas.timeline.bubble_fraction() if sim_meas.completed else None,
            "measured_costs_ms": {k: 1e3 * c for k, c in costs.items()},
            "timeline": middle.to_dict()}


def worker(model: dict[str, Any], batch: int, microbatches: list[int], repeats: int = 7, warmup: int = 2,
           timeline_steps: int = 3, threads: int = 1, seed: int = 0, device: str | None = None) -> dict[str, Any]:
    """One rank of the benchmark at pp = world size (see the module doc); rank 0 returns the rows, the others
    ``{"rank"}``."""
    from lslm.models.gpt import GPT, GPTConfig
    from lslm.pipeline.apply import PipelinePlan, apply_pipeline
    from lslm.pipeline.torch_reference import TorchPipeline
    from lslm.runtime import init_distributed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    with init_distributed(pp=world, device=device, seed=seed) as ctx:
        torch.set_num_threads(threads)
        dev, ledger, cfg = ctx.device, ctx.comm.ledger, GPTConfig(**model)
        g = torch.Generator().manual_seed(seed)  # the same tokens on every rank and for every entry
        data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1),
                              generator=g).to(dev)  # lslm: cpu-ok (seeded, then moved)
                for _ in range(warmup + repeats)]
        rows, skipped = [], {}
        for m in microbatches:
            pairs, why = valid_pairs(ctx.pp_size, m, cfg.n_layer, batch)
            skipped[str(m)] = why
            variants: list[Variant] = []
            built: list[tuple[str, str, Any]] = []
            losses: dict[str, list[float]] = {}
            for name, ours, theirs, v in pairs:
                for kind in ("lslm", "torch"):
                    torch.manual_seed(seed)
                    net = GPT(cfg)
                    pipe: Any
                    if kind == "lslm":
                        pipe = apply_pipeline(net, ctx, PipelinePlan(schedule=ours, microbatches=m, virtual_stages=v))
                    else:
                        pipe = TorchPipeline(net, ctx, theirs, m, v)
                    key = f"{kind} {name}"
                    built.append((name, kind, pipe))
                    losses[key] = []
                    last: list[Any] = [None]

                    def run(timer: StepTimer, i: int, pipe: Any = pipe, last: list[Any] = last) -> None:
                        for prm in pipe.parameters():
                            prm.grad = None
                        last[0] = pipe.step(data[i][:, :-1], data[i][:, 1:])

                    def after(i: int, out: list[float] = losses[key], last: list[Any] = last) -> None:
                        out.append(last[0].item())

                    variants.append(Variant(key, run, after))
            if not variants:
                continue
            # Each round's ledger (lslm's p2p, the loss broadcasts) is counted per variant, then emptied.
            timings = run_variants(variants, steps=repeats, warmup=warmup, device=dev,
                                   after_round=lambda _i: ledger.reset())
            x, y = data[0][:, :-1], data[0][:, 1:]
            for name, ours, theirs, v in pairs:
                t_ours, t_theirs = timings[f"lslm {name}"], timings[f"torch {name}"]
                pipe = next(pp for n, k, pp in built if n == name and k == "lslm")
                since = len(ledger.records)
                for prm in pipe.parameters():
                    prm.grad = None
                pipe.step(x, y)
                sent = [r for r in ledger.records[since:] if r.label.startswith(("pp F ", "pp B "))]
                row = {"pair": name, "lslm_schedule": ours, "torch_schedule": theirs, "m": m, "v": v,
                       "lslm_ms": t_ours.median() * 1e3, "torch_ms": t_theirs.median() * 1e3,
                       "lslm_ms_all": [s * 1e3 for s in t_ours.total_s],
                       "torch_ms_all": [s * 1e3 for s in t_theirs.total_s],
                       "max_loss_diff": max(abs(a - b) for a, b in zip(losses[f"lslm {name}"],
                                                                        losses[f"torch {name}"])),
                       "pp_comm_bytes_rank0": sum(r.nbytes for r in sent), "pp_comm_calls_rank0": len(sent),
                       **_bubbles(pipe, x, y, timeline_steps)}
                row["ratio"] = row["lslm_ms"] / row["torch_ms"]
                rows.append(row)
                ledger.reset()
        result = {"p": ctx.pp_size, "model": model, "batch": batch, "microbatches": list(microbatches),
                  "repeats": repeats, "warmup": warmup, "threads": torch.get_num_threads(), "backend": ctx.backend,
                  "device": str(dev), "num_parameters": sum(prm.numel() for prm in GPT(cfg).parameters()),
                  "rows": rows, "skipped": skipped}
    return {"rank": ctx.rank, **(result if ctx.rank == 0 else {})}


def print_table(results: dict[int, dict[str, Any]], report: Report | None = None) -> None:
    """One table per pipeline size: step times (ms, medians), their ratio, the bubble fractions."""
    out = report.print if report is not None else print
    for p, res in results.items():
        mod = res["model"]
        out(f"\n== p={p} ({res['backend']}, {res['threads']} thread(s)/rank): GPT {res['num_parameters']:,} params "
            f"({mod['n_layer']} layers, width {mod['n_embd']}), batch {res['batch']} x {mod['block_size']} tokens, "
            f"medians of {res['repeats']} steps ==")
        out(f"{'schedule':<16} {'m':>2} {'v':>2} {'lslm ms':>8} {'torch ms':>8} {'lslm/torch':>10} "
            f"{'bubble meas':>11} {'sim 1:2':>7} {'sim meas':>8} {'meas/sim':>8} {'p2p KiB r0':>10} "
            f"{'loss diff':>9}")
        for r in res["rows"]:
            sim = r["bubble_simulated"]
            sim_m = r["bubble_simulated_measured_costs"]
            over = "-" if not sim_m else f"{r['bubble_measured'] / sim_m:.2f}x"
            out(f"{r['pair']:<16} {r['m']:>2} {r['v']:>2} {r['lslm_ms']:>8.1f} {r['torch_ms']:>8.1f} "
                f"{r['ratio']:>9.2f}x {r['bubble_measured']:>11.1%} "
                f"{'-' if sim is None else f'{sim:.1%}':>7} {'-' if sim_m is None else f'{sim_m:.1%}':>8} {over:>8} "
                f"{r['pp_comm_bytes_rank0'] / 1024:>10.0f} {r['max_loss_diff']:>9.1e}")
        for m, why in res["skipped"].items():
            for name, reason in why.items():
                out(f"  skipped {name} at m={m}: {reason}")
    out("(times: ms, slowest rank; bubble meas: lslm's measured timeline, 1 - busy / (p x span); sim 1:2 / sim meas: "
        "simulated with F=1, B=2, I=W=1 (= the closed forms) / with the measured F, B, I, W times; meas/sim: measured "
        "over sim meas, what messages and per-action overheads add; p2p: rank 0's activations and gradients per step)")


def _ratio_entry(res: dict[str, Any], pair: str) -> str | None:
    """``"p=2 m=8 0.97x"`` at the largest m this pair ran at, or None."""
    rows = [r for r in res["rows"] if r["pair"] == pair]
    if not rows:
        return None
    r = max(rows, key=lambda r: r["m"])
    return f"p={res['p']} m={r['m']} {r['ratio']:.2f}x"


def ratio_line(results: dict[int, dict[str, Any]]) -> str:
    """``lslm / torch pipelining step time: GPipe p=2 m=8 0.97x p=4 m=8 1.01x; 1F1B ...`` (largest m of each)."""
    parts = []
    for name, *_ in PAIRS:
        entries = [e for e in (_ratio_entry(res, name) for _, res in sorted(results.items())) if e is not None]
        parts.append(f"{name} " + (" ".join(entries) if entries else "n/a"))
    return "lslm / torch pipelining step time: " + "; ".join(parts)


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Left: step times, lslm next to torch, per schedule, p and m. Right: bubble fraction measured vs simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(14, 4.8), dpi=80)
    labels, ours, theirs, meas, sim = [], [], [], [], []
    for p, res in sorted(results.items()):
        for r in res["rows"]:
            labels.append(f"{r['pair']}\np={p} m={r['m']}")
            ours.append(r["lslm_ms"])
            theirs.append(r["torch_ms"])
            meas.append(r["bubble_measured"])
            sim.append(r["bubble_simulated_measured_costs"] or 0.0)
    xs = range(len(labels))
    ax_t.bar([i - 0.2 for i in xs], ours, width=0.4, label="lslm")
    ax_t.bar([i + 0.2 for i in xs], theirs, width=0.4, label="torch.distributed.pipelining")
    ax_t.set_ylabel("ms per step (median, slowest rank)")
    ax_t.set_title("Step time")
    ax_b.bar([i - 0.2 for i in xs], meas, width=0.4, label="lslm, measured")
    ax_b.bar([i + 0.2 for i in xs], sim, width=0.4, label="simulated (measured F/B/I/W costs)")
    ax_b.set_ylabel("bubble fraction")
    ax_b.set_title("Bubble: 1 - compute / (ranks x span)")
    for ax in (ax_t, ax_b):
        ax.set_xticks(list(xs), labels, fontsize=6, rotation=90)
        ax.legend(fontsize=8)
    fig.suptitle("Pipeline parallelism: lslm's executor vs torch.distributed.pipelining, same GPT stages and data")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(nprocs: tuple[int, ...] = (2, 4), microbatches: tuple[int, ...] = (4, 8), *, quick: bool = False,
        model: dict[str, Any] | None = None, batch: int | None = None, repeats: int | None = None,
        warmup: int | None = None, timeline_steps: int | None = None, threads: int = 1,
        out_dir: str | Path | None = "bench/results", timeout: float = 1200.0,
        device: str = "cpu") -> dict[int, dict[str, Any]]:
    """Launch the benchmark at each pipeline size (= world size) on ``device``; print the table and write
    ``pipeline.txt``, ``pipeline.json`` and ``pipeline.png`` to ``out_dir`` (``None``: print only).

    ``quick=True``: a tiny model, 1 timed round, for tests (structure and counts are
    meaningful, timings are not). ``model`` overrides the GPT sizes. Raises ``ValueError``
    before any launch for sizes no pair can run.
    """
    from lslm.launcher.launch import launch

    nprocs = world_sizes(nprocs, 2, "a pipeline needs at least two stages")
    ms = tuple(microbatches)
    if not ms or len(set(ms)) != len(ms):
        raise ValueError(f"microbatches must be distinct numbers, at least one, got {ms}")
    for m in ms:
        at_least("microbatches", m, 1)
    repeats = at_least("repeats", repeats, 1) if repeats is not None else (1 if quick else 7)
    warmup = at_least("warmup", warmup, 0) if warmup is not None else (1 if quick else 2)
    timeline_steps = at_least("timeline_steps", timeline_steps, 1) if timeline_steps is not None else (
        1 if quick else 3)
    at_least("threads", threads, 1)
    model = dict(model or (QUICK_MODEL if quick else BENCH_MODEL))
    batch = at_least("batch", batch, 1) if batch is not None else (QUICK_BATCH if quick else BENCH_BATCH)
    for p in nprocs:
        if not any(valid_pairs(p, m, model["n_layer"], batch)[0] for m in ms):
            raise ValueError(f"no schedule pair runs at p={p} with microbatches {ms}, {model['n_layer']} layers and "
                             f"a batch of {batch}: " + "; ".join(valid_pairs(p, ms[0], model["n_layer"],
                                                                             batch)[1].values()))
    env = device_env(device, max(nprocs))
    results: dict[int, dict[str, Any]] = {}
    for p in nprocs:
        res = launch("lslm.bench.pipeline:worker", nproc=p, timeout=timeout, output="none", model=model, batch=batch,
                     microbatches=list(ms), repeats=repeats, warmup=warmup, timeline_steps=timeline_steps,
                     threads=threads, env=env)
        results[p] = res[0]
    with Report("pipeline", out_dir) as report:
        print_table(results, report)
        report.write(results, plot)
        report.print(ratio_line(results))
    return results
