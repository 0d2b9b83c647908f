"""Run one rank's instruction list: the same executor for every schedule.

A schedule (:mod:`lslm.pipeline.schedules`) gives each rank an ordered list of actions;
:class:`PipelineExecutor` does them in order and nothing else decides the order:

* a maximal run of consecutive communication actions is ONE ``batch_isend_irecv``
  (:func:`lslm.pipeline.p2p.post`); if the run receives anything, all its works are
  waited before the next compute action (the compute needs the data); a run that only
  sends is waited at the end of the step at the latest (pruned earlier as its works
  complete, so deallocated outputs really free);
* ``F`` / ``B`` / ``I`` / ``W`` go to the stage's :class:`~lslm.pipeline.stage.StageRuntime`;
  adjacent stages on one rank (DualPipeV's turn of the V) hand tensors over directly;
* with data parallelism, each stage's gradients are averaged over ``ctx.group("dp")``
  right after this rank's last backward touching that stage (asynchronous: it overlaps the
  rest of the schedule and is waited at the end): one all-reduce per bucket of the stage's
  gradient buffers, in place, or one flat all-reduce of its ``.grad`` without buffers.

While a profiler runs, each compute action is a named range (:func:`action_range`). Optional
recording: a timeline (compute from ``perf_counter`` around each action, synchronising the
device first on CUDA; communication from the ledger's issue and completion times, which the
ledger stamps only inside a recorded step: ``ledger.timed()``) and activation memory
(:class:`~lslm.pipeline.memory.PipelineMemory`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.profiler import record_function

from lslm.data_parallel.grad_sync import finish_reductions, reduce_buffers, split_by_holder
from lslm.pipeline.actions import COMM_KINDS, COMPUTE_KINDS, Action
from lslm.pipeline.memory import PipelineMemory
from lslm.pipeline.p2p import action_of_record, exchange
from lslm.pipeline.stage import StageRuntime
from lslm.pipeline.timeline import Event, Timeline
from lslm.runtime.comm_trace import profiling
from lslm.runtime.context import ParallelContext
from lslm.runtime.startup import synchronize

__all__ = ["ACTION_PREFIX", "KINDS", "PipelineExecutor", "StepResult", "action_range", "dp_grad_label",
           "gather_timeline"]

KINDS = COMPUTE_KINDS + COMM_KINDS
#: Name prefix of a compute action's profiler range: ``lslm.action:F3 s0`` is micro-batch 3's forward on stage 0.
ACTION_PREFIX = "lslm.action:"


def action_range(a: Action) -> Any:
    """A ``record_function`` range named after compute action ``a`` while a profiler runs (else a no-op), so a
    trace or a memory timeline says which action ran when."""
    return record_function(f"{ACTION_PREFIX}{a.kind}{a.mb} s{a.stage}") if profiling() else nullcontext()


def dp_grad_label(stage: int) -> str:
    """Ledger label of a stage's data-parallel gradient average."""
    return f"pp dp grads s{stage}"


@dataclass
class StepResult:
    """What one step left: the sum over this rank's last-stage micro-batches of their mean loss (None when the
    rank holds no last stage), the timeline events (rank-relative seconds), the memory summary."""

    loss_sum: torch.Tensor | None
    events: list[Event] = field(default_factory=list)
    memory: dict[str, Any] | None = None


