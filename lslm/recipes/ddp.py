"""Multi-process data-parallel training: the GPT on the corpus with any DDP variant, measured.

One process per rank; every rank holds the whole model, reads its own share of each
global batch through a ``DistributedSampler`` and averages gradients with one of
``lslm.data_parallel.ddp``'s variants (``naive``, ``fused``, ``bucketed``) or
``torch.nn.parallel.DistributedDataParallel`` (``torch``). The harness
(:mod:`lslm.harness`) runs it::

    torchrun --nproc-per-node=2 -m lslm.recipes.ddp --variant bucketed --steps 30 --out runs/ddp.json
    python -m lslm.recipes.ddp --nproc 2 --variant torch          # launches the processes itself
    recipe.run(2, variant="fused", steps=10)                      # from a notebook

**Same run as the serial baseline.** ``batch_size`` is the *global* batch; each rank
gets ``batch_size / world_size`` rows. With ``sampler="baseline"`` (the default) the
epoch order is the permutation :func:`lslm.data.dataset.batches` draws from
``(seed, epoch)``, and torch's ``DistributedSampler`` deals it out (rank ``r`` takes
positions ``r, r + n, r + 2n, ...``): global batch ``i`` is exactly the rows of the
serial run's batch ``i``, so ``losses`` reproduce ``lslm.recipes.train`` up to fp32
rounding (the sums are taken in a different order). ``sampler="torch"`` uses torch's
own shuffle. Either way ``set_epoch(epoch)`` starts every epoch; without it every
epoch would repeat the first one's order.

**What is measured, per step and per rank** (a :class:`~lslm.harness.timer.StepTimer`:
``perf_counter`` on CPU, CUDA events on GPUs, so NCCL's asynchronous all-reduces are
not read as free): ``compute_s`` = forward + backward (all micro-batches);
``comm_exposed_s`` = time in ``ddp.finish_grad_sync()``, the communication *not* hidden
behind backward; ``optimizer_s`` = clipping + ``optimizer.step()``; ``step_s`` = all of it.
``variant="torch"`` communicates inside ``loss.backward()`` (its reducer waits for the
all-reduces at the end of backward), so the split is taken inside the same backward: a
post-accumulate-grad hook on every parameter marks ``"grads_ready"`` (the later mark wins),
so ``compute_s`` = start to the last gradient accumulated (of the last micro-batch) and
``comm_exposed_s`` = from there until ``backward()`` returns; both are spans between marks
of one step, never negative. Also per step: the bytes and calls all-reduced
through the comm ledger with label ``"ddp-grad"`` (``comm_bytes``, ``comm_calls``; 0 for
``torch``, whose reducer the ledger cannot see). ``record_timeline=True`` keeps each
step's marks next to the bucket events (for ``torch`` through a Python comm hook).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lslm.data.dataset import token_blocks
from lslm.data.sampler import SAMPLERS, BaselineOrderSampler, make_sampler
from lslm.data_parallel.ddp import GRAD_LABEL, VARIANTS, cap_bytes, make_ddp
from lslm.harness import (
    REPORT_LABEL,
    Built,
    Marks,
    Recipe,
    StepTimer,
    entry_points,
    option,
    recipe_main,
    summarize,
)
from lslm.recipes.train import TrainConfig, build_model, precision_fields, prepare_training, step_flops
from lslm.runtime.context import ParallelContext
from lslm.runtime.startup import run_then_exit

__all__ = ["DDPConfig", "BaselineOrderSampler", "MODELS", "RECIPE", "SAMPLERS", "build", "check_config", "compare",
           "make_sampler", "model_loss", "split_compute_comm", "summarize", "worker", "run", "main", "GRAD_LABEL",
           "REPORT_LABEL"]

MODELS = ("gpt", "hf_gpt2")


@dataclass
class DDPConfig(TrainConfig):
    """A :class:`~lslm.recipes.train.TrainConfig` plus the data-parallel settings.

    ``batch_size`` is the **global** batch (all ranks together), split evenly over
    ranks and then into ``grad_accum`` micro-batches per rank (all but the last run
    under ``no_sync()``, so gradients are averaged once per step).
    """

    device: str = option("auto", help="'auto': CUDA + NCCL with one GPU per rank, else CPU + gloo")
    variant: str = option("bucketed", choices=tuple(VARIANTS), help="gradient synchronisation")
    bucket_cap_mb: float = option(25.0, help="bucket size of fused/bucketed/torch (MiB)")
    model: str = option("gpt", choices=MODELS, help="the lslm GPT or a Hugging Face GPT-2 of the same sizes")
    sampler: str = option("baseline", choices=SAMPLERS, help="data order: the serial run's, or torch's shuffle")
    grad_accum: int = option(1, help="micro-batches per rank per step", ge=1)
    record_timeline: bool = option(False, help="keep every step's marks and bucket events")
    threads: int = option(0, help="torch.set_num_threads on every rank (0: what the launcher set)", ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        cap_bytes(self.bucket_cap_mb)  # the wrappers' own check, here before any process starts


def check_config(cfg: DDPConfig, world_size: int) -> int:
    """Check that ``cfg`` can run on ``world_size`` ranks; return the per-rank micro-batch size.

    Raises ``ValueError`` when the global batch does not split evenly over the ranks
    and then over ``grad_accum`` micro-batches.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if cfg.batch_size % world_size:
        raise ValueError(f"global batch_size={cfg.batch_size} is not divisible by {world_size} processes; "
                         f"use a multiple of {world_size}")
    per_rank = cfg.batch_size // world_size
    if per_rank % cfg.grad_accum:
        raise ValueError(f"the per-rank batch {per_rank} (= {cfg.batch_size} / {world_size}) is not divisible by "
                         f"grad_accum={cfg.grad_accum}")
    return per_rank // cfg.grad_accum


