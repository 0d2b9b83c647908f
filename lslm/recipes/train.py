"""Single-process training of :class:`lslm.models.GPT` on the corpus: the serial reference.

Every parallel recipe in the course is checked against this loop: same seed, same
data, same optimiser, so the loss curves can be compared number for number. It is the
smallest recipe on the harness (:mod:`lslm.harness`): a config, ``build`` and a step.

    python -m lslm.recipes.train --steps 30 --out runs/baseline.json
    python -m lslm.recipes.train --precision bf16      # or fp16: half model, fp32 masters

``--precision`` (every recipe inherits it from :class:`TrainConfig`): ``fp32``; ``bf16``
or ``fp16`` train a half-precision model whose fp32 master weights AdamW steps
(:func:`lslm.precision.prepare_precision`), fp16 with a dynamic loss scaler that starts at
``--init-scale`` and skips the steps whose gradients overflow (counted in the record).

``--device`` (default ``auto``): the rule of :func:`lslm.runtime.init_distributed` for one
process, i.e. ``LSLM_DEVICE`` if set, else ``cuda:0`` when CUDA is available, else the CPU
(:func:`serial_device`); ``--device cpu`` or ``--device cuda:1`` overrides it. The
distributed recipes' configs inherit the field with the same ``auto``, which their
process group resolves per rank.

On CPU the run is bitwise reproducible: the same config gives the same losses.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from lslm.data.dataset import batches, token_blocks
from lslm.data.sampler import make_sampler
from lslm.data_parallel.grad_buffer import has_main_grad
from lslm.data_parallel.grad_sync import GRAD_DTYPES, attach_grad_buffers, resolve_grad_dtype
from lslm.harness import (
    Built,
    StepTimer,
    add_trace_option,
    check_fields,
    option,
    parse_config,
    summarize,
    train_loop,
    write_run_log,
)
from lslm.metrics.flops import StepFlops, gpt_step_flops
from lslm.models.gpt import GPT, GPTConfig
from lslm.precision import PARAM_DTYPES, PRECISION_MODES, PrecisionSetup, prepare_precision
from lslm.runtime.context import ParallelContext
from lslm.runtime.startup import choose_device_and_backend

__all__ = ["TrainConfig", "adamw", "build", "build_model", "data_stream", "grad_buffer_dtype", "main", "make_optimizer",
           "precision_fields", "prepare_training", "replica_loader", "serial_device", "step_flops", "train"]


@dataclass
class TrainConfig:
    """Everything that defines a baseline run. The defaults train in a few seconds on 2 CPU cores."""

    # model
    n_layer: int = option(2, help="transformer blocks", ge=1)
    n_head: int = option(4, help="attention heads (must divide n_embd)", ge=1)
    n_embd: int = option(64, help="model width", ge=1)
    dropout: float = option(0.0, help="dropout probability", ge=0)
    vocab_size: int = option(1024, help="BPE vocabulary size of the shipped corpus", ge=1)
    block_size: int = option(64, help="tokens per sequence", ge=1)
    # optimisation
    batch_size: int = option(8, help="sequences per step (the global batch)", ge=1)
    steps: int = option(30, help="optimisation steps", ge=1)
    lr: float = option(3e-3, help="AdamW learning rate", gt=0)
    weight_decay: float = option(0.1, help="AdamW weight decay of matrices", ge=0)
    grad_clip: float = option(1.0, help="gradient norm clip (0 disables clipping)", ge=0)
    seed: int = option(0, help="seed of weights and data order", ge=0)
    # precision
    precision: str = option("fp32", choices=PRECISION_MODES, help="fp32, or a bf16/fp16 model with fp32 master "
                                                                  "weights (fp16 with dynamic loss scaling)")
    init_scale: float = option(2.0**16, help="fp16: the loss scaler's initial scale", gt=0)
    grad_reduce_dtype: str = option("fp32", choices=GRAD_DTYPES, help="dtype of the gradient buffer, in which "
                                    "gradients accumulate and are reduced across ranks: fp32, or the parameters' "
                                    "dtype (param)")
    # bookkeeping
    log_every: int = option(10, help="log the loss every this many steps", ge=1)
    device: str = option("auto", help="torch device of the run; 'auto': cuda:0 when CUDA is available, else cpu")
    out: str | None = option(None, help="write the run log (JSON) to this path")

    def __post_init__(self) -> None:
        check_fields(self)
        self.model_config()  # fail now, not after the data is built, on bad model sizes

    def model_config(self) -> GPTConfig:
        """The :class:`GPTConfig` these settings describe."""
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, dropout=self.dropout)


def serial_device(device: str = "auto") -> torch.device:
    """The device of a one-process run: ``device`` unless it is ``"auto"``, else what ``init_distributed`` would
    pick for a single rank (``LSLM_DEVICE`` if set, else ``cuda:0`` when CUDA is available, else the CPU).

    Raises ValueError for a device this machine does not have (``"cuda"`` without CUDA, a GPU index past the last).
    """
    # One process talks to nobody: only LSLM_DEVICE applies (an LSLM_BACKEND meant for launched ranks must not make
    # an explicit --device cpu an error). An explicit "cpu" never touches torch.cuda; "auto" asks is_available() only.
    env = {k: v for k, v in os.environ.items() if k == "LSLM_DEVICE"}
    return choose_device_and_backend(0, 1, device=None if device == "auto" else device, environ=env)[0]


def build_model(cfg: TrainConfig, *, meta: bool = False) -> GPT:
    """The model of ``cfg``, initialised from ``cfg.seed`` (the same weights on every call).

    ``meta=True``: shapes only, on the meta device (no memory, no random draws), for
    ``apply_tensor_parallel`` / ``apply_pipeline`` with ``init_seed=cfg.seed``, which
    materialise only a rank's part, with exactly these weights (:mod:`lslm.models.deferred_init`).
    """
    if meta:
        with torch.device("meta"):
            return GPT(cfg.model_config())
    torch.manual_seed(cfg.seed)
    return GPT(cfg.model_config())


def data_stream(cfg: TrainConfig, *, rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(x, y)`` batches of this rank's shard: epoch 0, 1, ... each reshuffled from ``cfg.seed``."""
    data = token_blocks(cfg.block_size, cfg.vocab_size, rank=rank, world_size=world_size)
    if len(data) < cfg.batch_size:
        raise ValueError(f"batch_size={cfg.batch_size} exceeds the {len(data)} blocks available; lower it")
    epoch = 0
    while True:
        yield from batches(data, cfg.batch_size, seed=cfg.seed, epoch=epoch)
        epoch += 1


