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

From lslm's runs also, per schedule: the **measured bubble fraction** (median over the
recorded steps; definition in :mod:`lslm.pipeline.timeline`), and the **simulated** one of the
same ``(p, m, v)`` (:func:`~lslm.pipeline.simulator.simulate`) with unit costs ``F=1, B=2,
I=W=1`` and with the median measured ``F``/``B``/``I``/``W`` durations; one measured timeline
is kept in the JSON for Gantt charts. The **recorded steps** are a twin variant in the same
rotation (``"lslm NAME recorded"``: the same pipeline with ``PipelinePlan.record_timeline``),
so they run where the timed steps run, after another variant's step with its caches as cold;
steps recorded back to back afterwards were measured faster than the steps they were meant to
explain (they run warm).

**Time model** (``model ms`` beside the measured ``lslm ms``): the simulator plays the schedule
with each virtual stage's mean measured ``F``, ``B``, ``I``, ``W`` (seconds, pooled over the
recorded steps; the first and last stages carry the embedding and the head, so stages differ)
and the executor's own time after each action (:func:`compute_overhead_s`, measured: the median gap from
an action's end to what its rank starts next), and every point-to-point message costing
``alpha + S beta``, ``S`` the bytes of one micro-batch's activation (or its gradient: the same
size) and alpha, beta the fit of ``lslm
bench collectives`` at the same world size (``bench/results/collectives.json``,
:func:`lslm.metrics.collective_costs.fit_alpha_beta`), plus one such message for the loss
broadcast; sends are simulated eager (a send does not wait for its receive to be posted). To
the simulated makespan it adds ``outside``: the recorded steps' median time outside the
schedule's span (step time minus the timeline's makespan: the micro-batch copies, the tied
embedding's gradient sum, the loss broadcast, the final waits), measured, not modelled.
``model*``: the same with every message priced at ``msg ms``, the mean time a message took
inside the recorded steps (:func:`in_step_messages_s`: from both ends posted to received).
On this 2-core machine the two prices differ several-fold: the fit comes from ranks that only
communicate, while inside a step gloo's transport threads wait for a core that the other
rank's compute holds. The last line printed is the lslm / torch step-time ratio per pair,
then both models' worst ``|predicted - measured| / measured`` at ``p = 2``. Medians of 15 steps by default: at 7,
one run's medians of two variants of the very same pipeline (timed and recorded twin) were measured 14 % apart
(DualPipeV, ``p = 2``, ``m = 8``), which set the model's worst error in that run.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from lslm.bench.checks import at_least, world_sizes
from lslm.bench.devices import device_env
from lslm.bench.pipeline_report import PAIR_NAMES, model_line, plot, print_table, ratio_line  # noqa: F401 (re-exported)
from lslm.harness import Report, StepTimer, Variant, run_variants, step_throughput
from lslm.metrics.flops import gpt_step_flops

__all__ = ["BENCH_BATCH", "BENCH_MODEL", "PAIRS", "QUICK_MODEL", "compute_overhead_s", "in_step_messages_s",
           "measured_message_s", "model_line", "p2p_seconds",
           "plot",
           "predict_step_s", "print_table", "ratio_line", "run", "valid_pairs", "worker"]

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


def _stage_costs(timelines: list[Any]) -> dict[int, dict[str, float]]:
    """Mean measured duration (seconds) of each compute kind on each virtual stage, pooled over ``timelines``.

    The mean, not the median: a step is a sum of many actions, and a sum's typical value is the sum of the
    means (an action slowed now and then by the other rank or another process counts in the step too).
    """
    by: dict[int, dict[str, list[float]]] = {}
    for t in timelines:
        for e in t.compute():
            by.setdefault(e.stage, {}).setdefault(e.kind, []).append(e.duration)
    return {s: {k: statistics.fmean(v) for k, v in kinds.items()} for s, kinds in by.items()}


def measured_message_s(timeline: Any) -> float | None:
    """Median time a message took inside a step (seconds), or None: from the later of its send's and its
    receive's issue (both posted: a receive issued late is waiting for the receiver, not for the message) to the
    receive's completion, over ``timeline``'s messages.

    A diagnostic beside the fitted alpha-beta price: what a message costs while both ranks compute (on a CPU,
    gloo's threads then compete with the computing ones for the cores).
    """
    took = _message_times(timeline)
    return statistics.median(took) if took else None


def p2p_seconds(fit: dict[str, float] | None, nbytes: int) -> float:
    """One point-to-point message of ``nbytes`` under an alpha-beta ``fit`` (``alpha + S beta``); 0 without one."""
    if fit is None:
        return 0.0
    return float(fit["alpha_s"]) + nbytes * float(fit["beta_s_per_byte"])


