"""Pipeline parallelism applied to a plain GPT from outside: a plan, its checks, and the pipelined model.

::

    plan = PipelinePlan(schedule="1f1b", microbatches=8)
    check_plan(plan, pp_size=4, n_layer=cfg.n_layer, batch_size=32)   # before any process starts
    pipe = apply_pipeline(GPT(cfg), ctx, plan)                          # on every rank
    loss = pipe.step(x, y)          # forward + backward of the whole batch; grads in pipe.parameters()

Every rank builds the same full GPT (same seed), :func:`apply_pipeline` cuts it into
``p x v`` virtual stages (:func:`~lslm.pipeline.partition.split_gpt`) and keeps the ones
the schedule puts on this rank; the stages share the GPT's parameters, so gradients land
in the GPT's own ``.grad`` and an optimizer over :meth:`PipelineModel.parameters` steps
exactly this rank's share. Stages whose schedule splits the backward (``I``/``W``) get
their linears swapped for :class:`~lslm.pipeline.split_backward.SplitLinear`.

**Tied embeddings** (GPT-2's ``lm_head.weight is wte.weight``) across pipeline ranks, as
Megatron-LM does it: the rank of the last stage keeps its *own copy* of the word embedding
as the head's weight, equal to the serial values, and after each step's backward the two
copies' gradients are summed between the rank of the first stage and the rank of the last
(Megatron's "embedding group"; :meth:`PipelineModel.sync_tied_grads`). Both copies then
hold the serial tied gradient, ``dL/dwte = (embedding's part) + (head's part)``, so two
identical optimizer steps keep them equal. When one rank holds both ends (DualPipeV's V,
or ``p = 1``) the tie simply stays, and nothing is exchanged.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lslm.data_parallel.grad_buffer import has_main_grad
from lslm.models.deferred_init import is_meta, materialize_
from lslm.models.gpt import GPT
from lslm.pipeline.executor import PipelineExecutor, gather_timeline
from lslm.pipeline.memory import PipelineMemory
from lslm.pipeline.partition import METHODS, GPTStage, partition_units, split_gpt, stage_parameters, unit_costs
from lslm.pipeline.split_backward import WeightGradStore, split_linears
from lslm.pipeline.stage import StageRuntime
from lslm.pipeline.timeline import Event, Timeline
from lslm.runtime.context import ParallelContext

__all__ = ["PipelineModel", "PipelinePlan", "apply_pipeline", "check_plan"]

LOSS_LABEL = "pp loss"
TIED_LABEL = "pp tied embedding grad"


@dataclass
class PipelinePlan:
    """How to pipeline: the schedule, ``microbatches`` (m), ``virtual_stages`` per rank (v), the partition method
    (:data:`~lslm.pipeline.partition.METHODS`), rematerialisation, output deallocation, and what to record."""

    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 1
    partition: str = "layers"
    remat: bool = False
    deallocate_outputs: bool = True
    record_timeline: bool = False
    track_memory: bool = False


def check_plan(plan: PipelinePlan, pp_size: int, n_layer: int, batch_size: int) -> None:
    """Raise ``ValueError`` (before any process starts) when ``plan`` cannot run on ``pp_size`` pipeline ranks with
    an ``n_layer``-block GPT and ``batch_size`` rows per pipeline (per data-parallel replica)."""
    from lslm.pipeline.schedules import check_schedule_config

    for name in ("microbatches", "virtual_stages"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"PipelinePlan.{name} must be a positive int, got {value!r}")
    if plan.partition not in METHODS:
        raise ValueError(f"unknown partition method {plan.partition!r}; choose one of {METHODS}")
    stages = pp_size * plan.virtual_stages
    if stages > n_layer:
        raise ValueError(f"{pp_size} pipeline ranks x {plan.virtual_stages} virtual stages = {stages} stages, but "
                         f"the model has {n_layer} blocks; every stage needs at least one (use fewer stages or a "
                         f"deeper model)")
    if batch_size % plan.microbatches:
        raise ValueError(f"a batch of {batch_size} rows does not split into {plan.microbatches} equal micro-batches; "
                         f"choose microbatches dividing {batch_size}")
    check_schedule_config(plan.schedule, pp_size, plan.microbatches, plan.virtual_stages, num_layers=n_layer)


class PipelineModel:
    """This rank's part of a pipelined GPT; :meth:`step` runs one forward + backward of a batch by the schedule."""

    def __init__(self, model: GPT, ctx: ParallelContext, plan: PipelinePlan, schedule: Any,
                 stages: dict[int, GPTStage], *, tied: bool = False) -> None:
        self.model, self.ctx, self.plan, self.schedule, self.stages = model, ctx, plan, schedule, stages
        # Tied embedding split over two ranks (``tied``): the pipeline rank at the other end and this rank's copy
        # (taken before split_linears may wrap the head).
        self.tied_peer: int | None = None
        self.tied_param: nn.Parameter | None = None
        first, last = schedule.stage_to_rank[0], schedule.stage_to_rank[-1]
        if tied and ctx.pp_rank in (first, last):
            self.tied_peer = last if ctx.pp_rank == first else first
            self.tied_param = model.wte.weight if ctx.pp_rank == first else model.lm_head.weight
        self.num_stages = len(schedule.stage_to_rank)
        self.memory = PipelineMemory(model.parameters()) if plan.track_memory else None
        actions = schedule.actions(ctx.pp_rank)
        split = {a.stage for a in actions if a.kind in ("I", "W")}
        self.stores: dict[int, WeightGradStore] = {}
        for s in sorted(split):
            self.stores[s] = WeightGradStore()
            split_linears(stages[s], self.stores[s])
        loss_fn = _tensor_parallel_loss(model, ctx)
        self.runtimes = {s: StageRuntime(m, ctx.device, remat=plan.remat, store=self.stores.get(s),
                                         memory=self.memory, loss_fn=loss_fn, tracker=ctx.rng)
                         for s, m in stages.items()}
        self.executor = PipelineExecutor(ctx, actions, self.runtimes, schedule.stage_to_rank,
                                         deallocate_outputs=plan.deallocate_outputs, memory=self.memory)
        self.last_timeline: list[Event] = []
        self.last_memory: dict[str, Any] = {}

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (every stage it holds), each once."""
        return (p for _, p in stage_parameters(self.stages))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name in the GPT, parameter)`` for :meth:`parameters`."""
        return stage_parameters(self.stages)

    def step(self, x: torch.Tensor, y: torch.Tensor, *, loss_scale: float = 1.0,
             sync_grads: bool = True) -> torch.Tensor:
        """Forward and backward of this replica's batch ``x`` -> ``y`` (token ids, ``(B, T)``) by the schedule.

        The batch splits into ``m`` micro-batches on dim 0; micro-batch losses (mean cross-entropy
        over its tokens) are weighted ``loss_scale / m`` for the backward, so the gradients are those
        of ``loss_scale`` x the batch mean. Gradients accumulate into this rank's parameters (zero them
        yourself). With ``dp > 1`` and ``sync_grads``, each stage's gradients are averaged over
        ``ctx.group("dp")`` right after this rank's last backward of that stage. Returns the batch's
        mean loss (``loss_scale`` not applied), the same on every pipeline rank.
        """
        ctx, m = self.ctx, self.plan.microbatches
        # Checked before any communication (every rank gets the same value, so every rank raises):
        # a negative scale would run gradient ascent and NaN would leave NaN gradients, silently.
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, numbers.Real) or not (
                math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"loss_scale must be a finite number > 0 (the factor on every micro-batch's loss "
                             f"before backward; 1.0 for none), got {loss_scale!r}")
        if x.dim() != 2 or x.shape != y.shape:
            raise ValueError(f"x and y must be token ids of one shape (batch, time), got {tuple(x.shape)} and "
                             f"{tuple(y.shape)}")
        if x.shape[0] % m:
            raise ValueError(f"a batch of {x.shape[0]} rows does not split into {m} micro-batches")
        # A copy per micro-batch: chunks would share the batch's storage, which memory accounting charges once.
        xs = [c.to(ctx.device).clone() for c in x.chunk(m)]
        ys = [c.to(ctx.device).clone() for c in y.chunk(m)]
        origin = 0.0
        if self.plan.record_timeline:
            # Align the ranks' clocks on one moment: right after a barrier.
            ctx.comm.barrier(group=ctx.group("pp"), label="pp timeline sync")
            origin = time.perf_counter()
        result = self.executor.run(xs, ys, loss_scale / m, sync_grads=sync_grads,
                                   record=self.plan.record_timeline, origin=origin)
        if sync_grads:
            self.sync_tied_grads()
        loss = torch.zeros(1, device=ctx.device, dtype=torch.float32)
        if result.loss_sum is not None:
            loss += result.loss_sum.float() / m
        last = ctx.group_ranks("pp")[self.schedule.stage_to_rank[self.num_stages - 1]]
        ctx.comm.broadcast(loss, src=last, group=ctx.group("pp"), label=LOSS_LABEL)
        self.last_timeline = result.events
        self.last_memory = result.memory or {}
        return loss[0]

    def sync_tied_grads(self) -> None:
        """Sum the tied embedding's gradient over its two copies (first stage's ``wte``, last stage's head).

        Megatron all-reduces it over an "embedding group" of the first and last pipeline
        rank; a group of two is exactly one exchange, so here it is one paired send/receive
        (``batch_isend_irecv``, both works waited) and an add, with no extra process group to
        create. ``a + b`` and ``b + a`` round alike, so both copies stay bit-identical. Called
        by :meth:`step` when ``sync_grads`` (after the data-parallel average: both are sums,
        so the order changes nothing); with accumulation, the last step sums the accumulated
        gradients. A no-op on ranks that hold neither end, or both.
        """
        if self.tied_peer is None or self.tied_param is None:
            return
        p, ctx = self.tied_param, self.ctx
        if has_main_grad(p):
            grad = p.main_grad
        else:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
        theirs = torch.empty_like(grad)
        peer = ctx.group_ranks("pp")[self.tied_peer]
        ops = [dist.P2POp(dist.isend, grad.contiguous(), peer, group=ctx.pp_group),
               dist.P2POp(dist.irecv, theirs, peer, group=ctx.pp_group)]
        for work in ctx.comm.batch_isend_irecv(ops, label=TIED_LABEL):
            work.wait()
        grad.add_(theirs)

    def gather_timeline(self) -> Timeline:
        """The last step's events of every pipeline rank (collective over ``ctx.group("pp")``; needs
        ``plan.record_timeline``)."""
        if not self.plan.record_timeline:
            raise ValueError("no timeline recorded: set PipelinePlan(record_timeline=True)")
        s = self.schedule
        return gather_timeline(self.ctx, self.last_timeline, schedule=s.name, num_microbatches=s.num_microbatches,
                               stages_per_rank=s.stages_per_rank)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _tensor_parallel_loss(model: GPT, ctx: ParallelContext) -> LossFn | None:
    """The last stage's loss of a tensor-parallel GPT (its head gives this rank's vocabulary slice): the
    vocabulary-parallel cross-entropy, in fp32 as ``GPT.forward``; ``None`` (plain cross-entropy) otherwise."""
    info = getattr(model, "tensor_parallel", None)
    if info is None or info.tp == 1:
        return None
    from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits.float(), targets, ctx, vocab_size=info.vocab_size)
    return loss_fn


