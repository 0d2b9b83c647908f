"""Tensor-parallel training (Megatron-LM), optionally with sequence parallelism and data parallelism on top.

The GPT of :mod:`lslm.recipes.train`, split by
:func:`~lslm.tensor_parallel.apply.apply_tensor_parallel` over ``tp`` ranks: built on the
meta device, each rank materialises only its shards of the serial run's weights (peak
memory at start: the shards plus about one layer; :mod:`lslm.models.deferred_init`);
the remaining ``dp = world / tp`` groups of ranks are data-parallel replicas. The
harness (:mod:`lslm.harness`) runs it::

    torchrun --nproc-per-node=2 -m lslm.recipes.tp --tp 2 --steps 30 --out runs/tp.json
    python -m lslm.recipes.tp --nproc 4 --tp 2 --sequence-parallel   # launches the processes itself
    recipe.run(2, tp=2, steps=10)                                     # from a notebook

**One step** on every rank: forward (the TP layers communicate inside it), the
vocabulary-parallel cross-entropy on this rank's logits slice
(:func:`~lslm.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`), backward,
:func:`~lslm.tensor_parallel.grads.sync_tensor_parallel_grads` (partial gradients of
sequence-parallel parameters), :func:`~lslm.tensor_parallel.clip.average_data_parallel_grads`
(over ``dp`` only: the ``tp`` ranks of a replica share one loss), the global-norm
:func:`~lslm.tensor_parallel.clip.clip_grad_norm_`, and the baseline's AdamW.

**Same run as the serial baseline.** ``batch_size`` is the global batch; each
data-parallel replica gets ``batch_size / dp`` rows, dealt out as the DDP recipe does
(:class:`~lslm.data.sampler.BaselineOrderSampler`): global batch ``i`` holds exactly
the rows of the serial run's batch ``i``, and all TP ranks of a replica read the same
rows. ``losses`` then reproduce ``lslm.recipes.train`` up to fp32 rounding.

**What is counted, per step and rank** (the comm ledger): ``comm_bytes`` / ``comm_calls``
are all of the step's communication, split into ``tp_comm_bytes`` (the layers'
all-reduces, or reduce-scatters and all-gathers with sequence parallelism, the loss's
all-reduces, the sequence-parallel gradient sync), ``dp_comm_bytes`` (the gradient
average) and ``clip_comm_bytes`` (the one number of the squared norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lslm.data.dataset import next_token_batches
from lslm.harness import Built, Marks, Recipe, StepTimer, entry_points, option, recipe_main
from lslm.harness import summarize as summarize_run
from lslm.precision import OVERFLOW_LABEL
from lslm.recipes.train import (
    TrainConfig,
    build_model,
    precision_fields,
    prepare_training,
    replica_loader,
    step_flops,
)
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import resolve_sizes
from lslm.runtime.startup import run_then_exit
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.clip import CLIP_LABEL, DP_GRAD_LABEL, average_data_parallel_grads, clip_grad_norm_
from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

__all__ = ["RECIPE", "TPConfig", "build", "check_config", "compare", "main", "run", "worker"]


@dataclass
class TPConfig(TrainConfig):
    """A :class:`~lslm.recipes.train.TrainConfig` plus the tensor-parallel settings.

    ``tp`` ranks split each layer; ``dp`` (default: the rest of the world) replicas
    split the global ``batch_size``. Sizes that cannot work raise ``ValueError`` here or
    in :func:`check_config`, before any process starts.
    """

    device: str = option("auto", help="'auto': CUDA + NCCL with one GPU per rank, else CPU + gloo")
    tp: int = option(2, help="tensor-parallel size (ranks that split every layer)", ge=1)
    dp: int | None = option(None, help="data-parallel size (default: world size / tp)", ge=1)
    sequence_parallel: bool = option(False, help="split LayerNorm/dropout regions along the sequence (Korthikanti "
                                             "et al. 2022)")
    async_grad_allreduce: bool = option(False, help="overlap the input-gradient all-reduce with the weight gradient")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_head % self.tp:
            raise ValueError(f"n_head={self.n_head} attention heads cannot be split over tp={self.tp} ranks "
                             f"(each rank needs whole heads); choose tp dividing {self.n_head}")
        if self.sequence_parallel and self.block_size % self.tp:
            raise ValueError(f"sequence_parallel splits each sequence of block_size={self.block_size} tokens over "
                             f"tp={self.tp} ranks; choose a block_size divisible by {self.tp}")
        if self.dp is not None and self.batch_size % self.dp:
            raise ValueError(f"global batch_size={self.batch_size} is not divisible by dp={self.dp} replicas")


def check_config(cfg: TPConfig, world_size: int) -> int:
    """Check that ``cfg`` runs on ``world_size`` processes; return the data-parallel size.

    Raises ``ValueError`` when ``tp`` (times ``dp``, if given) does not tile the world or
    the global batch does not split over the ``dp`` replicas.
    """
    dp = resolve_sizes(world_size, tp=cfg.tp, dp=cfg.dp)["dp"]
    if cfg.batch_size % dp:
        raise ValueError(f"global batch_size={cfg.batch_size} is not divisible by dp={dp} replicas "
                         f"(= {world_size} processes / tp={cfg.tp}); use a multiple of {dp}")
    return dp


def build(cfg: TPConfig, ctx: ParallelContext) -> Built:
    """The tensor-parallel technique on this rank: the split model, AdamW, this replica's batches, the timed step."""
    dp = check_config(cfg, ctx.world_size)
    tctx = ctx.with_grid(tp=cfg.tp, dp=cfg.dp)
    # Built on the meta device; each rank materialises only its shards of the serial run's weights (on tctx.device).
    model = apply_tensor_parallel(build_model(cfg, meta=True), tctx, sequence_parallel=cfg.sequence_parallel,
                                  async_grad_allreduce=cfg.async_grad_allreduce, rng_seed=cfg.seed,
                                  init_seed=cfg.seed)
    model.train()
    # The baseline's AdamW on this rank's shards (over fp32 masters in half modes). Gradients live in buffers split
    # by the reduction they need (dp; sp: TP sum first; kv-heads: a slot per head), reduced in place below.
    setup = prepare_training(model, cfg, ctx=tctx)
    optimizer = setup.optimizer

    loader = replica_loader(cfg, tctx.dp_rank, dp)
    ledger = tctx.comm.ledger
    traffic: dict[str, int] = {}

    def step(batch: tuple[torch.Tensor, torch.Tensor], timer: StepTimer) -> torch.Tensor:
        since = len(ledger.records)
        x, y = batch
        optimizer.zero_grad()
        logits, _ = model(x)  # this rank's slice of the vocabulary
        loss = vocab_parallel_cross_entropy(logits, y, tctx, vocab_size=cfg.vocab_size)
        timer.mark("forward_end")
        optimizer.scale_loss(loss).backward()
        timer.mark("backward_end")
        sync_tensor_parallel_grads(model, tctx)
        average_data_parallel_grads(model, tctx)
        timer.mark("sync_end")
        # The global norm over every shard (the masters carry their parameters' TP marks); fp16: False on overflow.
        stepped = optimizer.step(cfg.grad_clip if cfg.grad_clip > 0 else None,
                                 clip=lambda params, max_norm: clip_grad_norm_(params, max_norm, tctx))
        traffic.update(precision_fields(setup, stepped))
        dp_bytes = ledger.total_bytes(label=DP_GRAD_LABEL, since=since)
        clip_bytes = ledger.total_bytes(label=CLIP_LABEL, since=since)
        vote_bytes = ledger.total_bytes(label=OVERFLOW_LABEL, since=since)  # fp16's overflow vote: not TP traffic
        traffic.update(tp_comm_bytes=ledger.total_bytes(since=since) - dp_bytes - clip_bytes - vote_bytes,
                       dp_comm_bytes=dp_bytes, clip_comm_bytes=clip_bytes)
        return loss.detach()

    def per_step(m: Marks) -> dict[str, Any]:
        return {"compute_s": m.span("start", "backward_end"), "grad_sync_s": m.span("backward_end", "sync_end"),
                "optimizer_s": m.span("sync_end", "end"), **traffic}

    def log(now: dict[str, Any]) -> str:
        return f"  TP traffic {now['tp_comm_bytes']:,} B  dp grads {now['dp_comm_bytes']:,} B"

    info = {"tp_size": cfg.tp, "dp_size": dp, "sequence_parallel": cfg.sequence_parallel,
            "padded_vocab_size": model.tensor_parallel.padded_vocab_size, "precision": cfg.precision,
            "tokens_per_step": cfg.batch_size * cfg.block_size}
    return Built(model=model, optimizer=optimizer, step=step, batches=next_token_batches(loader, tctx.device), ctx=tctx,
                 device=tctx.device, per_step=per_step, count=(None, None), log=log, info=info,
                 name=f"tp{cfg.tp}-dp{dp}" + ("-sp" if cfg.sequence_parallel else ""), flops=step_flops(cfg))


RECIPE = Recipe("lslm.recipes.tp", TPConfig, build, check_config,
                "Tensor-parallel (x data-parallel) training (run under torchrun, or pass --nproc).",
                grid=lambda cfg: {"tp": cfg.tp, "dp": cfg.dp})


worker, compare, run = entry_points(RECIPE)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Command line: under torchrun run this rank; otherwise launch ``--nproc`` ranks. Returns the records."""
    cfg, results = recipe_main(RECIPE, argv)
    first = results[0]
    if first["rank"] == 0:
        s = summarize_run(first)
        losses = first["losses"]
        sp = " with sequence parallelism" if cfg.sequence_parallel else ""
        print(f"tp={first['tp_size']} x dp={first['dp_size']}{sp} on {first['world_size']} processes: "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {cfg.steps} steps; "
              f"rank 0 median step {s['step_ms']:.1f} ms; per step {first['tp_comm_bytes'][-1]:,} B of TP traffic, "
              f"{first['dp_comm_bytes'][-1]:,} B of dp gradients" + (f"; wrote {cfg.out}" if cfg.out else ""))
    return results


if __name__ == "__main__":
    run_then_exit(main)  # under torchrun: skip finalization (lslm.runtime.startup.exit_process)