def predict_step_s(schedule: Any, stage_costs: dict[int, dict[str, float]], message_s: float,
                   sends: str = "eager", compute_overhead_s: float = 0.0) -> float:
    """The time model's span (seconds): the simulated makespan of ``schedule`` with each stage's measured costs,
    every p2p message ``message_s`` (``sends``: the simulator's send mode, eager by default, module doc), the
    executor's ``compute_overhead_s`` after each action, and one more message for the loss broadcast."""
    from lslm.pipeline.simulator import simulate

    pooled: dict[str, list[float]] = {}
    for kinds in stage_costs.values():
        for k, c in kinds.items():
            pooled.setdefault(k, []).append(c)
    costs = {k: statistics.fmean(v) for k, v in pooled.items()}
    sim = simulate(schedule, costs=costs, comm=message_s, sends=sends, stage_costs=stage_costs,
                   compute_overhead=compute_overhead_s)
    if not sim.completed:
        raise RuntimeError(f"the time model cannot play {schedule.name}: {sim.problem}")
    ends = [e.end for e in sim.timeline.events]
    return max(ends) - min(e.start for e in sim.timeline.events) + message_s


def compute_overhead_s(timelines: list[Any]) -> float:
    """Median time (seconds) from a compute action's end to the next thing its rank starts (posting a batch or
    the next action), over ``timelines``: the executor's own time per action, 0 with no such pair."""
    gaps: list[float] = []
    for t in timelines:
        for r in range(t.num_ranks):
            mine = sorted((e for e in t.events if e.rank == r), key=lambda e: e.start)
            gaps += [max(0.0, b.start - a.end) for a, b in zip(mine, mine[1:]) if a.is_compute]
    return statistics.median(gaps) if gaps else 0.0


def in_step_messages_s(timelines: list[Any]) -> list[float]:
    """Every message's in-step time (seconds, :func:`measured_message_s`'s definition) over ``timelines``."""
    out: list[float] = []
    for t in timelines:
        out += _message_times(t)
    return out


def _message_times(timeline: Any) -> list[float]:
    key = {"SEND_F": lambda e: ("act", e.stage, e.mb), "RECV_F": lambda e: ("act", e.stage - 1, e.mb),
           "SEND_B": lambda e: ("grad", e.stage, e.mb), "RECV_B": lambda e: ("grad", e.stage + 1, e.mb)}
    sent = {key[e.kind](e): e.start for e in timeline.events if e.kind in ("SEND_F", "SEND_B")}
    # Clamped at 0: the ranks' clocks are aligned by a barrier only, to within a fraction of a millisecond.
    return [max(0.0, e.end - max(e.start, sent[key[e.kind](e)])) for e in timeline.events
            if e.kind in ("RECV_F", "RECV_B") and key[e.kind](e) in sent]


