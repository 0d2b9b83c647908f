"""Small experiments notebook 06 runs: the partition's imbalance, schedules measured on real ranks, memory, remat.

:func:`partition_report` runs in one process. :func:`schedules_worker` is a launch target
(``lslm.launch("lslm.demos.pipeline_demo:schedules_worker", nproc=p, runs=[...])``): every
rank builds the same GPT from one seed, pipelines it with each requested plan in turn, runs
a few steps, and returns what the notebook prints and plots: the loss and gradients against
the serial model on the same batch, the last step's timeline (every rank's, gathered) and
the activation-memory counts.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from lslm.metrics.memory_timeline import record_memory_timeline
from lslm.metrics.trace import StepTracer
from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.apply import PipelinePlan, apply_pipeline
from lslm.pipeline.executor import ACTION_PREFIX
from lslm.pipeline.partition import partition_units, split_gpt, unit_costs, unit_names
from lslm.runtime import init_distributed

__all__ = ["DEMO_MODEL", "memory_timeline_step", "partition_report", "schedules_worker", "tied_worker",
           "torch_side_by_side_worker", "traced_step", "two_bw_worker"]

#: The notebook's GPT: deep enough for 2 x 4 virtual stages, wide enough that compute dominates per-action overhead.
DEMO_MODEL: dict[str, int] = dict(vocab_size=1024, block_size=64, n_layer=8, n_head=4, n_embd=128)


def partition_report(num_stages: int = 4, **model: int) -> dict[str, Any]:
    """Cost of each unit (embedding, blocks, head) by layer count and by parameters, and each split's stage loads.

    In one process, on the ``meta`` device (nothing allocated). For each method the partition
    minimises the most loaded stage; the loads are then read in parameters, the memory a stage's
    weights and optimizer state take.
    """
    cfg = GPTConfig(**{**DEMO_MODEL, **model})
    with torch.device("meta"):  # counts only: no memory, no initialisation time, whatever the model's size
        gpt = GPT(cfg)
    params = unit_costs(gpt, "params")
    out: dict[str, Any] = {"units": unit_names(gpt), "unit_params": params, "num_stages": num_stages}
    for method in ("layers", "params"):
        bounds = partition_units(unit_costs(gpt, method), num_stages)
        out[method] = {"boundaries": bounds, "stage_params": [sum(params[a:b]) for a, b in bounds]}
    return out


def _batch(cfg: GPTConfig, rows: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch of random tokens and targets, the same on every rank (seeded on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)  # lslm: cpu-ok (seeded)
    y = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)  # lslm: cpu-ok (seeded)
    return x.to(device), y.to(device)


def _serial_reference(cfg: GPTConfig, seed: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, Any]]:
    torch.manual_seed(seed)
    ref = GPT(cfg).to(x.device)
    _, loss = ref(x, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def _stage_step_time(stage: Any, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of one forward + backward of ``stage`` on ``x`` (no communication)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = stage(x)
        out.float().square().mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def contention(ctx: Any, cfg: GPTConfig, rows: int, repeats: int = 15) -> dict[str, float]:
    """This rank's stage forward + backward time alone (the other ranks wait) and with every rank computing.

    On a CPU, processes share caches and memory bandwidth: an action can take longer while
    the other ranks compute than while they idle, which a simulator with fixed costs ignores.
    """
    torch.manual_seed(0)
    stage = split_gpt(GPT(cfg), ctx.pp_size)[ctx.pp_rank].to(ctx.device)
    if stage.is_first:
        x = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), device=ctx.device)
    else:
        x = torch.randn(rows, cfg.block_size, cfg.n_embd, device=ctx.device, requires_grad=True)
    _stage_step_time(stage, x, 3)  # warm-up
    alone = 0.0
    for r in range(ctx.world_size):
        ctx.comm.barrier(label="pp demo contention")
        if r == ctx.rank:
            alone = _stage_step_time(stage, x, repeats)
    ctx.comm.barrier(label="pp demo contention")
    together = _stage_step_time(stage, x, repeats)
    ctx.comm.barrier(label="pp demo contention")
    return {"alone_s": alone, "together_s": together}


def traced_step(pipe: Any, x: torch.Tensor, y: torch.Tensor, ctx: Any, trace: str, name: str) -> dict[str, Any]:
    """One more step of ``pipe`` under the profiler's trace (step ``"0"``, after a barrier ``"sync"`` that absorbs
    the ranks' different profiler start-up times), written as ``trace_path(trace, name, rank)``: compute, the
    ledger's sends and receives, each action a named range. Returns ``trace`` (the file) and ``seconds``."""
    started = time.perf_counter()
    for p in pipe.parameters():
        p.grad = None
    tracer = StepTracer(trace, name, ctx.rank, ctx.device, ["sync", "0"])
    with tracer.step("sync"):
        ctx.comm.barrier(label="pp demo profiler start")
    with tracer.step("0"):
        pipe.step(x, y)
    return {"trace": str(tracer.path), "seconds": time.perf_counter() - started}