def adamw(params: list[torch.Tensor], cfg: TrainConfig) -> torch.optim.AdamW:
    """The baseline's AdamW over ``params``: weight decay on matrices only, betas (0.9, 0.95), per-parameter loop.

    ``params`` may be a model's parameters or the fp32 master copies of them (same shapes, so
    the same groups).
    """
    # Decay matrices only: shrinking biases and LayerNorm gains towards 0 only hurts.
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: the plain per-parameter loop, the easiest to mirror in sharded optimisers.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """The baseline's AdamW on ``model``'s parameters (:func:`adamw`)."""
    return adamw(list(model.parameters()), cfg)


def grad_buffer_dtype(cfg: TrainConfig) -> torch.dtype:
    """The gradient buffers' dtype ``cfg`` asks for (``--grad-reduce-dtype``: fp32, or the model's dtype)."""
    return resolve_grad_dtype(cfg.grad_reduce_dtype, PARAM_DTYPES[cfg.precision])


def prepare_training(model: torch.nn.Module, cfg: TrainConfig, *, main_grad: bool = True,
                     ctx: ParallelContext | None = None, bucket_cap_mb: float | None = None) -> PrecisionSetup:
    """``model`` in ``cfg.precision`` with the baseline's AdamW behind one interface (fp32 masters for half modes).

    Returns :func:`lslm.precision.prepare_precision`'s setup: ``setup.optimizer`` has
    ``zero_grad()``, ``scale_loss(loss)`` (the loss times the loss scale: call ``backward``
    on that), ``step(max_grad_norm, clip=...) -> bool`` (False: an fp16 overflow skipped the
    step) and ``loss_scale``. With ``main_grad`` (the default) every gradient lives in a
    gradient buffer of dtype :func:`grad_buffer_dtype`: those already attached to ``model``
    (per pipeline stage, say), else buffers attached here (split by the reduction each
    parameter needs, ``bucket_cap_mb`` per bucket; ``ctx`` gives a replicated key/value head
    its slot). ``main_grad=False`` keeps plain ``.grad`` (for wrappers that reduce ``.grad``:
    naive, fused and torch DDP). With ``ctx`` the fp16 overflow flag is MAX-reduced over every
    rank, which all hold gradients, so all ranks skip the same steps.
    """
    if main_grad and not any(has_main_grad(p) for p in model.parameters()):
        attach_grad_buffers(model, ctx, dtype=grad_buffer_dtype(cfg), bucket_cap_mb=bucket_cap_mb)
    scaler = {"init_scale": cfg.init_scale} if cfg.precision == "fp16" else None
    return prepare_precision(model, cfg.precision, lambda params: adamw(params, cfg), main_grad=main_grad,
                             scaler=scaler, comm=ctx.comm if ctx is not None else None)


