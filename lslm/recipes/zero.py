"""ZeRO data-parallel training (stages 1, 2 and 3), the model states partitioned over the ranks.

The GPT of :mod:`lslm.recipes.train`, built from the same seed on every rank; every rank is a
data-parallel replica (``dp`` = world size) and :class:`~lslm.zero.optimizer.ZeroOptimizer`
keeps AdamW's states and the fp32 master weights (stage 2: and the gradients; stage 3: and
the parameters, each block gathered just before its forward and its backward) only for this
rank's slice of the model. The harness (:mod:`lslm.harness`) runs it::

    torchrun --nproc-per-node=2 -m lslm.recipes.zero --stage 2 --steps 30 --out runs/zero.json
    python -m lslm.recipes.zero --nproc 2 --stage 1 --precision bf16   # launches the processes itself
    recipe.run(2, stage=2, steps=10)                                  # from a notebook

**One step** on every rank: ``zero_grad``; forward and backward of this rank's rows (stage 2
reduce-scatters gradient buckets during the backward); ``step``: the reduce-scatter (stage 1),
the fp16 overflow vote, the global-norm clip over slices, AdamW on this rank's pieces, the
all-gather of the updated parameters.

**Same run as the serial baseline.** ``batch_size`` is the global batch, dealt out as the DDP
recipe does (:class:`~lslm.data.sampler.BaselineOrderSampler`), so ``losses`` reproduce
``lslm.recipes.train`` up to fp32 rounding.

**Checkpoints.** ``--checkpoint-dir D --save-every k`` writes a sharded checkpoint
(:mod:`lslm.zero.checkpoint`) to ``D/stepNNNNNN`` every ``k`` steps; ``--resume`` loads the
latest complete one (at any number of processes: the shards are resharded by element
ranges), skips the batches already used and runs the remaining steps, which then equal those
of a run without the break. ``--crash-at-step`` makes the last rank SIGKILL itself, to try it.

**HSDP.** ``--dp-shard K`` splits the data axis into ``dp_replicate x dp_shard = (world / K) x K``
(:mod:`lslm.runtime.grid`): the states shard over ``K`` consecutive ranks and each rank's gradient
slices are all-reduced across the replicas at the step (:class:`~lslm.zero.optimizer.ZeroOptimizer`);
the losses are the same run's. Sharded checkpoints are not written under HSDP (refused before launch).

**What is counted, per step and rank** (the comm ledger): ``rs_bytes`` (gradient
reduce-scatters), ``ag_bytes`` (parameter all-gathers), ``replicate_bytes`` (HSDP's all-reduce of the
slices across replicas), ``other_comm_bytes`` (the clip's norm, the overflow vote).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lslm.data.dataset import next_token_batches
from lslm.data_parallel.grad_sync import resolve_grad_dtype
from lslm.harness import Built, Marks, Recipe, StepTimer, entry_points, option, recipe_main
from lslm.harness import summarize as summarize_run
from lslm.precision import PARAM_DTYPES
from lslm.precision.scaler import DynamicLossScaler
from lslm.recipes.train import TrainConfig, adamw, build_model, replica_loader, step_flops
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import check_dp_shard
from lslm.runtime.startup import run_then_exit
from lslm.zero.checkpoint import latest_checkpoint, load_zero, save_zero
from lslm.zero.optimizer import GATHER_LABEL, REDUCE_SCATTER_LABEL, REPLICATE_LABEL, STAGES, ZeroOptimizer

__all__ = ["RECIPE", "ZeroConfig", "build", "check_config", "compare", "main", "run", "worker"]


@dataclass
class ZeroConfig(TrainConfig):
    """A :class:`~lslm.recipes.train.TrainConfig` plus the ZeRO settings; every rank is a data-parallel replica."""

    device: str = option("auto", help="'auto': CUDA + NCCL with one GPU per rank, else CPU + gloo")
    stage: int = option(1, help="ZeRO stage: 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)",
                        choices=STAGES)
    keep_gathered: bool = option(False, help="stage 3: keep each block gathered from its forward to its backward "
                                             "(FSDP2's reshard_after_forward=False: 2 instead of 3 x the parameters "
                                             "moved per step, more memory)")
    dp_shard: int | None = option(None, help="HSDP: shard the states over this many consecutive ranks and replicate "
                                             "the shards over the rest (dp_replicate x dp_shard; default: all)", ge=1)
    bucket_cap_mb: float = option(25.0, help="MiB per gradient bucket (one reduce-scatter and all-gather each)", gt=0)
    offload: str | None = option(None, choices=(None, "cpu", "disk"), help="cpu: fp32 masters, optimizer states and "
                                 "the step in host memory (ZeRO-Offload); disk: those states in files under "
                                 "--offload-dir, streamed through memory in chunks during the step (ZeRO-Infinity)")
    offload_dir: str | None = option(None, help="--offload disk: a folder on a local disk for the states")
    checkpoint_dir: str | None = option(None, help="folder of sharded checkpoints, one sub-folder per saved step")
    save_every: int = option(0, help="save a sharded checkpoint every this many steps (0: never)", ge=0)
    resume: bool = option(False, help="continue from the latest complete checkpoint in --checkpoint-dir, at any "
                                      "number of processes")
    crash_at_step: int | None = option(None, help="the last rank kills itself (SIGKILL) after this step: to watch a "
                                                  "job die and --resume it", ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.offload == "disk" and not self.offload_dir:
            raise ValueError("--offload disk needs --offload-dir, a writable folder on a local disk")
        if (self.save_every or self.resume) and not self.checkpoint_dir:
            raise ValueError("--save-every and --resume need --checkpoint-dir (the folder of the checkpoints)")


def check_config(cfg: ZeroConfig, world_size: int) -> int:
    """Check that ``cfg`` runs on ``world_size`` processes; return the data-parallel size (the world size)."""
    shard = check_dp_shard(world_size, cfg.dp_shard)
    if shard < world_size and (cfg.save_every or cfg.resume):
        raise ValueError(f"--dp-shard {shard} < dp={world_size}: sharded checkpoints are not written under HSDP "
                         "(each replica would write the same shards); drop --save-every/--resume or --dp-shard")
    if cfg.batch_size % world_size:
        raise ValueError(f"global batch_size={cfg.batch_size} is not divisible by dp={world_size} replicas; use a "
                         f"multiple of {world_size}")
    return world_size


def build(cfg: ZeroConfig, ctx: ParallelContext) -> Built:
    """The ZeRO technique on this rank: the model, ZeroOptimizer over AdamW, this replica's batches, the step."""
    dp = check_config(cfg, ctx.world_size)
    if ctx.grid.dp_shard != check_dp_shard(dp, cfg.dp_shard):  # HSDP (or back from it, several runs in one launch)
        ctx = ctx.with_grid(dp_shard=cfg.dp_shard)
    # Stage 3 keeps only a slice of the parameters: build on the meta device and materialise just that slice of
    # the serial run's weights (lslm.models.deferred_init), so no rank ever holds the whole model.
    meta = cfg.stage == 3
    model = build_model(cfg, meta=meta)
    if not meta:
        model = model.to(ctx.device)
    model.train()
    dtype = PARAM_DTYPES[cfg.precision]
    scaler = DynamicLossScaler(init_scale=cfg.init_scale) if cfg.precision == "fp16" else None
    optimizer = ZeroOptimizer(model, adamw(list(model.parameters()), cfg), ctx, stage=cfg.stage, dtype=dtype,
                              scaler=scaler, grad_dtype=resolve_grad_dtype(cfg.grad_reduce_dtype, dtype),
                              bucket_cap_mb=cfg.bucket_cap_mb, reshard_after_forward=not cfg.keep_gathered,
                              offload=cfg.offload, offload_dir=cfg.offload_dir, init_seed=cfg.seed if meta else None)
    loader = replica_loader(cfg, ctx.dp_rank, dp)
    ledger = ctx.comm.ledger
    traffic: dict[str, float] = {}
    batches = next_token_batches(loader, ctx.device)
    first = 0
    if cfg.resume:
        latest = latest_checkpoint(cfg.checkpoint_dir)
        if latest is not None:
            first = int(load_zero(optimizer, latest)["step"])
            for _ in range(first):  # the data of the steps already taken: the same batches follow as without a break
                next(batches)
    done = [first]

    def step(batch: tuple[torch.Tensor, torch.Tensor], timer: StepTimer) -> torch.Tensor:
        since = len(ledger.records)
        x, y = batch
        optimizer.zero_grad()
        _, loss = model(x, y)
        timer.mark("forward_end")
        optimizer.backward(loss)
        timer.mark("backward_end")
        stepped = optimizer.step(cfg.grad_clip if cfg.grad_clip > 0 else None)
        recs = ledger.snapshot()[since:]
        rs = sum(r.nbytes for r in recs if r.label == REDUCE_SCATTER_LABEL)
        ag = sum(r.nbytes for r in recs if r.label == GATHER_LABEL)
        rep = sum(r.nbytes for r in recs if r.label == REPLICATE_LABEL)
        traffic.update(rs_bytes=rs, ag_bytes=ag, replicate_bytes=rep,
                       other_comm_bytes=sum(r.nbytes for r in recs) - rs - ag - rep,
                       loss_scale=float(optimizer.loss_scale), stepped=float(stepped),
                       offload_to_host_bytes=optimizer.offload_bytes["to_host"],
                       offload_to_device_bytes=optimizer.offload_bytes["to_device"],
                       disk_read_bytes=optimizer.disk.bytes_moved["from_disk"] if optimizer.disk else 0,
                       disk_write_bytes=optimizer.disk.bytes_moved["to_disk"] if optimizer.disk else 0)
        done[0] += 1
        if cfg.save_every and done[0] % cfg.save_every == 0:
            save_zero(optimizer, Path(cfg.checkpoint_dir) / f"step{done[0]:06d}", step=done[0])
        if cfg.crash_at_step is not None and done[0] == cfg.crash_at_step + 1 and ctx.rank == ctx.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a node lost mid-run: no clean-up, no goodbye
        return loss.detach()

    def per_step(m: Marks) -> dict[str, Any]:
        return {"compute_s": m.span("start", "backward_end"), "optimizer_s": m.span("backward_end", "end"),
                **traffic}

    def log(now: dict[str, Any]) -> str:
        return f"  reduce-scatter {now['rs_bytes']:,} B  all-gather {now['ag_bytes']:,} B"

    layout = optimizer.layout
    info = {"num_parameters": sum(int(torch.Size(sh).numel()) for sh in optimizer.shapes), "dp_size": dp,
            "dp_shard": optimizer.world, "dp_replicate": optimizer.replicas,
            "stage": cfg.stage, "precision": cfg.precision, "owned_params": layout.param_numel,
            "padded_numel": optimizer.numel, "bucket_numels": [z - a for a, z, _, _ in optimizer.buckets],
            "tokens_per_step": cfg.batch_size * cfg.block_size}
    name = f"zero{cfg.stage}-dp{dp}" + (f"-shard{optimizer.world}" if optimizer.replicas > 1 else "")
    return Built(model=model, optimizer=optimizer, step=step, batches=batches, ctx=ctx, device=ctx.device,
                 per_step=per_step, count=(None, None), log=log, info=info, name=name,
                 first_step=first, flops=step_flops(cfg))