def memory_timeline_step(ctx: Any, cfg: GPTConfig, plan: dict[str, Any], rows: int, seed: int = 0) -> dict[str, Any]:
    """The memory profiler's timeline of one step of ``cfg`` pipelined by ``plan`` (:class:`PipelinePlan` fields)
    on ``rows`` rows, after one unprofiled step; each action a range. The profiler records every op with its
    Python stack and then builds a data-flow graph, seconds per thousand ops: keep the model small. Returns
    ``memory_timeline`` (:meth:`MemoryTimeline.to_dict`) or ``memory_error`` (the profiler's own data-flow check
    fails now and then with gloo's threads; tried twice), and ``seconds``."""
    started = time.perf_counter()
    x, y = _batch(cfg, rows, seed, ctx.device)
    torch.manual_seed(seed)
    pipe = apply_pipeline(GPT(cfg), ctx, PipelinePlan(**plan))
    params = list(pipe.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        pipe.step(x, y)

    step()  # the kernels' own first allocations happen here, not in the profiled step
    out: dict[str, Any] = {}
    for _ in range(2):
        try:
            timeline, _ = record_memory_timeline(step, ctx.device, range_prefixes=(ACTION_PREFIX,))
            out = {"memory_timeline": timeline.to_dict()}
            break
        except AssertionError as exc:
            out = {"memory_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out["seconds"] = time.perf_counter() - started
    return out


def schedules_worker(runs: list[dict[str, Any]], model: dict[str, int] | None = None, batch_size: int = 16,
                     steps: int = 3, seed: int = 0, trace: str | None = None, profile: tuple[int, ...] = (),
                     memory_timeline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Launch target: each plan of ``runs`` (:class:`PipelinePlan` fields) on every rank, ``steps`` steps each.

    Every step is the same batch from zeroed gradients (no optimizer), so the gradients can
    be compared with the serial GPT's and the last step's timeline is a warm one. Per run,
    this rank returns: ``loss`` (the pipeline's), ``serial_loss``, ``max_grad_diff`` (largest
    ``|pipeline - serial|`` over this rank's gradients), ``max_grad`` (largest ``|serial|``),
    ``timeline`` (every rank's, ``Timeline.to_dict()``), ``memory`` (the executor's counts),
    ``step_s`` (each step's wall time on this rank) and ``p2p_bytes`` (this rank's sends, one step);
    and once, ``contention``: :func:`contention` on a micro-batch of the first run's size. Runs whose index is in
    ``profile`` then take one more step under the profiler's trace (:func:`traced_step`, written to the folder
    ``trace``) and add ``traced``: nothing above is measured in it. ``memory_timeline``: ``{"model": {...},
    "plan": {...}, "rows": n}``, one step of that (small) pipeline under the memory profiler
    (:func:`memory_timeline_step`), returned as ``memory_timeline``.
    """
    if profile and not trace:
        raise ValueError("profile=[...] needs trace=DIR: the folder the profiled runs write their traces to")
    cfg = GPTConfig(**{**DEMO_MODEL, **(model or {})})
    ctx = init_distributed(pp=int(__import__("os").environ.get("WORLD_SIZE", "1")), seed=seed)
    with ctx:
        x, y = _batch(cfg, batch_size, seed, ctx.device)
        serial_loss, serial_grads = _serial_reference(cfg, seed, x, y)
        timing = contention(ctx, cfg, batch_size // max(int(r.get("microbatches", 4)) for r in runs))
        results = []
        for run in runs:
            plan = PipelinePlan(**{"record_timeline": True, "track_memory": True, **run})
            torch.manual_seed(seed)
            pipe = apply_pipeline(GPT(cfg), ctx, plan)
            params = dict(pipe.named_parameters())
            step_s, p2p = [], 0
            for _ in range(steps):
                for p in params.values():
                    p.grad = None
                since = len(ctx.comm.ledger.records)
                t0 = time.perf_counter()
                loss = pipe.step(x, y)
                step_s.append(time.perf_counter() - t0)
                p2p = sum(r.nbytes for r in ctx.comm.ledger.records[since:] if r.op == "send")
            timeline = pipe.gather_timeline()
            diff = max((params[n].grad - serial_grads[n]).abs().max().item() for n in params)
            results.append({"run": run, "loss": loss.item(), "serial_loss": serial_loss, "max_grad_diff": diff,
                            "max_grad": max(serial_grads[n].abs().max().item() for n in params),
                            "timeline": timeline.to_dict(), "memory": pipe.last_memory, "step_s": step_s,
                            "p2p_bytes": p2p})
            if len(results) - 1 in profile:
                assert trace is not None
                name = f"{run['schedule']}-{len(results) - 1}"
                results[-1]["traced"] = traced_step(pipe, x, y, ctx, trace, name)
            ctx.comm.ledger.reset()
        assert all(math.isfinite(r["loss"]) for r in results)
        out = {"rank": ctx.rank, "pp": ctx.pp_size, "batch_size": batch_size, "model": cfg.__dict__,
               "contention": timing, "results": results}
        if memory_timeline is not None:
            small = GPTConfig(**{**DEMO_MODEL, **(model or {}), **memory_timeline.get("model", {})})
            out["memory_timeline"] = memory_timeline_step(ctx, small, memory_timeline["plan"],
                                                          memory_timeline["rows"], seed)
        return out


def tied_worker(schedules: list[str], microbatches: int = 4, model: dict[str, int] | None = None,
                batch_size: int = 8, seed: int = 0) -> dict[str, Any]:
    """Launch target: a GPT with tied embedding and head (GPT-2's ``tie_weights``) pipelined by each of
    ``schedules`` (``"interleaved"`` and ``"dualpipev"`` with two stages per rank), one step each, against the
    serial tied GPT.

    Per schedule, this rank returns: ``loss`` and ``serial_loss``; ``tied_param`` (its copy of the tied weight:
    ``"wte.weight"`` on the first stage's rank, ``"lm_head.weight"`` on the last's, None elsewhere or when one
    rank holds both); ``max_rel_diff`` (largest ``|pipeline - serial| / max|serial|`` over its gradients, its
    copy compared with the serial tied gradient); ``exchanges`` and ``exchange_bytes`` (the tied gradient's
    sends and receives on this rank in the step).
    """
    cfg = GPTConfig(**{**DEMO_MODEL, **(model or {}), "tie_weights": True})
    ctx = init_distributed(pp=int(__import__("os").environ.get("WORLD_SIZE", "1")), seed=seed)
    with ctx:
        x, y = _batch(cfg, batch_size, seed, ctx.device)
        serial_loss, serial_grads = _serial_reference(cfg, seed, x, y)
        results = []
        for name in schedules:
            v = 2 if name in ("interleaved", "dualpipev") else 1
            torch.manual_seed(seed)
            pipe = apply_pipeline(GPT(cfg), ctx, PipelinePlan(schedule=name, microbatches=microbatches,
                                                              virtual_stages=v))
            since = len(ctx.comm.ledger.records)
            loss = pipe.step(x, y)
            tied = [r for r in ctx.comm.ledger.records[since:] if r.label == "pp tied embedding grad"]
            params = dict(pipe.named_parameters())
            # The serial model names the one tied tensor wte.weight; the last stage's copy is lm_head.weight.
            ref = {n: serial_grads["wte.weight" if n == "lm_head.weight" else n] for n in params}
            diff = max(((params[n].grad - ref[n]).abs().max() / ref[n].abs().max()).item() for n in params)
            mine = next((n for n, prm in params.items() if prm is pipe.tied_param), None)
            results.append({"schedule": name, "loss": loss.item(), "serial_loss": serial_loss,
                            "tied_param": mine, "max_rel_diff": diff, "exchanges": len(tied),
                            "exchange_bytes": sum(r.nbytes for r in tied)})
            ctx.comm.ledger.reset()
        return {"rank": ctx.rank, "pp_rank": ctx.pp_rank, "results": results,
                "embedding_bytes": cfg.vocab_size * cfg.n_embd * 4}


def torch_side_by_side_worker(schedules: list[str], microbatches: int = 8, model: dict[str, int] | None = None,
                              batch_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Launch target: each lslm schedule and its ``torch.distributed.pipelining`` twin on the same GPT and batch.

    For every name in ``schedules`` (lslm names; :data:`~lslm.pipeline.torch_reference.LSLM_TO_TORCH`
    gives torch's class), both pipelines are built from one seed and run one step from zero
    gradients. This rank returns, per schedule: torch's class, both losses, the serial loss,
    and the largest ``|lslm - torch|`` and ``|lslm - serial|`` over this rank's gradients.
    """
    from lslm.pipeline.torch_reference import TorchPipeline, torch_spec

    cfg = GPTConfig(**{**DEMO_MODEL, **(model or {})})
    ctx = init_distributed(pp=int(__import__("os").environ.get("WORLD_SIZE", "1")), seed=seed)
    with ctx:
        x, y = _batch(cfg, batch_size, seed, ctx.device)
        serial_loss, serial_grads = _serial_reference(cfg, seed, x, y)
        out = []
        for name in schedules:
            v = 2 if name in ("interleaved", "dualpipev") else 1
            torch.manual_seed(seed)
            ours = apply_pipeline(GPT(cfg), ctx, PipelinePlan(schedule=name, microbatches=microbatches,
                                                              virtual_stages=v))
            lslm_loss = ours.step(x, y).item()
            torch.manual_seed(seed)
            theirs = TorchPipeline(GPT(cfg), ctx, name, microbatches, v)
            torch_loss = theirs.step(x, y).item()
            a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
            out.append({"schedule": name, "torch_class": torch_spec(name)[0], "lslm_loss": lslm_loss,
                        "torch_loss": torch_loss, "serial_loss": serial_loss,
                        "max_grad_diff_torch": max((a[n].grad - b[n].grad).abs().max().item() for n in a),
                        "max_grad_diff_serial": max((a[n].grad - serial_grads[n]).abs().max().item() for n in a),
                        "max_grad": max(serial_grads[n].abs().max().item() for n in a)})
        return {"rank": ctx.rank, "results": out}


def two_bw_worker(microbatches: int = 4, num_batches: int = 6, rows: int = 8, lr: float = 0.5,
                  seed: int = 0) -> dict[str, Any]:
    """Launch target: PipeDream-2BW on every rank against the serial delayed (2BW) and undelayed (Flush) rules.

    A small GPT (4 blocks, 256-token vocabulary, sequences of 16) trains on ``num_batches``
    batches of counting sequences (each token the previous one plus 1) with plain SGD
    through :func:`~lslm.pipeline.pipedream_2bw.run_2bw`; every
    rank then replays both update rules serially from the same start and data
    (:func:`~lslm.pipeline.pipedream_2bw.simulate_delayed_sgd`, delay 1 and 0). Returns this
    rank's largest parameter difference from each, the three loss curves, and the bytes of
    its weight versions next to PipeDream's weight stashing.
    """
    import copy

    from lslm.pipeline.partition import split_gpt
    from lslm.pipeline.pipedream_2bw import run_2bw, simulate_delayed_sgd

    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=64)
    ctx = init_distributed(pp=int(__import__("os").environ.get("WORLD_SIZE", "1")), seed=seed)
    with ctx:
        torch.manual_seed(seed)
        model = GPT(cfg)
        start = copy.deepcopy(model)
        g = torch.Generator().manual_seed(seed + 1)
        data = []
        for _ in range(num_batches):
            # Learnable sequences (each token is the previous one + 1) so the loss curves go somewhere.
            first = torch.randint(0, cfg.vocab_size, (rows, 1), generator=g)  # lslm: cpu-ok (seeded)
            tok = (first + torch.arange(cfg.block_size + 1)) % cfg.vocab_size  # lslm: cpu-ok (seeded data)
            data.append((tok[:, :-1], tok[:, 1:]))
        res = run_2bw(model, ctx, data, microbatches=microbatches, lr=lr)
        sims = {d: simulate_delayed_sgd(copy.deepcopy(start), data, lr=lr, microbatches=microbatches, delay=d)
                for d in (0, 1)}
        stage = split_gpt(model, ctx.pp_size)[ctx.pp_rank]
        diff = {d: max((p.detach().cpu() - sims[d].states[-1][name]).abs().max().item()
                       for name, p in stage.model_names()) for d in sims}
        return {"rank": ctx.rank, "losses": res.losses, "delayed_losses": sims[1].losses,
                "flush_losses": sims[0].losses, "diff_delayed": diff[1], "diff_flush": diff[0],
                "version_bytes": res.version_bytes, "stage_bytes": res.stage_bytes,
                "pipedream_stash_bytes": res.pipedream_stash_bytes}