@dataclass
class _Step:
    """One step's inputs and the tensors in transit between actions."""

    xs: Sequence[torch.Tensor]
    ys: Sequence[torch.Tensor]
    loss_weight: float
    hidden: tuple[int, ...]  # (b, T, C), or (T/s, b, C) under sequence parallelism: what crosses a stage boundary
    dtype: torch.dtype
    record: bool
    origin: float
    recv_in: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (stage, mb) -> received input
    recv_grad: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # -> received output gradient
    # ("out", s, mb): stage s's output for stage s+1 on this rank; ("grad", s, mb): stage s's input gradient.
    handover: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    to_send: dict[Action, torch.Tensor] = field(default_factory=dict)  # keyed by the SEND action that carries it
    sends: list[tuple[Any, list[torch.Tensor]]] = field(default_factory=list)  # (work, aliases it keeps alive)
    dp_syncs: list[tuple[list[tuple[Any, torch.Tensor]], list[torch.nn.Parameter] | None]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    loss_sum: torch.Tensor | None = None


class PipelineExecutor:
    """Executes ``actions`` (this rank's list) over ``stages`` (this rank's :class:`StageRuntime` s by virtual
    stage); ``stage_to_rank`` maps every virtual stage to its pipeline rank."""

    def __init__(self, ctx: ParallelContext, actions: Sequence[Action], stages: dict[int, StageRuntime],
                 stage_to_rank: Sequence[int], *, deallocate_outputs: bool = True,
                 memory: PipelineMemory | None = None) -> None:
        self.ctx, self.actions, self.stages = ctx, list(actions), stages
        self.stage_to_rank = tuple(stage_to_rank)
        self.num_stages = len(self.stage_to_rank)
        self.rank = ctx.pp_rank
        self.deallocate_outputs = deallocate_outputs
        self.memory = memory
        for a in self.actions:
            if a.stage >= self.num_stages or self.stage_to_rank[a.stage] != self.rank:
                raise ValueError(f"action {a} is for stage {a.stage}, which is not on pipeline rank {self.rank}")
        # Index of this rank's last backward (B, I or W) of each stage: its gradients are final there.
        self.last_backward: dict[int, int] = {}
        for i, a in enumerate(self.actions):
            if a.kind in ("B", "I", "W"):
                self.last_backward[a.stage] = i

    def _local(self, stage: int) -> bool:
        return 0 <= stage < self.num_stages and self.stage_to_rank[stage] == self.rank

    def run(self, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], loss_weight: float, *,
            sync_grads: bool = True, record: bool = False, origin: float = 0.0) -> StepResult:
        """One step over micro-batches ``xs`` (token ids) / ``ys`` (targets); each last-stage micro-batch's loss is
        weighted by ``loss_weight`` for the backward. ``record``: timeline events relative to ``origin``."""
        ledger = self.ctx.comm.ledger
        since = len(ledger.records)
        if self.memory is not None:
            self.memory.reset()
        first = next(iter(self.stages.values()))
        st = _Step(xs, ys, loss_weight, first.module.hidden_shape(*xs[0].shape), first.dtype, record, origin)
        # The timeline's comm bars end at the ledger's completion times, which it stamps only on request.
        with ledger.timed(record):
            i, n = 0, len(self.actions)
            while i < n:
                if self.actions[i].is_comm:
                    j = i
                    while j < n and self.actions[j].is_comm:
                        j += 1
                    self._communicate(self.actions[i:j], st)
                    i = j
                    continue
                with action_range(self.actions[i]):
                    self._compute(self.actions[i], st)
                if self.ctx.dp_size > 1 and sync_grads and self.last_backward.get(self.actions[i].stage) == i:
                    st.dp_syncs.append(self._start_dp_sync(self.actions[i].stage))
                i += 1
            self._finish(st)
        if record:
            synchronize(self.ctx.device)  # on CUDA the completion times come from events: let them all happen
            st.events += comm_events(ledger.snapshot()[since:], self.rank, origin)
        return StepResult(st.loss_sum, st.events, self.memory.summary() if self.memory is not None else None)

    def _communicate(self, batch: Sequence[Action], st: _Step) -> None:
        """Post one run of communication actions as one batch; wait for it if it receives anything."""
        tensors = []
        for c in batch:
            if c.kind.startswith("SEND"):
                if c not in st.to_send:
                    raise RuntimeError(f"rank {self.rank}: {c} comes before the action that produces its tensor")
                # A detached alias: it keeps the storage alive for the send after the output is deallocated.
                tensors.append(st.to_send.pop(c).detach())
            else:
                buf = torch.empty(st.hidden, device=self.ctx.device, dtype=st.dtype)
                (st.recv_in if c.kind == "RECV_F" else st.recv_grad)[(c.stage, c.mb)] = buf
                tensors.append(buf)
        def posted() -> None:
            if self.deallocate_outputs:
                for c in batch:
                    if c.kind == "SEND_F":
                        self.stages[c.stage].deallocate_output(c.mb)

        st.sends = exchange(self.ctx, batch, tensors, self.stage_to_rank, st.sends, posted)

    def _compute(self, a: Action, st: _Step) -> None:
        """One F / B / I / W, its input taken from the right place and its output put where the next user looks."""
        stage, key = self.stages[a.stage], (a.stage, a.mb)
        if self.memory is not None:
            self.memory.observe()
        if st.record:
            synchronize(self.ctx.device)
            t0 = time.perf_counter()
        if a.kind == "F":
            if stage.is_first:
                x = st.xs[a.mb]
            elif self._local(a.stage - 1):
                x = st.handover.pop(("out", a.stage - 1, a.mb))
            else:
                x = self._take(st.recv_in, key, a, "RECV_F")
            out = stage.forward(a.mb, x, st.ys[a.mb] if stage.is_last else None, st.loss_weight)
            if stage.is_last:
                st.loss_sum = out if st.loss_sum is None else st.loss_sum + out
            elif self._local(a.stage + 1):
                st.handover[("out", a.stage, a.mb)] = out
            else:
                st.to_send[Action(a.stage, "SEND_F", a.mb)] = out
        elif a.kind in ("B", "I"):
            if stage.is_last:
                g = None
            elif self._local(a.stage + 1):
                g = st.handover.pop(("grad", a.stage + 1, a.mb))
            else:
                g = self._take(st.recv_grad, key, a, "RECV_B")
            gin = stage.backward(a.mb, g, split=a.kind == "I")
            if not stage.is_first:
                assert gin is not None
                if self._local(a.stage - 1):
                    st.handover[("grad", a.stage, a.mb)] = gin
                else:
                    st.to_send[Action(a.stage, "SEND_B", a.mb)] = gin
        else:
            stage.weight(a.mb)
        if st.record:
            synchronize(self.ctx.device)
            st.events.append(Event(self.rank, a.kind, a.stage, a.mb, t0 - st.origin, time.perf_counter() - st.origin))

    def _finish(self, st: _Step) -> None:
        """Wait for the outstanding sends and gradient averages; check that every tensor found its user."""
        for w, _ in st.sends:
            w.wait()
        dp = self.ctx.dp_size
        for pending, params in st.dp_syncs:
            if params is None:  # gradient buffers: reduced in place, bucket by bucket
                finish_reductions(pending, dp)
                continue
            ((work, flat),) = pending
            work.wait()
            flat /= dp
            offset = 0
            for p in params:
                assert p.grad is not None
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        if self.memory is not None:
            self.memory.observe()
            self.memory.note_gradients(p for s in self.stages.values() for p in s.module.parameters())
        for s in self.stages.values():
            s.finish()
        leftover = [str(k) for d in (st.recv_in, st.recv_grad, st.handover, st.to_send) for k in d]
        assert not leftover, f"rank {self.rank}: tensors never consumed: {leftover}"

    def _take(self, pool: dict[tuple[int, int], torch.Tensor], key: tuple[int, int], a: Action,
              kind: str) -> torch.Tensor:
        if key not in pool:
            raise RuntimeError(f"rank {self.rank}: {a} needs {Action(a.stage, kind, a.mb)} earlier in its list")
        return pool.pop(key)

    def _start_dp_sync(self, stage: int) -> tuple[list[tuple[Any, torch.Tensor]], list[torch.nn.Parameter] | None]:
        """Start averaging ``stage``'s gradients over the data-parallel group (SUM, then /dp when waited).

        Gradient buffers (``main_grad``; attach one set per stage): one all-reduce per bucket, in
        place. Plain ``.grad``: one flat all-reduce, copied back when it completes.
        """
        params = [p for p in self.stages[stage].module.parameters() if p.requires_grad]
        buffers, plain = split_by_holder(params)
        if buffers:
            if plain:
                raise ValueError(f"stage {stage}: {len(plain)} parameters hold .grad while the others have a "
                                 "gradient buffer: attach buffers to the whole stage")
            return reduce_buffers(buffers, self.ctx, self.ctx.group("dp"), label=dp_grad_label(stage),
                                  async_op=True), None
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        work = self.ctx.comm.all_reduce(flat, group=self.ctx.group("dp"), async_op=True, label=dp_grad_label(stage))
        return [(work, flat)], params


