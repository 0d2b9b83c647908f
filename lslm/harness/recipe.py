"""The recipe harness: a technique says how to build one training step; the harness trains it and reports.

A recipe is three things:

* a **config** dataclass, checked in ``__post_init__`` (:func:`~lslm.harness.config_cli.check_fields`
  plus its own cross-field checks), with at least ``steps``, ``log_every``, ``seed``, ``device``
  and ``out``; its command line is generated from it;
* ``build(cfg, ctx) -> Built``: the model, the optimizer, the batches and a ``step(batch, timer)``
  function that runs one optimisation step and returns this rank's loss; ``ctx`` is the
  :class:`~lslm.runtime.ParallelContext` (``None`` for a serial run without a process group);
* optionally ``check(cfg, world_size)``, which rejects a config that cannot run on that many
  processes (raising ``ValueError`` before any process starts).

The harness (:func:`train_loop`) runs the loop: the next batch and any untimed work, then
the step between ``timer.start()`` and ``timer.stop()`` with a device-aware
:class:`~lslm.harness.timer.StepTimer` (the technique marks its phases inside), the
ledger's bytes of the step, a rank-0 log line, and at the end the global loss per step,
the memory report and the run record. :func:`run_rank` is one rank of a launched job,
:func:`run_or_launch` starts it (as this rank under torchrun, else through
:func:`lslm.launch`), and rank 0 writes the run log with every rank's summary.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lslm.harness.throughput import step_throughput
from lslm.harness.timer import Marks, StepTimer
from lslm.metrics.flops import StepFlops
from lslm.metrics.memory import memory_report
from lslm.metrics.trace import StepTracer
from lslm.runtime.context import ParallelContext
from lslm.runtime.files import atomic_write_bytes
from lslm.runtime.printing import progress, rank_print

__all__ = ["REPORT_LABEL", "Built", "gather_summaries", "summarize", "train_loop", "write_run_log"]

#: Ledger label of the harness's own end-of-run collectives (never counted as a technique's traffic).
REPORT_LABEL = "report"


@dataclass
class Built:
    """What a technique's ``build(cfg, ctx)`` hands to the harness.

    * ``model``: the bare model (not its wrapper): parameters and memory are counted on it;
    * ``step(batch, timer)``: one optimisation step; returns this rank's loss (a 0-dim tensor).
      The harness has called ``timer.start()``; the step may ``timer.mark(name)`` its phases;
    * ``batches``: an endless iterator; ``next()`` runs outside the timed step;
    * ``before_step(batch)``: untimed work before each step (a probe, resetting a timeline);
    * ``per_step(marks)``: this step's figures from its marks (e.g. ``{"compute_s": ...}``),
      appended to lists of the same names in the record;
    * ``count``: ``(op, label)`` of the ledger records summed per step into ``comm_bytes`` and
      ``comm_calls`` (``None``: not counted);
    * ``log(record)``: extra text for rank 0's log line, from this step's figures;
    * ``info``: fixed fields added to the run record (e.g. ``grad_bytes``);
    * ``owners``: wrappers that keep their own tensors (DDP buckets, ZeRO shards), reported
      through their ``memory_owners()`` in the memory breakdown by owner and device;
    * ``ctx``: the context the technique built its groups in, when not the harness's own (a recipe
      whose grid differs from the launch's, e.g. the second of several runs in one job); the
      global loss is averaged over *its* data-parallel group;
    * ``first_step``: where a resumed run starts (it has loaded a checkpoint of that step and
      positioned ``batches`` there); the loop runs steps ``first_step .. cfg.steps - 1``;
    * ``flops``: one step's flops over all ranks (:func:`lslm.metrics.flops.gpt_step_flops`); the loop then
      reports tokens/s, achieved TFLOP/s, MFU and HFU against the device's peak
      (:func:`lslm.harness.throughput.step_throughput`).
    """

    model: nn.Module
    optimizer: Any  # a torch optimizer, or lslm.precision's wrapper of one (fp32 masters)
    step: Callable[[Any, StepTimer], torch.Tensor]
    batches: Iterator[Any]
    device: torch.device
    before_step: Callable[[Any], None] | None = None
    per_step: Callable[[Marks], dict[str, Any]] | None = None
    count: tuple[str | None, str | None] | None = None
    log: Callable[[dict[str, Any]], str] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    owners: tuple[Any, ...] = ()
    name: str = "train"
    ctx: ParallelContext | None = None
    first_step: int = 0
    flops: StepFlops | None = None


#: How many steps ``trace`` profiles: the last ones of the run (the first steps warm caches and buckets up).
TRACE_STEPS = 2


def train_loop(cfg: Any, built: Built, ctx: ParallelContext | None = None, trace: str | None = None,
               trace_name: str | None = None) -> dict[str, Any]:
    """Train ``built`` for ``cfg.steps`` steps; return this rank's run record.

    With ``trace`` (a folder), the last :data:`TRACE_STEPS` steps run under ``torch.profiler`` and
    every rank writes ``<trace>/<trace_name or built.name>-rank<r>.json`` (see
    :mod:`lslm.metrics.trace`); the record's ``trace`` says where, which steps, and the ledger's
    calls of each traced step.

    Per step (lists): ``local_losses`` (this rank's loss), ``step_s`` (start to end of the
    step, loss on the host included), the ``per_step`` figures, and ``comm_bytes`` /
    ``comm_calls`` when ``count`` is set. The ledger is emptied after every step (each step
    was counted), so a long run does not grow it. At the end: ``losses`` (the global loss
    per step, the mean of the data-parallel ranks' losses: one all-reduce labelled
    :data:`REPORT_LABEL`), ``memory`` (:func:`lslm.metrics.memory.memory_report` on this
    rank), ``num_parameters``, ``threads``, ``config``, ``rank``, ``world_size``, ``dp_size``, ``device``,
    ``backend`` and ``built.info``; with ``built.flops``, ``throughput``
    (:func:`~lslm.harness.throughput.step_throughput` of this rank's median step), which rank 0 also prints.
    """
    ctx = built.ctx if built.ctx is not None else ctx  # the technique's own grid, when it built one
    ledger = ctx.comm.ledger if ctx is not None else None
    timer = StepTimer(built.device)
    rec: dict[str, list[Any]] = {"local_losses": [], "step_s": []}
    steps = range(built.first_step, cfg.steps)
    bar = progress(steps, desc=built.name) if ctx is None else None
    tracer = (StepTracer(trace, trace_name or built.name, ctx.rank if ctx is not None else 0, built.device,
                         list(steps)[-TRACE_STEPS:]) if trace else None)
    for step in bar if bar is not None else steps:
        batch = next(built.batches)
        if built.before_step is not None:
            built.before_step(batch)
        since = len(ledger.records) if ledger is not None else 0
        with tracer.step(step) if tracer is not None else contextlib.nullcontext():
            timer.start()
            loss = built.step(batch, timer)
            value = loss.item()  # waits for the device: the step is over when the host has its loss
            marks = timer.stop()
        if tracer is not None and ledger is not None:
            tracer.note_calls(step, ledger.records[since:])
        now: dict[str, Any] = {"local_losses": value, "step_s": marks.total}
        if built.per_step is not None:
            now.update(built.per_step(marks))
        if ledger is not None and built.count is not None:
            now["comm_bytes"] = ledger.total_bytes(*built.count, since=since)
            now["comm_calls"] = ledger.calls(*built.count, since=since)
        if ledger is not None:
            ledger.reset()  # counted above; a long run must not grow the ledger without bound
        for key, val in now.items():
            rec.setdefault(key, []).append(val)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            if bar is not None:
                bar.set_postfix(loss=f"{value:.3f}")
            elif ctx.rank == 0:
                extra = built.log(now) if built.log is not None else ""
                rank_print(f"step {step:>4}  loss(rank 0) {value:.4f}  step {1e3 * marks.total:7.1f} ms{extra}")
    rates = None
    if built.flops is not None and rec["step_s"]:
        rates = step_throughput(built.flops, statistics.median(rec["step_s"]), built.device,
                                ctx.world_size if ctx is not None else 1)
        if ctx is None or ctx.rank == 0:
            rank_print(f"throughput ({built.name}, median step): {rates.line()}")
    return {
        "rank": ctx.rank if ctx is not None else 0,
        "world_size": ctx.world_size if ctx is not None else 1,
        "dp_size": ctx.dp_size if ctx is not None else 1,
        "losses": _global_losses(rec["local_losses"], ctx),
        **rec,
        "num_parameters": sum(p.numel() for p in built.model.parameters()),
        "memory": memory_report(built.device, built.model, built.optimizer, owners=built.owners).to_dict(),
        "threads": torch.get_num_threads(),
        "config": asdict(cfg),
        "first_step": built.first_step,
        "device": str(built.device),
        "backend": ctx.backend if ctx is not None else None,
        **({"throughput": rates.to_dict()} if rates is not None else {}),
        **({"trace": tracer.summary()} if tracer is not None else {}),
        **built.info,
    }



def _global_losses(local: list[float], ctx: ParallelContext | None) -> list[float]:
    # Equal shards per rank: the global mean loss is the mean of the ranks' means.
    if ctx is None:
        return list(local)
    losses = torch.tensor(local, dtype=torch.float64, device=ctx.device)
    ctx.comm.all_reduce(losses, group=ctx.dp_group, label=REPORT_LABEL)
    return (losses / ctx.dp_size).tolist()


def summarize(result: dict[str, Any]) -> dict[str, float]:
    """Medians over steps of one rank's time lists (every ``*_s`` list, as ``*_ms``) and its peak RSS (MiB)."""
    med = {k.removesuffix("_s") + "_ms": 1e3 * statistics.median(v) for k, v in result.items()
           if k.endswith("_s") and isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)}
    peak = (result.get("memory") or {}).get("peak_rss") or 0
    return {**med, "peak_rss_mib": peak / 2**20}