def _build_model(cfg: DDPConfig) -> nn.Module:
    if cfg.model == "gpt":
        return build_model(cfg)
    from lslm.models.hf import build_hf_gpt2

    return build_hf_gpt2(cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, seed=cfg.seed,
                         dropout=cfg.dropout)


def model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str = "gpt") -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` (or its DDP wrapper) on ``(x, y)``.

    The lslm GPT computes it itself; a Hugging Face model returns logits and the loss
    is taken here on the same already-shifted targets (its own ``labels=`` would shift
    once more).
    """
    if kind == "gpt":
        return model(x, y)[1]
    logits = model(x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _blocks(loader: DataLoader, sampler: DistributedSampler,
            device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
        for b in loader:
            block = b["input_ids"].to(device)
            yield block[:, :-1], block[:, 1:]
        epoch += 1


def build(cfg: DDPConfig, ctx: ParallelContext) -> Built:
    """The DDP technique on this rank: model, wrapper, AdamW, this rank's batches and the timed step."""
    micro = check_config(cfg, ctx.dp_size)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = _build_model(cfg).to(ctx.device)
    model.train()
    # Bucketed: the gradients live in bucketed buffers (--grad-reduce-dtype, fp32 by default) that the wrapper
    # all-reduces in place. The others reduce .grad, in the model's dtype (half gradients in half precision, as
    # torch DDP does), so they get plain .grad. Cast before wrapping (their buckets take the parameters' dtype).
    # The fp32 masters are cloned before the wrapper broadcasts rank 0's weights: right because every rank
    # builds the same weights from cfg.seed (a model that differs per rank would need its masters broadcast).
    setup = prepare_training(model, cfg, main_grad=cfg.variant == "bucketed", ctx=ctx, bucket_cap_mb=cfg.bucket_cap_mb)
    optimizer = setup.optimizer  # the baseline's AdamW, parameter groups and all (over fp32 masters in half modes)
    ddp = make_ddp(model, ctx, variant=cfg.variant, bucket_cap_mb=cfg.bucket_cap_mb,
                   record_timeline=cfg.record_timeline)

    blocks = token_blocks(cfg.block_size, cfg.vocab_size)  # every rank: all blocks; the sampler shares them out
    sampler = make_sampler(blocks, cfg.sampler, rank=ctx.dp_rank, world_size=ctx.dp_size, seed=cfg.seed)
    loader = DataLoader(blocks, batch_size=micro * cfg.grad_accum, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise ValueError(f"batch_size={cfg.batch_size} exceeds the {len(blocks)} blocks available; lower it")
    figures: dict[str, float] = {}
    in_reducer = cfg.variant == "torch"  # torch's reducer communicates inside backward(): split it by a hook
    timing: list[StepTimer | None] = [None]  # the running step's timer, for the hooks

    def grad_ready(_: torch.Tensor) -> None:
        # Runs when a gradient has been accumulated into .grad, before torch's reducer waits for its all-reduces at
        # the end of backward(); the latest mark wins, so "grads_ready" ends up at the last gradient of the last
        # micro-batch (earlier no_sync micro-batches are compute: their hooks are overwritten). On CUDA the hook
        # runs in the autograd engine's device thread with the stream of the backward op current (the stream the
        # forward ran on, here the default one), so the event lands on the compute stream right after the gradient
        # accumulation kernel, on the same stream as the "start" and "backward_end" events: the order of the marks,
        # hence non-negative spans, holds.
        if timing[0] is not None:
            timing[0].mark("grads_ready")

    if in_reducer:
        for p in ddp.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(grad_ready)

    def before_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        if cfg.record_timeline:
            ddp.reset_timeline()

    def step(batch: tuple[torch.Tensor, torch.Tensor], timer: StepTimer) -> torch.Tensor:
        optimizer.zero_grad()
        timing[0] = timer
        total = torch.zeros((), device=ctx.device)
        for j, (xm, ym) in enumerate(zip(batch[0].split(micro), batch[1].split(micro))):
            # Accumulate locally, synchronise once: only the last micro-batch all-reduces.
            with contextlib.nullcontext() if j == cfg.grad_accum - 1 else ddp.no_sync():
                loss = model_loss(ddp, xm, ym, cfg.model) / cfg.grad_accum
                timer.mark("forward_end")
                optimizer.scale_loss(loss).backward()
            total += loss.detach()
        timer.mark("backward_end")
        timing[0] = None
        ddp.finish_grad_sync()  # naive/fused: every all-reduce; bucketed: wait for the buckets in flight
        timer.mark("sync_end")
        stepped = optimizer.step(cfg.grad_clip if cfg.grad_clip > 0 else None)  # fp16: False if it overflowed
        figures.update(precision_fields(setup, stepped))
        return total

    def per_step(m: Marks) -> dict[str, Any]:
        out: dict[str, Any] = {**split_compute_comm(m, in_reducer), "optimizer_s": m.span("sync_end", "end"), **figures}
        if cfg.record_timeline:
            out["timeline"] = {"t0": m["start"], "forward_end": m["forward_end"], "backward_end": m["backward_end"],
                               "sync_end": m["sync_end"], "step_end": m["end"], "events": list(ddp.timeline)}
        return out

    def log(now: dict[str, Any]) -> str:
        return f"  compute {1e3 * now['compute_s']:7.1f} ms  exposed comm {1e3 * now['comm_exposed_s']:6.1f} ms"

    info = {"variant": cfg.variant, "grad_bytes": int(ddp.grad_bytes),
            "buckets": [list(b) for b in getattr(ddp, "buckets", None) or []],
            "tokens_per_step": cfg.batch_size * cfg.block_size, "precision": cfg.precision}
    return Built(model=ddp.module, optimizer=optimizer, step=step, batches=_blocks(loader, sampler, ctx.device),
                 device=ctx.device, before_step=before_step, per_step=per_step, count=("all_reduce", GRAD_LABEL),
                 log=log, info=info, name=f"ddp-{cfg.variant}", owners=(ddp,), flops=step_flops(cfg))


def split_compute_comm(m: Marks, in_reducer: bool) -> dict[str, float]:
    """This step's ``compute_s`` and ``comm_exposed_s`` from its marks, both spans between marks in step order.

    Wrappers that synchronise after backward (``in_reducer=False``): compute = start to ``"backward_end"``, exposed
    communication = ``"backward_end"`` to ``"sync_end"`` (``finish_grad_sync``). torch's DDP (``in_reducer=True``)
    waits inside backward: compute = start to the last ``"grads_ready"`` (the last gradient accumulated), exposed
    communication = from there to ``"backward_end"`` plus the (empty) ``finish_grad_sync``. Raises ValueError when a
    mark is missing (a model with no trainable parameter never marks ``"grads_ready"``).
    """
    missing = [k for k in ("start", "backward_end", "sync_end") + (("grads_ready",) if in_reducer else ())
               if k not in m.times]
    if missing:
        raise ValueError(f"the step's marks lack {missing}: has the model a parameter that requires grad?")
    end_of_compute = "grads_ready" if in_reducer else "backward_end"
    return {"compute_s": m.span("start", end_of_compute), "comm_exposed_s": m.span(end_of_compute, "sync_end")}


RECIPE = Recipe("lslm.recipes.ddp", DDPConfig, build, check_config,
                "Data-parallel training (run under torchrun, or pass --nproc).")


worker, compare, run = entry_points(RECIPE)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Command line: under torchrun run this rank; otherwise launch ``--nproc`` ranks. Returns the records."""
    cfg, results = recipe_main(RECIPE, argv)
    first = results[0]
    if first["rank"] == 0:
        s = summarize(first)
        losses = first["losses"]
        print(f"{cfg.variant} DDP on {first['world_size']} processes: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"over {cfg.steps} steps; rank 0 median step {s['step_ms']:.1f} ms (compute {s['compute_ms']:.1f}, "
              f"exposed comm {s['comm_exposed_ms']:.1f}); {first['comm_bytes'][-1]:,} B all-reduced per step "
              f"(gradients: {first['grad_bytes']:,} B)" + (f"; wrote {cfg.out}" if cfg.out else ""))
    return results


if __name__ == "__main__":
    run_then_exit(main)  # under torchrun: skip finalization (lslm.runtime.startup.exit_process)
