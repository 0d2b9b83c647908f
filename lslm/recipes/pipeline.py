"""Pipeline-parallel training (GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV), optionally with data parallelism.

The GPT of :mod:`lslm.recipes.train`, cut by :func:`~lslm.pipeline.apply.apply_pipeline`
into ``pp x v`` stages (``v`` per rank): built on the meta device, each rank materialises
only its stages with the serial run's weights (except with ``--partition time``, which runs
the whole model's forwards to measure them); the
remaining ``dp = world / pp`` pipelines are data-parallel replicas. The harness
(:mod:`lslm.harness`) runs it::

    torchrun --nproc-per-node=2 -m lslm.recipes.pipeline --schedule 1f1b --steps 30 --out runs/pp.json
    python -m lslm.recipes.pipeline --nproc 4 --pp 4 --n-layer 8 --schedule interleaved --microbatches 8
    recipe.run(2, schedule="zb-h1", steps=10)                      # from a notebook

**One step** on every rank: ``zero_grad``; :meth:`PipelineModel.step` (the batch split into
``microbatches`` micro-batches, each micro-batch's loss weighted ``1/m``, forwards and
backwards in the schedule's order, activations and their gradients sent between stages,
each stage's gradients averaged over ``dp`` after its last backward); the global-norm
:func:`~lslm.tensor_parallel.clip.clip_grad_norm_` (pipeline ranks hold disjoint layers:
their squared norms add, one all-reduce over ``pp``); the baseline's AdamW on this rank's
parameters only.

**Same run as the serial baseline.** ``batch_size`` is the global batch; each replica gets
``batch_size / dp`` rows, dealt as the DDP and TP recipes deal them
(:class:`~lslm.data.sampler.BaselineOrderSampler`), and every pipeline rank of a replica
reads the same rows (the first stage needs the tokens, the last the targets). ``losses``
then reproduce ``lslm.recipes.train`` up to fp32 rounding (micro-batching adds per-micro-
batch gradients in another order than one batch mean).

**What is counted, per step and rank** (the comm ledger): ``pp_comm_bytes`` /
``pp_comm_calls`` are the point-to-point sends and receives between stages (activations
forward, their gradients backward), ``dp_comm_bytes`` the gradient averages, and
``other_comm_bytes`` the rest (the loss broadcast to every pipeline rank, the clip norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lslm.data.dataset import next_token_batches
from lslm.data_parallel.grad_sync import attach_grad_buffers
from lslm.harness import Built, Marks, Recipe, StepTimer, entry_points, option, recipe_main
from lslm.harness import summarize as summarize_run
from lslm.pipeline.apply import PipelinePlan, apply_pipeline, check_plan
from lslm.pipeline.p2p import is_p2p_label
from lslm.pipeline.partition import METHODS
from lslm.pipeline.schedules import SCHEDULES
from lslm.recipes.train import (
    TrainConfig,
    build_model,
    grad_buffer_dtype,
    precision_fields,
    prepare_training,
    replica_loader,
    step_flops,
)
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import resolve_sizes
from lslm.runtime.startup import run_then_exit
from lslm.tensor_parallel.clip import CLIP_LABEL, clip_grad_norm_

__all__ = ["RECIPE", "PipelineConfig", "build", "check_config", "compare", "main", "plan_of", "run",
           "worker"]


@dataclass
class PipelineConfig(TrainConfig):
    """A :class:`~lslm.recipes.train.TrainConfig` plus the pipeline settings.

    ``pp`` ranks hold consecutive stages; ``dp`` (default: the rest of the world) replicas
    split the global ``batch_size``. ``virtual_stages`` defaults to 2 for ``interleaved`` and
    ``dualpipev`` and 1 otherwise. Sizes that cannot work raise ``ValueError`` here or in
    :func:`check_config`, before any process starts.
    """

    device: str = option("auto", help="'auto': CUDA + NCCL with one GPU per rank, else CPU + gloo")
    pp: int = option(2, help="pipeline-parallel size (ranks that hold consecutive stages)", ge=1)
    dp: int | None = option(None, help="data-parallel size (default: world size / pp)", ge=1)
    schedule: str = option("1f1b", help="pipeline schedule", choices=SCHEDULES)
    microbatches: int = option(4, help="micro-batches per replica's batch (m)", ge=1)
    virtual_stages: int | None = option(None, help="stages per rank, v (default: 2 for interleaved and dualpipev, "
                                                   "else 1)", ge=1)
    partition: str = option("layers", help="how to balance the stages: equal blocks, parameters or measured time",
                            choices=METHODS)
    remat: bool = option(False, help="recompute each stage's forward in its backward (activation checkpointing)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.virtual_stages is None:
            self.virtual_stages = 2 if self.schedule in ("interleaved", "dualpipev") else 1
        if self.dp is not None and self.batch_size % self.dp:
            raise ValueError(f"global batch_size={self.batch_size} is not divisible by dp={self.dp} replicas")
        rows = self.batch_size // self.dp if self.dp is not None else None
        # The schedule, stage and micro-batch rules that do not depend on the world size.
        check_plan(plan_of(self), self.pp, self.n_layer, rows if rows is not None else self.microbatches)


def plan_of(cfg: PipelineConfig, **extra: Any) -> PipelinePlan:
    """The :class:`~lslm.pipeline.apply.PipelinePlan` of ``cfg`` (``extra``: e.g. ``record_timeline=True``)."""
    v = cfg.virtual_stages if cfg.virtual_stages is not None else 1
    return PipelinePlan(schedule=cfg.schedule, microbatches=cfg.microbatches, virtual_stages=v,
                        partition=cfg.partition, remat=cfg.remat, **extra)


def check_config(cfg: PipelineConfig, world_size: int) -> int:
    """Check that ``cfg`` runs on ``world_size`` processes; return the data-parallel size.

    Raises ``ValueError`` when ``pp`` (times ``dp``, if given) does not tile the world, the
    global batch does not split over the ``dp`` replicas, or a replica's rows do not split
    into ``microbatches`` (or the schedule refuses ``pp``, ``microbatches``, ``virtual_stages``
    or the number of layers: :func:`~lslm.pipeline.apply.check_plan`).
    """
    dp = resolve_sizes(world_size, pp=cfg.pp, dp=cfg.dp)["dp"]
    if cfg.batch_size % dp:
        raise ValueError(f"global batch_size={cfg.batch_size} is not divisible by dp={dp} replicas "
                         f"(= {world_size} processes / pp={cfg.pp}); use a multiple of {dp}")
    check_plan(plan_of(cfg), cfg.pp, cfg.n_layer, cfg.batch_size // dp)
    return dp


def build(cfg: PipelineConfig, ctx: ParallelContext) -> Built:
    """The pipeline technique on this rank: its stages, AdamW on their parameters, this replica's batches, the step."""
    dp = check_config(cfg, ctx.world_size)
    pctx = ctx.with_grid(pp=cfg.pp, dp=cfg.dp)
    # On the meta device, then only this rank's stages are materialised with the serial run's weights ("time"
    # partitioning runs forwards to measure them, so it needs the whole model built).
    meta = cfg.partition != "time"
    pipe = apply_pipeline(build_model(cfg, meta=meta), pctx, plan_of(cfg), init_seed=cfg.seed if meta else None)
    # This rank's stages as one module: what the optimizer, the clip and the memory report see.
    local = nn.ModuleList(pipe.stages[s] for s in sorted(pipe.stages))
    local.train()
    # One set of gradient buffers per stage: the executor averages a stage's buffers over dp as soon as this rank's
    # last backward of that stage is done. Then the baseline's AdamW on this rank's layers only (over fp32 masters in
    # half modes). Stages read their dtype from their parameters, so they send half activations.
    for s in sorted(pipe.stages):
        attach_grad_buffers(pipe.stages[s], pctx, dtype=grad_buffer_dtype(cfg))
    setup = prepare_training(local, cfg, ctx=pctx)
    optimizer = setup.optimizer

    loader = replica_loader(cfg, pctx.dp_rank, dp)
    ledger = pctx.comm.ledger
    traffic: dict[str, int] = {}

    def step(batch: tuple[torch.Tensor, torch.Tensor], timer: StepTimer) -> torch.Tensor:
        since = len(ledger.records)
        x, y = batch
        optimizer.zero_grad()
        # forwards, backwards (of the loss times the fp16 loss scale) and the dp gradient averages, in schedule order
        loss = pipe.step(x, y, loss_scale=optimizer.loss_scale)
        timer.mark("backward_end")
        stepped = optimizer.step(cfg.grad_clip if cfg.grad_clip > 0 else None,
                                 clip=lambda params, max_norm: clip_grad_norm_(params, max_norm, pctx))
        recs = ledger.snapshot()[since:]
        p2p = [r for r in recs if is_p2p_label(r.label)]
        dp_bytes = sum(r.nbytes for r in recs if r.label.startswith("pp dp grads"))
        clip_bytes = sum(r.nbytes for r in recs if r.label == CLIP_LABEL)
        traffic.update(pp_comm_bytes=sum(r.nbytes for r in p2p), pp_comm_calls=len(p2p), dp_comm_bytes=dp_bytes,
                       other_comm_bytes=sum(r.nbytes for r in recs) - sum(r.nbytes for r in p2p) - dp_bytes,
                       clip_comm_bytes=clip_bytes, **precision_fields(setup, stepped))
        return loss.detach()

    def per_step(m: Marks) -> dict[str, Any]:
        return {"pipeline_s": m.span("start", "backward_end"), "optimizer_s": m.span("backward_end", "end"),
                **traffic}

    def log(now: dict[str, Any]) -> str:
        return (f"  pp p2p {now['pp_comm_bytes']:,} B in {now['pp_comm_calls']} messages  "
                f"dp grads {now['dp_comm_bytes']:,} B")

    info = {"pp_size": cfg.pp, "dp_size": dp, "schedule": cfg.schedule, "microbatches": cfg.microbatches,
            "virtual_stages": cfg.virtual_stages, "stages": sorted(pipe.stages),
            "stage_units": {str(s): list(st.units) for s, st in sorted(pipe.stages.items())},
            "tokens_per_step": cfg.batch_size * cfg.block_size, "precision": cfg.precision}
    return Built(model=local, optimizer=optimizer, step=step, batches=next_token_batches(loader, pctx.device), ctx=pctx,
                 device=pctx.device, per_step=per_step, count=(None, None), log=log, info=info,
                 name=f"pp{cfg.pp}-dp{dp}-{cfg.schedule}",
                 flops=step_flops(cfg, "full" if cfg.remat else "none"))


