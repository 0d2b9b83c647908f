"""Profiler traces of a few training steps: ``torch.profiler`` around chosen steps, one Chrome-trace file per rank.

:class:`StepTracer` profiles the steps it is asked to (the harness picks the last two of a
recipe's run, and the bench runner one timed round of each variant) and writes, on every
rank, ``<dir>/<name>-rank<r>.json``: Chrome-trace JSON that opens in Perfetto
(https://ui.perfetto.dev) and in ``chrome://tracing``. In it:

* each traced step is a range ``lslm.step#<id>`` on the thread that ran it, and the step
  timer's marks are zero-length ranges ``lslm.mark:<name>`` (``forward_end``, ``sync_end``...);
* every call through the comm ledger is a range named by op, axis, bytes, group size and label
  (``lslm.comm:`` for the call, ``lslm.wait:`` for an asynchronous call's ``wait()``, see
  :mod:`lslm.runtime.comm_trace`), next to the autograd ops (``aten::...``) and torch's own
  ``c10d::`` / ``gloo:`` / ``nccl:`` events (gloo runs a collective on its own threads);
* on CUDA the same file holds the kernels and the NCCL kernels on their streams (activities are
  chosen by the device: the CUDA activity only when the device is a GPU; the CPU path never
  touches ``torch.cuda``).

:mod:`lslm.metrics.overlap` reads these files back (compute, communication and exposed
communication per step and per collective), :mod:`lslm.plot.trace` draws them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from lslm.runtime.comm_trace import profiling

__all__ = ["MARK_PREFIX", "STEP_PREFIX", "StepTracer", "activities_for", "mark_range", "trace_path"]

STEP_PREFIX = "lslm.step#"
MARK_PREFIX = "lslm.mark:"


def activities_for(device: torch.device | str) -> list[ProfilerActivity]:
    """Profiler activities for ``device``: the CPU always, CUDA kernels and NCCL streams on a CUDA device."""
    acts = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def trace_path(out_dir: str | Path, name: str, rank: int) -> Path:
    """Where rank ``rank`` writes the trace called ``name``: ``<out_dir>/<name>-rank<rank>.json``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return Path(out_dir) / f"{safe}-rank{rank}.json"


def mark_range(name: str) -> None:
    """Put a zero-length range ``lslm.mark:<name>`` in the running trace (nothing when no profiler runs)."""
    if profiling():
        with record_function(MARK_PREFIX + name):
            pass


class StepTracer:
    """Profile the steps whose ids are in ``steps``; write ``trace_path(out_dir, name, rank)`` after the last one.

    Use ``with tracer.step(i):`` around every step (traced or not): the profiler starts at the first
    traced step and stops, and the file is written, after the last. Steps in between that are not
    in ``steps`` are profiled too (but not named). ``ledger_calls`` collects, per traced step,
    what :meth:`note_calls` was given (the harness passes the ledger's records of the step), so a
    test can check the trace against the ledger.
    """

    def __init__(self, out_dir: str | Path, name: str, rank: int, device: torch.device | str,
                 steps: Iterable[Any]) -> None:
        self.path = trace_path(out_dir, name, rank)
        self.device = torch.device(device)
        self.steps = list(steps)
        self.ledger_calls: dict[str, list[list[Any]]] = {}
        self._prof: Any = None
        self._left = set(self.steps)

    @contextlib.contextmanager
    def step(self, step_id: Any) -> Iterator[None]:
        """Run one step; inside a ``lslm.step#<id>`` range when it is traced."""
        if step_id not in self._left:
            yield
            return
        if self._prof is None:
            self._prof = profile(activities=activities_for(self.device), record_shapes=False)
            self._prof.__enter__()
        try:
            with record_function(f"{STEP_PREFIX}{step_id}"):
                yield
        finally:
            self._left.discard(step_id)
            if not self._left:
                self.finish()

    def note_calls(self, step_id: Any, records: Iterable[Any]) -> None:
        """Keep ``[op, axis, nbytes, label]`` of each ledger record of traced step ``step_id``."""
        if step_id in self.steps:
            self.ledger_calls[str(step_id)] = [[r.op, r.axis, int(r.nbytes), r.label] for r in records]

    def finish(self) -> Path | None:
        """Stop the profiler (if it runs) and write the trace; returns its path (None if nothing was traced)."""
        if self._prof is None:
            return None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        return self.path

    def summary(self) -> dict[str, Any]:
        """What a run record keeps: the file, the traced steps and the ledger's calls in each."""
        return {"path": str(self.path), "steps": [str(s) for s in self.steps], "ledger": self.ledger_calls}