def comm_events(records: Sequence[Any], rank: int, origin: float) -> list[Event]:
    """Timeline events of the pipeline p2p among ledger ``records`` (issue to completion, relative to ``origin``)."""
    out = []
    for r in records:
        a = action_of_record(r)
        if a is None:
            continue
        end = r.completion_s if r.completion_s is not None else r.issue_s
        out.append(Event(rank, a.kind, a.stage, a.mb, r.issue_s - origin, end - origin))
    return out


def gather_timeline(ctx: ParallelContext, events: Sequence[Event], **meta: Any) -> Timeline:
    """Every pipeline rank's ``events`` as one :class:`Timeline` on every rank (collective over ``ctx.group("pp")``).

    Events travel as float64 rows ``(kind, stage, mb, start, end)``: one all-gather of the
    counts, one of the rows padded to the longest.
    """
    group, p = ctx.group("pp"), ctx.pp_size
    rows = torch.tensor([[KINDS.index(e.kind), e.stage, e.mb, e.start, e.end] for e in events],
                        dtype=torch.float64, device=ctx.device).reshape(-1, 5)
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=ctx.device)
    counts = [torch.zeros_like(count) for _ in range(p)]
    ctx.comm.all_gather(counts, count, group=group, label="pp timeline")
    longest = max(int(c.item()) for c in counts)
    padded = torch.zeros((longest, 5), dtype=torch.float64, device=ctx.device)
    padded[:rows.shape[0]] = rows
    parts = [torch.zeros_like(padded) for _ in range(p)]
    ctx.comm.all_gather(parts, padded, group=group, label="pp timeline")
    per_rank = []
    for r, (part, c) in enumerate(zip(parts, counts)):
        per_rank.append([Event(r, KINDS[int(k)], int(s), int(mb), float(t0), float(t1))
                         for k, s, mb, t0, t1 in part[:int(c.item())].tolist()])
    return Timeline.merge(per_rank, **meta)