def _partition(model: GPT, ctx: ParallelContext, method: str, num_stages: int) -> list[tuple[int, int]]:
    costs = unit_costs(model, method)
    if method == "time":
        # Measured times differ by rank: average them so every rank cuts the model the same way.
        t = torch.tensor(costs, dtype=torch.float64, device=ctx.device)
        ctx.comm.all_reduce(t, label="pp partition costs")
        costs = (t / ctx.world_size).tolist()
    return partition_units(costs, num_stages)


def _untie(model: GPT, *, is_last: bool, is_first: bool, meta: bool) -> None:
    """Give the last stage's rank its own head weight, equal to the embedding's serial values (module doc).

    The first stage's rank keeps ``wte.weight`` (its head is not one of its stages). On the last
    stage's rank, a model with weights gets ``lm_head.weight`` as a copy; a model from the meta
    device already materialised the one tied tensor through the head, so the head keeps it and
    the unused embedding goes back to a shape-only meta tensor (no memory, no copy).

    The last stage's copy is marked ``shared`` (Megatron-LM's mark for the same copy): its
    gradient equals the first stage's after :meth:`PipelineModel.sync_tied_grads`, so a global
    norm counts it once, on the first stage (:func:`lslm.tensor_parallel.clip.counts_in_norm`).
    Other marks (``tensor_model_parallel`` on a vocabulary-parallel head) are kept.
    """
    shared = model.wte.weight
    if is_last and not is_first:
        if meta:
            model.wte.weight = nn.Parameter(torch.empty_like(shared, device="meta"),  # lslm: cpu-ok (shapes only)
                                            requires_grad=shared.requires_grad)
        else:
            copy = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
            copy.__dict__.update(shared.__dict__)
            model.lm_head.weight = copy
        model.lm_head.weight.shared = True