def _bubbles(pipe: Any, recorded: list[Any], step_s: list[float], message: int,
             fit: dict[str, float] | None = None) -> dict[str, Any]:
    """Measured bubble fractions of the ``recorded`` steps (timelines; ``step_s`` their step times), the simulated
    ones, and the time model's step (module doc)."""
    from lslm.pipeline.simulator import simulate

    by_bubble = sorted(recorded, key=lambda t: t.bubble_fraction())
    middle = by_bubble[len(by_bubble) // 2]
    costs = _median_costs(middle)
    sim_unit = simulate(pipe.schedule)
    sim_meas = simulate(pipe.schedule, costs={k: c / costs["F"] for k, c in costs.items()})
    per_stage = _stage_costs(recorded)
    # A difference of two clocks (the step's and the timeline's, whose ranks are aligned by a barrier only): clamped
    # at 0, so a sub-millisecond misalignment never prints a negative duration.
    outside = max(0.0, statistics.median(s - t.makespan() for s, t in zip(step_s, recorded)))
    message_s = p2p_seconds(fit, message)
    took = in_step_messages_s(recorded)
    in_step = statistics.fmean(took) if took else None
    gap = compute_overhead_s(recorded)
    span_ab = predict_step_s(pipe.schedule, per_stage, message_s, compute_overhead_s=gap)
    span_in = None if in_step is None else predict_step_s(pipe.schedule, per_stage, in_step, compute_overhead_s=gap)
    return {"model_ms": 1e3 * (span_ab + outside),
            "model_in_step_ms": None if span_in is None else 1e3 * (span_in + outside),
            "model_span_ms": 1e3 * span_ab, "model_span_in_step_ms": None if span_in is None else 1e3 * span_in,
            "outside_ms": 1e3 * outside, "compute_overhead_ms": 1e3 * gap,
            "span_ms": statistics.median(1e3 * t.makespan() for t in recorded),
            "recorded_step_ms": statistics.median(1e3 * s for s in step_s),
            "message_in_step_ms": None if in_step is None else 1e3 * in_step,
            "message_in_step_median_ms": statistics.median(took) * 1e3 if took else None,
            "model_message_ms": 1e3 * message_s, "message_bytes": message,
            "stage_costs_ms": {str(s): {k: 1e3 * c for k, c in kinds.items()} for s, kinds in per_stage.items()},
            "bubble_measured": middle.bubble_fraction(),
            "bubble_measured_all": [t.bubble_fraction() for t in recorded],
            "bubble_simulated": sim_unit.timeline.bubble_fraction() if sim_unit.completed else None,
            "bubble_simulated_measured_costs": sim_meas.timeline.bubble_fraction() if sim_meas.completed else None,
            "measured_costs_ms": {k: 1e3 * c for k, c in costs.items()},
            "timeline": middle.to_dict()}


def worker(model: dict[str, Any], batch: int, microbatches: list[int], repeats: int = 15, warmup: int = 2,
           threads: int = 1, seed: int = 0, device: str | None = None,
           p2p_fit: dict[str, float] | None = None) -> dict[str, Any]:
    """One rank of the benchmark at pp = world size (see the module doc); rank 0 returns the rows, the others
    ``{"rank"}``. ``p2p_fit``: the alpha-beta fit the time model prices messages with (None: free messages)."""
    from lslm.models.gpt import GPT, GPTConfig
    from lslm.pipeline.apply import PipelinePlan, apply_pipeline
    from lslm.pipeline.p2p import is_p2p_label
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
            recorded: dict[str, list[Any]] = {}
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

                    def run(timer: StepTimer, i: int, pipe: Any = pipe, last: list[Any] = last,
                            ours: bool = kind == "lslm") -> None:
                        if ours:
                            pipe.plan.record_timeline = False  # the recorded twin's warm-up rounds leave it set
                        for prm in pipe.parameters():
                            prm.grad = None
                        last[0] = pipe.step(data[i][:, :-1], data[i][:, 1:])

                    def after(i: int, out: list[float] = losses[key], last: list[Any] = last) -> None:
                        out.append(last[0].item())

                    variants.append(Variant(key, run, after))
                    if kind == "lslm":
                        # The same pipeline again, its timeline recorded, in the same rotation: its steps run
                        # where the timed ones run (after another variant's step, caches as cold), so the time
                        # model's inputs come from steps like the ones it predicts.
                        recorded[name] = []

                        def run_recorded(timer: StepTimer, i: int, pipe: Any = pipe) -> None:
                            pipe.plan.record_timeline = True
                            for prm in pipe.parameters():
                                prm.grad = None
                            pipe.step(data[i][:, :-1], data[i][:, 1:])

                        def gather(i: int, pipe: Any = pipe, out: list[Any] = recorded[name]) -> None:
                            out.append(pipe.gather_timeline())  # collective: outside the timed step
                            pipe.plan.record_timeline = False

                        variants.append(Variant(f"lslm {name} recorded", run_recorded, gather))
            if not variants:
                continue
            # Each round's ledger (lslm's p2p, the loss broadcasts) is counted per variant, then emptied.
            timings = run_variants(variants, steps=repeats, warmup=warmup, device=dev,
                                   after_round=lambda _i: ledger.reset())
            x, y = data[0][:, :-1], data[0][:, 1:]
            flops = gpt_step_flops(cfg, batch)  # forward and backward of the whole batch (no optimizer step)
            for name, ours, theirs, v in pairs:
                t_ours, t_theirs = timings[f"lslm {name}"], timings[f"torch {name}"]
                pipe = next(pp for n, k, pp in built if n == name and k == "lslm")
                since = len(ledger.records)
                for prm in pipe.parameters():
                    prm.grad = None
                pipe.step(x, y)
                sent = [r for r in ledger.records[since:] if is_p2p_label(r.label)]
                first = next(iter(pipe.stages.values()))
                # One micro-batch's hidden states (rows x time x width), the size of every activation and gradient.
                message = (x.shape[0] // m * x.shape[1] * first.config.n_embd
                           * torch.finfo(next(first.parameters()).dtype).bits // 8)
                row = {"pair": name, "lslm_schedule": ours, "torch_schedule": theirs, "m": m, "v": v,
                       "lslm_ms": t_ours.median() * 1e3, "torch_ms": t_theirs.median() * 1e3,
                       "lslm_ms_all": [s * 1e3 for s in t_ours.total_s],
                       "torch_ms_all": [s * 1e3 for s in t_theirs.total_s],
                       "max_loss_diff": max(abs(a - b) for a, b in zip(losses[f"lslm {name}"],
                                                                        losses[f"torch {name}"])),
                       "pp_comm_bytes_rank0": sum(r.nbytes for r in sent), "pp_comm_calls_rank0": len(sent),
                       **_bubbles(pipe, recorded[name], timings[f"lslm {name} recorded"].total_s, message,
                                  p2p_fit)}
                row["throughput"] = step_throughput(flops, t_ours.median(), dev, ctx.pp_size).to_dict()
                row["ratio"] = row["lslm_ms"] / row["torch_ms"]
                row["model_error"] = (row["model_ms"] - row["lslm_ms"]) / row["lslm_ms"]
                row["model_in_step_error"] = (None if row["model_in_step_ms"] is None
                                              else (row["model_in_step_ms"] - row["lslm_ms"]) / row["lslm_ms"])
                rows.append(row)
                ledger.reset()
        result = {"p": ctx.pp_size, "model": model, "batch": batch, "microbatches": list(microbatches),
                  "repeats": repeats, "warmup": warmup, "threads": torch.get_num_threads(), "backend": ctx.backend,
                  "device": str(dev), "num_parameters": sum(prm.numel() for prm in GPT(cfg).parameters()),
                  "rows": rows, "skipped": skipped, "p2p_fit": p2p_fit}
    return {"rank": ctx.rank, **(result if ctx.rank == 0 else {})}


def run(nprocs: tuple[int, ...] = (2, 4), microbatches: tuple[int, ...] = (4, 8), *, quick: bool = False,
        model: dict[str, Any] | None = None, batch: int | None = None, repeats: int | None = None,
        warmup: int | None = None, threads: int = 1,
        out_dir: str | Path | None = "bench/results", timeout: float = 1200.0,
        device: str = "cpu", collectives: str | Path | None = "bench/results/collectives.json",
        ) -> dict[int, dict[str, Any]]:
    """Launch the benchmark at each pipeline size (= world size) on ``device``; print the table and write
    ``pipeline.txt``, ``pipeline.json`` and ``pipeline.png`` to ``out_dir`` (``None``: print only).

    ``quick=True``: a tiny model, 1 timed round, for tests (structure and counts are
    meaningful, timings are not). ``model`` overrides the GPT sizes. ``collectives``: the JSON of
    ``lslm bench collectives`` whose alpha-beta fit at each world size prices the time model's
    messages (a missing file or world size: free messages, said in the table). Raises ``ValueError``
    before any launch for sizes no pair can run.
    """
    from lslm.launcher.launch import launch

    nprocs = world_sizes(nprocs, 2, "a pipeline needs at least two stages")
    ms = tuple(microbatches)
    if not ms or len(set(ms)) != len(ms):
        raise ValueError(f"microbatches must be distinct numbers, at least one, got {ms}")
    for m in ms:
        at_least("microbatches", m, 1)
    repeats = at_least("repeats", repeats, 1) if repeats is not None else (1 if quick else 15)
    warmup = at_least("warmup", warmup, 0) if warmup is not None else (1 if quick else 2)
    at_least("threads", threads, 1)
    model = dict(model or (QUICK_MODEL if quick else BENCH_MODEL))
    batch = at_least("batch", batch, 1) if batch is not None else (QUICK_BATCH if quick else BENCH_BATCH)
    for p in nprocs:
        if not any(valid_pairs(p, m, model["n_layer"], batch)[0] for m in ms):
            raise ValueError(f"no schedule pair runs at p={p} with microbatches {ms}, {model['n_layer']} layers and "
                             f"a batch of {batch}: " + "; ".join(valid_pairs(p, ms[0], model["n_layer"],
                                                                             batch)[1].values()))
    env = device_env(device, max(nprocs))
    fits: dict[str, Any] = {}
    if collectives is not None and Path(collectives).is_file():
        fits = {n: res.get("fit") for n, res in json.loads(Path(collectives).read_text()).items()}
    results: dict[int, dict[str, Any]] = {}
    for p in nprocs:
        res = launch("lslm.bench.pipeline:worker", nproc=p, timeout=timeout, output="none", model=model, batch=batch,
                     microbatches=list(ms), repeats=repeats, warmup=warmup,
                     threads=threads, env=env, p2p_fit=fits.get(str(p)))
        results[p] = res[0]
    with Report("pipeline", out_dir) as report:
        print_table(results, report)
        report.write(results, plot)
        report.print(f"{ratio_line(results)} | {model_line(results)}")
    return results