RECIPE = Recipe("lslm.recipes.pipeline", PipelineConfig, build, check_config,
                "Pipeline-parallel (x data-parallel) training (run under torchrun, or pass --nproc).",
                grid=lambda cfg: {"pp": cfg.pp, "dp": cfg.dp})


worker, compare, run = entry_points(RECIPE)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Command line: under torchrun run this rank; otherwise launch ``--nproc`` ranks. Returns the records."""
    cfg, results = recipe_main(RECIPE, argv)
    first = results[0]
    if first["rank"] == 0:
        s = summarize_run(first)
        losses = first["losses"]
        print(f"pp={first['pp_size']} x dp={first['dp_size']} {cfg.schedule} (m={cfg.microbatches}, "
              f"v={cfg.virtual_stages}) on {first['world_size']} processes: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"over {cfg.steps} steps; rank 0 median step {s['step_ms']:.1f} ms; per step on rank 0 "
              f"{first['pp_comm_bytes'][-1]:,} B of stage-to-stage traffic, {first['dp_comm_bytes'][-1]:,} B of dp "
              f"gradients" + (f"; wrote {cfg.out}" if cfg.out else ""))
    return results


if __name__ == "__main__":
    run_then_exit(main)  # under torchrun: skip finalization (lslm.runtime.startup.exit_process)
