"""The bench runner: variants side by side, interleaved, timed on every rank, reduced to the critical path.

Rules every lslm benchmark follows:

* **interleaved**: round ``i`` runs every variant once, in order, before round ``i + 1``;
  slow drifts of a shared machine (other jobs, thermal throttling) then hit all variants
  alike, instead of whichever happened to run last;
* **warm-up**: the first ``warmup`` rounds run but are not timed (allocator, caches,
  communicator set-up, torch DDP's first-iteration bucket re-plan);
* **barrier** before every call, so all ranks start it together;
* **critical path**: a call costs what its *slowest* rank took (max over ranks). Phases
  (e.g. compute / exposed communication / optimizer) are read on one rank, the
  *critical-path* rank: the one whose ``critical`` phase took longest (for DDP, the last
  rank to finish backward: the others' waits include waiting for it, its own does not);
* **medians** over the timed rounds.

**Traces.** With the environment variable :data:`TRACE_ENV` (``LSLM_TRACE_DIR``) set to a folder,
which ``lslm bench NAME --trace DIR`` does for the processes it launches, the *last* timed round
runs under ``torch.profiler``: each variant's call is a step range ``lslm.step#<variant>``, and
every rank writes ``DIR/bench<k>-n<world size>-rank<r>.json`` (``k`` counts this process's
:func:`run_variants` calls; see :mod:`lslm.metrics.trace`). An environment variable, because a bench
reaches :func:`run_variants` through its own workers and options: one switch for all of them.

The timing source is a :class:`~lslm.harness.timer.StepTimer` on the bench's device (CUDA
events on GPUs), and the gather of every rank's times runs on that device, so the same
runner works on gloo and on NCCL. ``barrier``, ``gather`` and ``clock`` can be replaced,
which is how the unit tests drive it without processes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lslm.harness.timer import Marks, StepTimer
from lslm.metrics.trace import StepTracer

__all__ = ["TRACE_ENV", "Timing", "Variant", "critical_path", "gather_ranks", "run_variants"]

#: The environment variable that makes :func:`run_variants` trace its last round into a folder.
TRACE_ENV = "LSLM_TRACE_DIR"
_TRACE_CALLS = itertools.count()  # numbers this process's traced run_variants calls (one file each)


@dataclass
class Variant:
    """One contender: ``run(timer, round)`` does one timed repetition (it may ``timer.mark`` phase points).

    ``after(round)``, if given, runs untimed after each *timed* repetition; what it returns
    is kept in :attr:`Timing.extra` (e.g. the ledger's bytes for that step).
    """

    name: str
    run: Callable[[StepTimer, int], Any]
    after: Callable[[int], Any] | None = None


@dataclass
class Timing:
    """A variant's timed rounds after the reduction over ranks (seconds)."""

    name: str
    total_s: list[float]
    phases_s: dict[str, list[float]] = field(default_factory=dict)
    extra: list[Any] = field(default_factory=list)

    def median(self, phase: str = "total") -> float:
        """Median over rounds of the total (slowest rank) or of one phase (critical-path rank), seconds."""
        return statistics.median(self.total_s if phase == "total" else self.phases_s[phase])


def critical_path(every: torch.Tensor, critical: int | None = None) -> torch.Tensor:
    """``every[rank, variant, round, 0 = total, 1.. = phases]`` -> ``[variant, round, 1 + phases]``.

    Column 0 becomes the max over ranks. The phase columns are taken from the rank whose
    column ``critical`` (an index into ``every``'s last dimension) is largest; with
    ``critical=None`` from the rank with the largest total.
    """
    if every.dim() != 4:
        raise ValueError(f"expected [rank, variant, round, column], got shape {tuple(every.shape)}")
    col = 0 if critical is None else critical
    crit = every[..., col].argmax(dim=0)  # [variant, round]: which rank
    out = torch.gather(every, 0, crit[None, ..., None].expand(1, *crit.shape, every.shape[-1]))[0]
    out[..., 0] = every[..., 0].amax(dim=0)
    return out


def gather_ranks(local: torch.Tensor, device: torch.device | str = "cpu", group: Any = None) -> torch.Tensor:
    """Every rank's ``local`` stacked on dim 0 (all-gather on ``device``: NCCL needs it there), on the CPU.

    Without a process group this is ``local[None]``: a one-rank world.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return local[None]
    mine = local.to(device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)  # measurement plumbing, deliberately outside the comm ledger
    return torch.stack(parts).cpu()


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_variants(variants: Sequence[Variant], *, steps: int, warmup: int = 1,
                 phases: dict[str, tuple[str, str]] | None = None, critical: str | None = None,
                 device: torch.device | str = "cpu", timer_mode: str = "auto",
                 barrier: Callable[[], None] = _barrier,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 after_round: Callable[[int], None] | None = None, rotate: bool = True) -> dict[str, Timing]:
    """Run ``variants`` round-robin (``warmup`` untimed rounds, then ``steps`` timed ones) on every rank.

    With ``rotate`` (the default) round ``i`` starts at variant ``i mod V``, so every variant
    runs equally often in every position: measured on 4 gloo processes sharing 2 cores, the
    variant that follows ``torch.distributed.all_reduce`` ran ~10-15 % slower than the same
    code two places later, a bias a fixed order would charge to one variant every round.

    ``phases`` names spans between marks the variants set, e.g.
    ``{"compute": ("start", "backward_end"), "exposed": ("backward_end", "sync_end")}``;
    ``critical`` names the phase that picks the critical-path rank (default: the total).
    Every rank must call this with the same variants; every rank gets the same result,
    ``{name: Timing}`` in the variants' order. ``after_round(round)`` runs after each round
    (e.g. to empty the comm ledger). ``gather`` defaults to :func:`gather_ranks` on ``device``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    names = [v.name for v in variants]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"variants need distinct names, got {names}")
    phases = dict(phases or {})
    if critical is not None and critical not in phases:
        raise ValueError(f"critical phase {critical!r} is not among the phases {list(phases)}")
    gather = gather or (lambda t: gather_ranks(t, device))
    timer = StepTimer(device, mode=timer_mode, clock=clock)
    # Host-side timing table; gather_ranks moves it to the bench device before communicating.
    local = torch.zeros(len(variants), steps, 1 + len(phases), dtype=torch.float64)  # lslm: cpu-ok (host timings)
    extra: list[list[Any]] = [[] for _ in variants]
    tracer = _tracer(names, device)
    last = warmup + steps - 1
    for rnd in range(warmup + steps):
        first = rnd % len(variants) if rotate else 0
        for v in [*range(first, len(variants)), *range(first)]:
            variant = variants[v]
            barrier()
            traced = tracer.step(variant.name) if tracer is not None and rnd == last else contextlib.nullcontext()
            with traced:
                timer.start()
                variant.run(timer, rnd)
                marks: Marks = timer.stop()
            if rnd < warmup:
                continue
            row = [marks.total] + [marks.span(a, b) for a, b in phases.values()]
            local[v, rnd - warmup] = torch.tensor(row, dtype=torch.float64)  # lslm: cpu-ok (host timings)
            if variant.after is not None:
                extra[v].append(variant.after(rnd))
        if after_round is not None:
            after_round(rnd)
    crit = None if critical is None else 1 + list(phases).index(critical)
    reduced = critical_path(gather(local), crit)
    return {name: Timing(name, reduced[v, :, 0].tolist(),
                         {p: reduced[v, :, 1 + k].tolist() for k, p in enumerate(phases)}, extra[v])
            for v, name in enumerate(names)}



def _tracer(names: list[str], device: torch.device | str) -> StepTracer | None:
    """A tracer of every variant's call in the last round when :data:`TRACE_ENV` names a folder, else None."""
    folder = os.environ.get(TRACE_ENV)
    if not folder:
        return None
    initialized = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    return StepTracer(folder, f"bench{next(_TRACE_CALLS)}-n{world}", rank, device, names)
