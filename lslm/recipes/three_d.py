"""3D-parallel training: tensor (+ sequence) parallelism inside pipeline stages, data parallelism or ZeRO-1 across.

The GPT of :mod:`lslm.recipes.train` over a ``pp x dp x tp`` grid (tp innermost:
:mod:`lslm.runtime.layout`), parallelised by :func:`lslm.three_d.apply_3d`: built on the meta
device, each rank materialises only its tp shards of its pipeline stages with the serial
run's weights. The harness (:mod:`lslm.harness`) runs it::

    python -m lslm.recipes.three_d --nproc 8 --dp 2 --tp 2 --pp 2 --schedule 1f1b --zero 1
    torchrun --nproc-per-node=8 -m lslm.recipes.three_d --tp 2 --pp 2 --sequence-parallel --steps 30
    recipe.run(8, tp=2, pp=2, schedule="interleaved", steps=10)             # from a notebook

**One step** on every rank: ``zero_grad``; :meth:`~lslm.three_d.ThreeDModel.step` (the
replica's rows in ``microbatches`` micro-batches by the schedule; the layers' tp collectives
inside each forward and backward; activations, or under ``--sequence-parallel`` their
sequence shards, sent to the same tp rank of the next stage; the sequence-parallel gradient
sum over tp; each stage's gradients averaged over dp after its last backward, and the tied
embedding's two ends summed; with ``--recompute selective|full`` each block's attention core or
whole forward runs again in its backward, :func:`lslm.tensor_parallel.recompute.apply_recompute`);
then the baseline's AdamW with the global-norm clip over ``tp x pp``, or with ``--zero 1``
:class:`~lslm.zero.optimizer.ZeroOptimizer` (``--zero 2`` at ``pp = 1``: gradients reduce-scattered during
backward, the sequence-parallel sum on the slices) (reduce-scatter over dp, the norm over
``dp x tp x pp``, this rank's slice stepped, all-gather).

**Same run as the serial baseline**: ``batch_size`` is the global batch, each replica gets
``batch_size / dp`` rows dealt as the DDP, TP and pipeline recipes deal them, and every rank
of a replica reads the same rows; ``losses`` reproduce ``lslm.recipes.train`` up to fp32
rounding (tests/test_recipe_three_d.py).

**What is counted, per step and rank** (the comm ledger): ``pp_comm_bytes`` (stage-to-stage
sends and receives), ``dp_comm_bytes`` (the per-stage gradient averages, or ZeRO's
reduce-scatter and all-gather), ``tp_comm_bytes`` (everything else inside the tp group:
the layers' collectives, the loss, the sequence-parallel sum) and ``other_comm_bytes`` (the
loss broadcast over pp, the clip norm, the tied embedding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lslm.data.dataset import next_token_batches
from lslm.data_parallel.grad_sync import attach_grad_buffers
from lslm.harness import Built, Marks, Recipe, StepTimer, entry_points, option, recipe_main
from lslm.harness import summarize as summarize_run
from lslm.pipeline.p2p import is_p2p_label
from lslm.recipes.pipeline import PipelineConfig, plan_of
from lslm.recipes.train import (
    adamw,
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
from lslm.tensor_parallel.recompute import RECOMPUTE_MODES, apply_recompute
from lslm.three_d import ZERO_STAGES, ThreeDPlan, apply_3d, check_3d
from lslm.zero.optimizer import GATHER_LABEL, REDUCE_SCATTER_LABEL, ZeroOptimizer

__all__ = ["RECIPE", "ThreeDConfig", "build", "check_config", "compare", "main", "plan3d_of", "run", "worker"]


@dataclass
class ThreeDConfig(PipelineConfig):
    """A :class:`~lslm.recipes.pipeline.PipelineConfig` plus tensor parallelism inside the stages and ZeRO.

    ``tp`` ranks split every layer, ``pp`` ranks hold consecutive stages, and ``dp`` (default:
    the rest of the world) replicas split the global batch. Sizes that cannot work raise
    ``ValueError`` here or in :func:`check_config`, before any process starts.
    """

    tp: int = option(2, help="tensor-parallel size (ranks that split every layer, innermost)", ge=1)
    sequence_parallel: bool = option(False, help="split LayerNorm regions and stage-to-stage activations along "
                                                 "the sequence (Korthikanti et al. 2022)")
    zero: int = option(0, help="0: average gradients over dp; 1: ZeRO-1 (optimizer states sharded over dp); 2: "
                               "ZeRO-2 (+ gradients; without pipeline stages, pp = 1)",
                       choices=ZERO_STAGES)
    recompute: str = option("none", help="activation recomputation per block: 'selective' (the attention core) or "
                                         "'full' (the whole block), Korthikanti et al. 2022 §5",
                            choices=RECOMPUTE_MODES)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.precision != "fp32" and self.zero:
            raise ValueError("--zero runs in fp32 here (its half-precision modes own the cast); use --zero 0")
        # The rules that do not depend on the world size (dp unknown yet: checked again by check_config).
        check_3d(plan3d_of(self), tp=self.tp, pp=self.pp, dp=self.dp or 1, n_layer=self.n_layer,
                 n_head=self.n_head, n_embd=self.n_embd, block_size=self.block_size, batch_size=self.batch_size,
                 vocab_size=self.vocab_size)


def plan3d_of(cfg: ThreeDConfig) -> ThreeDPlan:
    """The :class:`~lslm.three_d.ThreeDPlan` of ``cfg``."""
    return ThreeDPlan(plan_of(cfg), sequence_parallel=cfg.sequence_parallel, zero=cfg.zero)


def check_config(cfg: ThreeDConfig, world_size: int) -> int:
    """Check that ``cfg`` runs on ``world_size`` processes; return the data-parallel size.

    Raises ``ValueError`` when ``tp x pp`` (times ``dp``, if given) does not tile the world, or
    the batch, heads or sequence do not split (:func:`~lslm.three_d.check_3d`).
    """
    dp = resolve_sizes(world_size, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)["dp"]
    check_3d(plan3d_of(cfg), tp=cfg.tp, pp=cfg.pp, dp=dp, n_layer=cfg.n_layer, n_head=cfg.n_head,
             n_embd=cfg.n_embd, block_size=cfg.block_size, batch_size=cfg.batch_size, vocab_size=cfg.vocab_size)
    return dp


def _is_dp(label: str) -> bool:
    return label.startswith("pp dp grads") or label in (REDUCE_SCATTER_LABEL, GATHER_LABEL)


def build(cfg: ThreeDConfig, ctx: ParallelContext) -> Built:
    """The 3D technique on this rank: its tp shards of its stages, the optimizer, this replica's batches, the step."""
    dp = check_config(cfg, ctx.world_size)
    gctx = ctx.with_grid(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    tdp = apply_3d(build_model(cfg, meta=True), gctx, plan3d_of(cfg), init_seed=cfg.seed)
    local = tdp.local
    local.train()
    for stage in local:  # the stages' blocks, after tensor parallelism (its dropout streams are on gctx.rng)
        apply_recompute(stage, cfg.recompute, gctx)
    clip = cfg.grad_clip if cfg.grad_clip > 0 else None
    if cfg.zero:
        optimizer: Any = ZeroOptimizer(local, adamw(list(local.parameters()), cfg), gctx, stage=cfg.zero)

        def optimizer_step() -> dict[str, float]:
            optimizer.step(clip)
            return {"loss_scale": 1.0, "stepped": 1.0}
    else:
        for stage in local:  # one set of buffers per stage: the executor averages each after its last backward
            attach_grad_buffers(stage, gctx, dtype=grad_buffer_dtype(cfg))
        setup = prepare_training(local, cfg, ctx=gctx)
        optimizer = setup.optimizer

        def optimizer_step() -> dict[str, float]:
            return precision_fields(setup, optimizer.step(clip, clip=tdp.clip_grad_norm_))

    loader = replica_loader(cfg, gctx.dp_rank, dp)
    ledger = gctx.comm.ledger
    traffic: dict[str, Any] = {}

    def step(batch: tuple[torch.Tensor, torch.Tensor], timer: StepTimer) -> torch.Tensor:
        since = len(ledger.records)
        x, y = batch
        optimizer.zero_grad()
        loss = tdp.step(x, y, loss_scale=optimizer.loss_scale)
        timer.mark("backward_end")
        figures = optimizer_step()
        recs = ledger.snapshot()[since:]
        p2p = sum(r.nbytes for r in recs if is_p2p_label(r.label))
        dp_bytes = sum(r.nbytes for r in recs if _is_dp(r.label))
        tp_bytes = sum(r.nbytes for r in recs if r.axis == "tp")  # the group of the ranks differing only in tp
        traffic.update(pp_comm_bytes=p2p, dp_comm_bytes=dp_bytes, tp_comm_bytes=tp_bytes,
                       other_comm_bytes=sum(r.nbytes for r in recs) - p2p - dp_bytes - tp_bytes, **figures)
        return loss.detach()

    def per_step(m: Marks) -> dict[str, Any]:
        return {"pipeline_s": m.span("start", "backward_end"), "optimizer_s": m.span("backward_end", "end"),
                **traffic}

    def log(now: dict[str, Any]) -> str:
        return (f"  tp {now['tp_comm_bytes']:,} B  pp p2p {now['pp_comm_bytes']:,} B  "
                f"dp {now['dp_comm_bytes']:,} B")

    info = {"tp_size": cfg.tp, "pp_size": cfg.pp, "dp_size": dp, "schedule": cfg.schedule, "zero": cfg.zero,
            "sequence_parallel": cfg.sequence_parallel, "microbatches": cfg.microbatches,
            "virtual_stages": cfg.virtual_stages, "stages": sorted(tdp.pipe.stages), "coords": gctx.coords._asdict(),
            "tokens_per_step": cfg.batch_size * cfg.block_size, "precision": cfg.precision,
            "recompute": cfg.recompute}
    name = f"dp{dp}-tp{cfg.tp}-pp{cfg.pp}-{cfg.schedule}-zero{cfg.zero}" + ("-sp" if cfg.sequence_parallel else "")
    return Built(model=local, optimizer=optimizer, step=step, batches=next_token_batches(loader, gctx.device),
                 ctx=gctx, device=gctx.device, per_step=per_step, count=(None, None), log=log, info=info, name=name,
                 flops=step_flops(cfg, cfg.recompute))


RECIPE = Recipe("lslm.recipes.three_d", ThreeDConfig, build, check_config,
                "3D-parallel training: TP (+SP) inside pipeline stages, DP or ZeRO-1 across, ZeRO-2 at pp = 1 "
                "(torchrun, or --nproc).",
                grid=lambda cfg: {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp})


worker, compare, run = entry_points(RECIPE)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Command line: under torchrun run this rank; otherwise launch ``--nproc`` ranks. Returns the records."""
    cfg, results = recipe_main(RECIPE, argv)
    first = results[0]
    if first["rank"] == 0:
        s = summarize_run(first)
        losses = first["losses"]
        print(f"dp={first['dp_size']} x tp={first['tp_size']} x pp={first['pp_size']} {cfg.schedule} "
              f"(m={cfg.microbatches}, v={cfg.virtual_stages}, zero={cfg.zero}"
              f"{', sp' if cfg.sequence_parallel else ''}) on {first['world_size']} processes: loss {losses[0]:.3f} "
              f"-> {losses[-1]:.3f} over {cfg.steps} steps; rank 0 median step {s['step_ms']:.1f} ms; per step on "
              f"rank 0 {first['tp_comm_bytes'][-1]:,} B tp, {first['pp_comm_bytes'][-1]:,} B stage-to-stage, "
              f"{first['dp_comm_bytes'][-1]:,} B dp" + (f"; wrote {cfg.out}" if cfg.out else ""))
    return results


if __name__ == "__main__":
    run_then_exit(main)  # under torchrun: skip finalization (lslm.runtime.startup.exit_process)
