"""3D parallelism: tensor (+ sequence) parallelism inside pipeline stages, data parallelism (or ZeRO-1) across.

One :class:`~lslm.runtime.context.ParallelContext` over the grid ``pp x dp x cp x tp``
(cp = 1 here) and a plain GPT, parallelised from outside in two moves::

    tdp = apply_3d(model, ctx, ThreeDPlan(PipelinePlan("1f1b", microbatches=4), sequence_parallel=True),
                   init_seed=seed)               # a GPT built on the meta device
    loss = tdp.step(x, y)                       # forward + backward by the schedule, every gradient reduced
    optimizer.step(...)                         # over tdp.parameters(); clip with tdp.clip_grad_norm_

1. :func:`~lslm.tensor_parallel.apply.apply_tensor_parallel` swaps the GPT's layers for
   Megatron's column/row/vocabulary-parallel ones over ``ctx.group("tp")``;
2. :func:`~lslm.pipeline.apply.apply_pipeline` cuts the tensor-parallel GPT into the schedule's
   stages over ``ctx.group("pp")`` and keeps this rank's.

The order is Megatron-LM's (and torchtitan's: TP is applied to each stage's modules before the
pipeline schedule drives them): a pipeline stage is a view of the GPT's own modules, so the
stages hold the tensor-parallel layers and nothing in the pipeline needs to know about them,
except three things it reads from the model:

* **what crosses a stage boundary**: without sequence parallelism the full ``(b, T, C)``
  hidden state, replicated on the tp ranks; with it, the rank's sequence shard, sequence-first,
  ``(T / t, b, C)`` (:meth:`~lslm.pipeline.partition.GPTStage.hidden_shape`). Each tp rank of
  stage ``s`` sends to the *same* tp rank of stage ``s + 1``: the pipeline group of a rank is the
  ranks that differ from it only in ``pp`` (``ctx.group_ranks("pp")``), so the p2p peers of the
  executor are right with no change;
* **the loss**: the head gives this rank's vocabulary slice, so the last stage uses the
  vocabulary-parallel cross-entropy (an all-reduce over tp inside it);
* **the tied embedding**: the first stage's ``wte`` slice ``(V/t, C)`` and the last stage's
  copy are summed between the same tp rank of the two ends.

**Which gradient is reduced over which group** (every one a sum the serial run does in one process):

=====================================  ===============================================
parameters                             reduction
=====================================  ===============================================
sharded over tp (column/row/vocab)     none over tp (each rank's slice is its own)
replicated under SP (LayerNorms,       sum over ``tp`` (each rank saw ``T / t`` positions;
row-parallel biases, positions)        Korthikanti et al. 2022, §4.2.2)
every parameter                        mean over ``dp`` (replicas saw different rows):
                                       the executor's per-stage average on the gradient
                                       buffers, or ZeRO-1's reduce-scatter at the step
tied embedding, first/last stage       sum between the two ends (same tp, same dp coords)
the global norm for clipping           sum of squares over ``tp x pp`` (replicated
                                       parameters and the tied copy counted once), and
                                       ``dp`` too under ZeRO (each rank holds a slice)
=====================================  ===============================================

**Memory at start**: with a GPT on the meta device and ``init_seed``, the serial build is
replayed leaf by leaf and this rank keeps only its tp shards of its pipeline stages' leaves
(:mod:`lslm.models.deferred_init`): neither the whole model nor a whole stage ever exists here.

**ZeRO.** ``zero=1`` leaves the data-parallel reduction to
:class:`~lslm.zero.optimizer.ZeroOptimizer` (stage 1 over ``ctx.group("dp")`` on this rank's stages'
parameters): :meth:`ThreeDModel.step` then skips the executor's average and sums the tied
embedding itself, and the optimizer reduce-scatters, clips over ``dp x tp x pp`` and all-gathers.
Its one buffer holds the sequence-parallel parameters too; their sum over tp runs on their
views before the step (:func:`~lslm.tensor_parallel.grads.sync_sequence_parallel_grads`).
``zero=2`` composes with tensor (and sequence) parallelism but not with pipeline stages: it
reduce-scatters each bucket during the backward of every micro-batch, before a pipeline's tied
embedding could be summed between its two ends. DeepSpeed's pipeline engine refuses the same
("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"), and Megatron-LM's distributed
optimizer, the layout it shards under pipelines, is ZeRO-1's shape. At ``pp = 1`` the only sum
left is sequence parallelism's over tp, and the optimizer runs it on its gradient slices (the tp
ranks of one dp coordinate hold the same layout, so the same elements). ZeRO-3 composes with
neither (it gathers whole units around a forward that tensor-parallel layers and pipeline stages
split): that is FSDP2 over DTensor's territory (the torch-native run of notebook 09).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lslm.models.deferred_init import is_meta
from lslm.models.gpt import GPT
from lslm.pipeline.apply import PipelineModel, PipelinePlan, apply_pipeline, check_plan
from lslm.pipeline.partition import split_gpt
from lslm.pipeline.schedules import build_schedule
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.clip import clip_grad_norm_
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

__all__ = ["ZERO_STAGES", "ThreeDModel", "ThreeDPlan", "apply_3d", "check_3d", "stage_module_names"]

#: The ZeRO stages that compose with tensor and pipeline parallelism here (0: plain data-parallel averaging;
#: 2 without pipeline stages only, see the module doc).
ZERO_STAGES = (0, 1, 2)


@dataclass
class ThreeDPlan:
    """How to parallelise inside the grid: the pipeline plan, sequence parallelism, and the ZeRO stage over dp."""

    pipeline: PipelinePlan = field(default_factory=PipelinePlan)
    sequence_parallel: bool = False
    zero: int = 0


def check_3d(plan: ThreeDPlan, *, tp: int, pp: int, dp: int, n_layer: int, n_head: int, n_embd: int,
             block_size: int, batch_size: int, vocab_size: int) -> None:
    """Raise ``ValueError`` (before any process starts) when ``plan`` cannot run on a ``pp x dp x tp`` grid.

    ``batch_size`` is the global batch (split over ``dp`` replicas, then into micro-batches).
    """
    if plan.zero not in ZERO_STAGES:
        raise ValueError(f"zero={plan.zero!r}: 3D parallelism here runs ZeRO stages {ZERO_STAGES} (0 = plain "
                         "data-parallel averaging); stage 3 gathers whole units around a forward that tensor-"
                         "parallel layers and pipeline stages split (module doc)")
    if plan.zero == 2 and pp > 1:
        raise ValueError(f"zero=2 with pp={pp}: ZeRO-2 reduce-scatters every micro-batch's gradients during its "
                         "backward, before a pipeline's tied embedding could be summed between its ends (DeepSpeed's "
                         "pipeline engine refuses it too); use zero=1 with pipeline stages, or pp=1")
    if plan.pipeline.partition != "layers":
        raise ValueError(f"partition={plan.pipeline.partition!r}: with tensor parallelism the stages are cut by "
                         "equal blocks ('layers'), the same on every tp rank whatever its shards")
    if n_head % tp:
        raise ValueError(f"{n_head} attention heads do not split over tp={tp}; choose tp dividing {n_head}")
    if n_embd * 4 % tp:
        raise ValueError(f"the MLP width {4 * n_embd} does not split over tp={tp}")
    if plan.sequence_parallel and block_size % tp:
        raise ValueError(f"sequence parallelism splits each sequence of {block_size} tokens over tp={tp}: "
                         f"choose a block_size divisible by {tp}")
    if batch_size % dp:
        raise ValueError(f"global batch_size={batch_size} is not divisible by dp={dp} replicas")
    del vocab_size  # any vocabulary works: the vocabulary-parallel layers pad it to a multiple of tp
    check_plan(plan.pipeline, pp, n_layer, batch_size // dp)


def stage_module_names(model: GPT, ctx: ParallelContext, plan: PipelinePlan) -> set[str]:
    """Names (in ``model``) of the modules of this pipeline rank's stages under ``plan``'s schedule.

    The same cut :func:`~lslm.pipeline.apply.apply_pipeline` makes (equal blocks per stage), computed
    on the plain model before tensor parallelism, so only these leaves are materialised.
    """
    schedule = build_schedule(plan.schedule, ctx.pp_size, plan.microbatches, plan.virtual_stages)
    stages = split_gpt(model, len(schedule.stage_to_rank), method=plan.partition)
    held = {id(m) for s, stage in enumerate(stages) if schedule.stage_to_rank[s] == ctx.pp_rank
            for m in stage.modules()}
    return {name for name, m in model.named_modules() if id(m) in held}


class ThreeDModel:
    """This rank's share of a 3D-parallel GPT: its pipeline stages, whose layers are tensor-parallel."""

    def __init__(self, pipe: PipelineModel, ctx: ParallelContext, plan: ThreeDPlan) -> None:
        self.pipe, self.ctx, self.plan = pipe, ctx, plan
        #: This rank's stages as one module: what an optimizer, the clip and the memory report see.
        self.local = nn.ModuleList(pipe.stages[s] for s in sorted(pipe.stages))

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (its tp shards of its stages' parameters), each once."""
        return self.pipe.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name in the GPT, parameter)`` for :meth:`parameters`."""
        return self.pipe.named_parameters()

    def step(self, x: torch.Tensor, y: torch.Tensor, *, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of this replica's rows ``x -> y`` by the schedule; every gradient reduced as the
        module doc's table says (the data-parallel part left to ZeRO when ``plan.zero``). Returns the mean loss
        of the replica's rows, the same on every rank of the replica."""
        zero = self.plan.zero > 0
        loss = self.pipe.step(x, y, loss_scale=loss_scale, sync_grads=not zero)
        if zero:
            self.pipe.sync_tied_grads()  # the executor's dp average is skipped: ZeRO reduce-scatters at its step
        sync_tensor_parallel_grads(self.local, self.ctx)
        return loss

    def clip_grad_norm_(self, params: Any, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over ``tp x pp`` (replicated parameters and the tied copy once); the
        ``clip=`` callback of the precision optimizers. Under ZeRO its optimizer clips itself."""
        return clip_grad_norm_(params, max_norm, self.ctx)


def apply_3d(model: GPT, ctx: ParallelContext, plan: ThreeDPlan, *, init_seed: int | None = None) -> ThreeDModel:
    """Make ``model`` tensor-parallel over ``ctx``'s tp group, then pipeline it over its pp group (module doc).

    ``model``: a plain GPT with weights (the same on every rank), or on the meta device with
    ``init_seed`` (the seed the serial run builds it from): each rank then materialises only its
    tp shards of its stages. Gradient buffers are not attached here: attach one set per stage
    (:func:`lslm.data_parallel.grad_sync.attach_grad_buffers`) for plain data parallelism, or let
    :class:`~lslm.zero.optimizer.ZeroOptimizer` attach its own.
    """
    cfg = model.config
    check_3d(plan, tp=ctx.tp_size, pp=ctx.pp_size, dp=ctx.dp_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
             n_embd=cfg.n_embd, block_size=cfg.block_size, batch_size=plan.pipeline.microbatches * ctx.dp_size,
             vocab_size=cfg.vocab_size)
    if ctx.cp_size > 1:
        raise ValueError(f"cp={ctx.cp_size}: context parallelism is not part of this 3D composition; use cp=1")
    meta = is_meta(model)
    if meta and init_seed is None:
        raise ValueError("the model is on the meta device (shapes only): pass init_seed=<the seed the serial run "
                         "builds it from>")
    if ctx.tp_size > 1:
        keep = None
        if meta:
            names = stage_module_names(model, ctx, plan.pipeline)
            keep = names.__contains__
        apply_tensor_parallel(model, ctx, sequence_parallel=plan.sequence_parallel, init_seed=init_seed, keep=keep)
        init_seed = None  # this rank's stages are materialised now; the others stay on the meta device
    pipe = apply_pipeline(model, ctx, plan.pipeline, init_seed=init_seed)
    return ThreeDModel(pipe, ctx, plan)