def gather_summaries(ctx: ParallelContext | None, summary: dict[str, float]) -> list[dict[str, float]]:
    """Every rank's :func:`summarize` dict, in rank order (one all-gather on the device; every rank gets it)."""
    if ctx is None:
        return [{**summary, "rank": 0}]
    keys = sorted(summary)  # the same technique on every rank: the same keys
    mine = torch.tensor([float(summary[k]) for k in keys], dtype=torch.float64, device=ctx.device)
    out = torch.empty(ctx.world_size * len(keys), dtype=torch.float64, device=ctx.device)
    ctx.comm.all_gather(list(out.chunk(ctx.world_size)), mine, label=REPORT_LABEL)
    return [{**dict(zip(keys, row.tolist())), "rank": r} for r, row in enumerate(out.view(ctx.world_size, -1).cpu())]


def write_run_log(path: str | Path, result: dict[str, Any], ranks: list[dict[str, float]]) -> None:
    """Write rank 0's run log: its record without per-rank details, and every rank's summary under ``ranks``."""
    per_rank = ("rank", "local_losses", "timeline", "memory")
    log = {k: v for k, v in result.items() if k not in per_rank}
    log.update(memory_rank0=result.get("memory"), ranks=ranks)
    atomic_write_bytes(Path(path), (json.dumps(log, indent=1) + "\n").encode("utf-8"))