def step_flops(cfg: TrainConfig, recompute: str = "none") -> StepFlops:
    """One step's flops, all ranks together: the global ``batch_size`` sequences of ``block_size`` tokens through
    ``cfg``'s GPT (:func:`lslm.metrics.flops.gpt_step_flops`), for the harness's MFU line."""
    return gpt_step_flops(cfg.model_config(), cfg.batch_size, recompute=recompute, precision=cfg.precision)


def precision_fields(setup: PrecisionSetup, stepped: bool) -> dict[str, float]:
    """This step's precision figures for a run record: the loss scale after the step, and whether it stepped."""
    return {"loss_scale": float(setup.optimizer.loss_scale), "stepped": float(stepped)}


def build(cfg: TrainConfig, ctx: ParallelContext | None = None) -> Built:
    """The serial technique: the model on ``ctx.device``, else on ``cfg.device`` (:func:`serial_device`: ``auto`` picks
    ``cuda:0`` when CUDA is available) in ``cfg.precision``, AdamW, batches."""
    device = ctx.device if ctx is not None else serial_device(cfg.device)
    model = build_model(cfg).to(device)
    model.train()
    setup = prepare_training(model, cfg, ctx=ctx)
    optimizer = setup.optimizer
    figures: dict[str, float] = {}

    def step(batch: tuple[torch.Tensor, torch.Tensor], timer: StepTimer) -> torch.Tensor:
        x, y = (t.to(device) for t in batch)
        optimizer.zero_grad()
        _, loss = model(x, y)
        optimizer.scale_loss(loss).backward()
        stepped = optimizer.step(cfg.grad_clip if cfg.grad_clip > 0 else None)
        figures.update(precision_fields(setup, stepped))
        return loss

    return Built(model=model, optimizer=optimizer, step=step, batches=data_stream(cfg), device=device,
                 per_step=lambda marks: dict(figures), info={"tokens_per_step": cfg.batch_size * cfg.block_size,
                                                             "precision": cfg.precision},
                 name="train", flops=step_flops(cfg))


def train(cfg: TrainConfig, trace: str | None = None) -> dict[str, Any]:
    """Train for ``cfg.steps`` steps in this process and return the run record.

    With ``trace`` (a folder), the last steps are profiled into ``<trace>/train-rank0.json``.

    Keys include ``losses`` (one float per step), ``step_times_s`` (= ``step_s``),
    ``tokens_per_step``, ``num_parameters``, ``memory``, ``config`` (``asdict(cfg)``) and
    ``device`` (see :func:`lslm.harness.recipe.train_loop`). The run log is written as JSON
    to ``cfg.out`` when set.
    """
    result = train_loop(cfg, build(cfg), trace=trace)
    if cfg.out:
        write_run_log(cfg.out, result, [{**summarize(result), "rank": 0}])
    return {**result, "step_times_s": result["step_s"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the run record (handy in tests)."""
    parser = argparse.ArgumentParser(prog="python -m lslm.recipes.train", description="Serial baseline training run.")
    add_trace_option(parser)
    cfg, extra = parse_config(TrainConfig, argv, parser=parser)
    result = train(cfg, trace=extra.get("trace"))
    losses = result["losses"]
    ms = 1000 * sorted(result["step_s"])[len(losses) // 2]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {cfg.steps} steps on {result['device']}; "
          f"median step {ms:.1f} ms; {result['num_parameters']:,} parameters"
          + (f"; wrote {cfg.out}" if cfg.out else ""))
    return result


if __name__ == "__main__":
    main()


def replica_loader(cfg: TrainConfig, dp_rank: int, dp: int) -> DataLoader:
    """This data-parallel replica's loader over the shipped corpus's token blocks: the global ``cfg.batch_size``
    split over ``dp`` replicas by the seeded baseline sampler (the same split in every recipe that shards data).

    Raises ValueError when one replica's share of the batch exceeds the blocks available.
    """
    blocks = token_blocks(cfg.block_size, cfg.vocab_size)
    sampler = make_sampler(blocks, "baseline", rank=dp_rank, world_size=dp, seed=cfg.seed)
    loader = DataLoader(blocks, batch_size=cfg.batch_size // dp, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise ValueError(f"batch_size={cfg.batch_size} exceeds the {len(blocks)} blocks available; lower it")
    return loader