def apply_pipeline(model: GPT, ctx: ParallelContext, plan: PipelinePlan, *, schedule: Any = None,
                   init_seed: int | None = None) -> PipelineModel:
    """Split ``model`` into the stages of ``plan``'s schedule over ``ctx``'s pipeline ranks; keep this rank's.

    ``schedule`` (optional) replaces ``build_schedule(plan.schedule, pp, m, v)``: any object with
    ``stage_to_rank``, ``actions(rank)``, ``name``, ``num_microbatches``, ``stages_per_rank`` (e.g. a
    hand-written list to try). This rank's stages move to ``ctx.device``. Raises ``ValueError`` for
    plans :func:`check_plan` rejects. Tied embedding/head weights whose stages sit on different ranks
    are untied into two copies whose gradients :meth:`PipelineModel.step` sums (module doc).

    A GPT built on the meta device needs ``init_seed`` (the seed the serial run builds it from):
    only this rank's stages are materialised, on ``ctx.device``, with exactly the serial weights
    (:func:`lslm.models.deferred_init.materialize_`); the other stages never take memory here.
    The ``"time"`` partition measures forwards, so it needs a model with weights. With tied weights
    the last stage's rank materialises the head from the same serial draw as the embedding. A model
    whose leaves this rank holds are already materialised (tensor parallelism applied from the meta
    device to this rank's stages only, :mod:`lslm.three_d`) needs no ``init_seed``: the other
    stages stay on the meta device.
    """
    meta = is_meta(model)
    if not meta and init_seed is not None:
        raise ValueError("init_seed is for a model built on the meta device; this model already holds weights")
    if meta and plan.partition == "time":
        raise ValueError("partition='time' times each layer's forward, which a model on the meta device cannot "
                         "run: build the model with weights, or partition by 'layers' or 'params'")
    if schedule is None:
        from lslm.pipeline.schedules import build_schedule

        # The batch size is known only at step(), which checks it; here any multiple of m passes.
        check_plan(plan, ctx.pp_size, len(model.blocks), batch_size=plan.microbatches)
        schedule = build_schedule(plan.schedule, ctx.pp_size, plan.microbatches, plan.virtual_stages)
    stage_to_rank = tuple(schedule.stage_to_rank)
    if getattr(schedule, "num_microbatches", plan.microbatches) != plan.microbatches:
        raise ValueError(f"the schedule has {schedule.num_microbatches} micro-batches, the plan "
                         f"{plan.microbatches}")
    if max(stage_to_rank) >= ctx.pp_size:
        raise ValueError(f"the schedule uses pipeline ranks up to {max(stage_to_rank)}, but pp={ctx.pp_size}")
    num_stages = len(stage_to_rank)
    tied = model.lm_head.weight is model.wte.weight and stage_to_rank[0] != stage_to_rank[-1]
    stages = split_gpt(model, num_stages, boundaries=_partition(model, ctx, plan.partition, num_stages))
    held_meta = any(p.is_meta for s, stage in enumerate(stages) if stage_to_rank[s] == ctx.pp_rank
                    for p in stage.parameters())
    if held_meta and init_seed is None:
        raise ValueError("the model is on the meta device (shapes only): pass init_seed=<the seed the serial run "
                         "builds it from> so that this rank materialises its stages with those weights")
    if held_meta:
        held = {id(m) for s, stage in enumerate(stages) if stage_to_rank[s] == ctx.pp_rank for m in stage.modules()}
        # A tied head is materialised with the embedding's serial values (one parameter, one draw).
        materialize_(model, ctx.device, seed=init_seed, keep=lambda name: id(model.get_submodule(name)) in held)
    if tied:
        _untie(model, is_last=ctx.pp_rank == stage_to_rank[-1], is_first=ctx.pp_rank == stage_to_rank[0], meta=meta)
    mine = {s: stage.to(ctx.device) for s, stage in enumerate(stages) if stage_to_rank[s] == ctx.pp_rank}
    return PipelineModel(model, ctx, plan, schedule, mine, tied=tied)