RECIPE = Recipe("lslm.recipes.zero", ZeroConfig, build, check_config,
                "ZeRO data-parallel training, stage 1, 2 or 3 (run under torchrun, or pass --nproc).",
)


worker, compare, run = entry_points(RECIPE)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Command line: under torchrun run this rank; otherwise launch ``--nproc`` ranks. Returns the records."""
    cfg, results = recipe_main(RECIPE, argv)
    first = results[0]
    if first["rank"] == 0:
        s = summarize_run(first)
        losses = first["losses"]
        hsdp = f" (replicate {first['dp_replicate']} x shard {first['dp_shard']})" if first["dp_replicate"] > 1 else ""
        print(f"ZeRO stage {cfg.stage} x dp={first['dp_size']}{hsdp} ({cfg.precision}): loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f} over {cfg.steps} steps; rank 0 median step {s['step_ms']:.1f} ms; owns "
              f"{first['owned_params']:,} parameters; per step {first['rs_bytes'][-1]:,} B reduce-scattered, "
              f"{first['ag_bytes'][-1]:,} B all-gathered"
              + (f", {first['replicate_bytes'][-1]:,} B all-reduced across replicas" if hsdp else "")
              + (f"; wrote {cfg.out}" if cfg.out else ""))
    return results


if __name__ == "__main__":
    run_then_exit(main)  # under torchrun: skip finalization (lslm.runtime.startup.exit_process)
