"""Multi-process data-parallel training: the GPT on the corpus with any DDP variant, measured.

One process per rank (``torchrun`` or :func:`lslm.launch`); every rank holds the whole
model, reads its own share of each global batch through a ``DistributedSampler`` and
averages gradients with one of ``lslm.data_parallel.ddp``'s variants (``naive``,
``fused``, ``bucketed``) or ``torch.nn.parallel.DistributedDataParallel`` (``torch``)::

    torchrun --nproc-per-node=2 -m lslm.recipes.ddp --variant bucketed --steps 30 --out runs/ddp.json
    python -m lslm.recipes.ddp --nproc 2 --variant torch          # launches the processes itself
    lslm.launch("lslm.recipes.ddp:worker", nproc=2, variant="fused", steps=10)   # from a notebook

**Same run as the serial baseline.** ``batch_size`` is the *global* batch; each rank
gets ``batch_size / world_size`` rows. With ``sampler="baseline"`` (the default) the
epoch order is the permutation :func:`lslm.data.dataset.batches` draws from
``(seed, epoch)``, and torch's ``DistributedSampler`` deals it out (rank ``r`` takes
positions ``r, r + n, r + 2n, ...``). Global batch ``i`` is then exactly the rows of
the serial run's batch ``i``: each rank's mean loss averaged over ranks equals the
serial mean loss, and the averaged gradient equals the serial gradient up to fp32
rounding (the sums are taken in a different order). So ``losses`` here reproduce
``lslm.recipes.train`` at the same ``batch_size``, ``seed`` and optimiser settings.
``sampler="torch"`` uses torch's own shuffle (``torch.randperm`` seeded with
``seed + epoch``) instead. Either way ``set_epoch(epoch)`` is called at the start
of every epoch; without it every epoch would repeat the first one's order.

**What is measured, per step and per rank** (``time.perf_counter``):

* ``compute_s``: forward + backward (all micro-batches when ``grad_accum > 1``);
* ``comm_exposed_s``: time spent in ``ddp.finish_grad_sync()``, i.e. communication
  that was *not* hidden behind backward (naive/fused do all their all-reduces there;
  bucketed only waits for the buckets still in flight);
* ``optimizer_s``: gradient clipping + ``optimizer.step()``;
* ``step_s``: the whole step, from ``zero_grad`` to the loss value on the host.

``variant="torch"`` communicates inside ``loss.backward()`` (its C++ reducer), so
``finish_grad_sync()`` is a no-op and the split is *estimated*: before each step the
same micro-batches run forward + backward once more under ``no_sync()`` (no
communication; the gradients are then discarded). ``compute_s`` is that probe's
time and ``comm_exposed_s = (forward + backward with sync) - compute_s``, which is
noisy and can come out slightly negative. Set ``probe_no_sync=False`` to skip the
probe (then ``compute_s`` includes torch's exposed communication and
``comm_exposed_s`` is 0).

Also per step: the bytes all-reduced through the comm ledger with label
``"ddp-grad"`` (``comm_bytes``; the ledger cannot see inside torch's reducer, so
this reads 0 for ``torch``; the ledger is reset after each step is counted). At the
end: memory per rank
(:func:`lslm.metrics.memory.memory_report`: model-state bytes, RSS, CUDA stats on
GPUs), and, with ``record_timeline=True``, the bucket events of every step next to
that step's forward/backward/sync marks (for ``torch`` this installs a Python comm
hook that routes its buckets through the ledger: the bytes become visible, the
step a little slower).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lslm.data.corpus import atomic_write_bytes
from lslm.data.dataset import token_blocks
from lslm.data.sampler import SAMPLERS, BaselineOrderSampler, make_sampler
from lslm.data_parallel.ddp import GRAD_LABEL, VARIANTS, cap_bytes, make_ddp
from lslm.metrics.memory import memory_report
from lslm.recipes.train import TrainConfig, _optimizer, build_model
from lslm.runtime import init_distributed, rank_print
from lslm.runtime.context import ParallelContext

__all__ = ["DDPConfig", "BaselineOrderSampler", "MODELS", "SAMPLERS", "check_config", "compare", "make_sampler",
           "model_loss", "worker", "run", "main", "GRAD_LABEL"]

MODELS = ("gpt", "hf_gpt2")
#: Ledger label of this recipe's own end-of-run reporting collectives.
REPORT_LABEL = "report"


@dataclass
class DDPConfig(TrainConfig):
    """A :class:`~lslm.recipes.train.TrainConfig` plus the data-parallel settings.

    ``batch_size`` is the **global** batch (all ranks together), split evenly over
    ranks and then into ``grad_accum`` micro-batches per rank (all but the last run
    under ``no_sync()``, so gradients are averaged once per step). ``device="auto"``
    lets :func:`lslm.runtime.init_distributed` choose (CUDA + NCCL with one GPU per rank,
    else CPU + gloo). ``threads > 0`` sets ``torch.set_num_threads`` on every rank;
    0 keeps what the launcher set (``lslm.launch``: cores / processes).
    """

    device: str = "auto"
    variant: str = "bucketed"
    bucket_cap_mb: float = 25.0
    model: str = "gpt"
    sampler: str = "baseline"
    grad_accum: int = 1
    record_timeline: bool = False
    probe_no_sync: bool = True
    threads: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; expected one of {tuple(VARIANTS)}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; expected one of {MODELS}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; expected one of {SAMPLERS}")
        cap_bytes(self.bucket_cap_mb)  # the wrappers' own check, here before any process starts
        if not isinstance(self.grad_accum, int) or isinstance(self.grad_accum, bool) or self.grad_accum < 1:
            raise ValueError(f"DDPConfig.grad_accum must be a positive int, got {self.grad_accum!r}")
        if not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"DDPConfig.threads must be an int >= 0, got {self.threads!r}")


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


def _build(cfg: DDPConfig) -> nn.Module:
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


def _batches(loader: DataLoader, sampler: DistributedSampler) -> Iterator[torch.Tensor]:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
        yield from (b["input_ids"] for b in loader)
        epoch += 1


def _train(cfg: DDPConfig, ctx: ParallelContext) -> dict[str, Any]:
    world, rank = ctx.dp_size, ctx.dp_rank
    micro = check_config(cfg, world)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = _build(cfg).to(ctx.device)
    model.train()
    ddp = make_ddp(model, ctx, variant=cfg.variant, bucket_cap_mb=cfg.bucket_cap_mb,
                   record_timeline=cfg.record_timeline)
    optimizer = _optimizer(ddp.module, cfg)  # the baseline's AdamW, parameter groups and all

    blocks = token_blocks(cfg.block_size, cfg.vocab_size)  # every rank: all blocks; the sampler shares them out
    sampler = make_sampler(blocks, cfg.sampler, rank=rank, world_size=world, seed=cfg.seed)
    loader = DataLoader(blocks, batch_size=micro * cfg.grad_accum, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise ValueError(f"batch_size={cfg.batch_size} exceeds the {len(blocks)} blocks available; lower it")
    stream = _batches(loader, sampler)
    ledger = ctx.comm.ledger

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        total = torch.zeros((), device=ctx.device)
        for j, (xm, ym) in enumerate(zip(x.split(micro), y.split(micro))):
            # Accumulate locally, synchronise once: only the last micro-batch all-reduces.
            sync = j == cfg.grad_accum - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = model_loss(ddp, xm, ym, cfg.model) / cfg.grad_accum
                forward_end = time.perf_counter()
                loss.backward()
            total += loss.detach()
        return total, forward_end

    rec: dict[str, list[Any]] = {k: [] for k in ("local_losses", "step_s", "compute_s", "comm_exposed_s",
                                                 "optimizer_s", "comm_bytes", "comm_calls", "timeline")}
    probe = cfg.variant == "torch" and cfg.probe_no_sync
    for step in range(cfg.steps):
        block = next(stream).to(ctx.device)
        x, y = block[:, :-1], block[:, 1:]
        if probe:  # torch: time forward + backward without communication, then discard the gradients
            optimizer.zero_grad(set_to_none=True)
            tp = time.perf_counter()
            with ddp.no_sync():
                for xm, ym in zip(x.split(micro), y.split(micro)):
                    (model_loss(ddp, xm, ym, cfg.model) / cfg.grad_accum).backward()
            probe_s = time.perf_counter() - tp
        if cfg.record_timeline:
            ddp.reset_timeline()
        n_records = len(ledger.records)  # 0 after the first step (reset below)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss, forward_end = forward_backward(x, y)
        t1 = time.perf_counter()
        ddp.finish_grad_sync()
        t2 = time.perf_counter()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), cfg.grad_clip)
        optimizer.step()
        value = loss.item()  # waits for the device: t3 is the real end of the step
        t3 = time.perf_counter()
        nbytes = ledger.total_bytes("all_reduce", label=GRAD_LABEL, since=n_records)
        calls = ledger.calls("all_reduce", label=GRAD_LABEL, since=n_records)
        ledger.reset()  # counted; a long run must not grow the ledger without bound
        rec["local_losses"].append(value)
        rec["step_s"].append(t3 - t0)
        rec["compute_s"].append(probe_s if probe else t1 - t0)
        rec["comm_exposed_s"].append((t1 - t0 - probe_s) if probe else t2 - t1)
        rec["optimizer_s"].append(t3 - t2)
        rec["comm_bytes"].append(nbytes)
        rec["comm_calls"].append(calls)
        if cfg.record_timeline:
            rec["timeline"].append({"t0": t0, "forward_end": forward_end, "backward_end": t1, "sync_end": t2,
                                    "step_end": t3, "events": list(ddp.timeline)})
        if rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            rank_print(f"step {step:>4}  loss(rank 0) {value:.4f}  step {1e3 * (t3 - t0):7.1f} ms  "
                       f"compute {1e3 * rec['compute_s'][-1]:7.1f} ms  exposed comm "
                       f"{1e3 * rec['comm_exposed_s'][-1]:6.1f} ms")

    # The global loss of each step: the mean of the ranks' means (equal shard sizes).
    # One collective after training, tagged so it never counts as gradient traffic.
    losses = torch.tensor(rec["local_losses"], dtype=torch.float64, device=ctx.device)
    ctx.comm.all_reduce(losses, group=ctx.dp_group, label=REPORT_LABEL)
    mem = memory_report(ctx.device, ddp.module, optimizer)
    num_params = sum(p.numel() for p in ddp.module.parameters())
    result: dict[str, Any] = {
        "rank": ctx.rank,
        "world_size": world,
        "variant": cfg.variant,
        "losses": (losses / world).tolist(),
        **{k: v for k, v in rec.items() if k != "timeline"},
        "grad_bytes": int(ddp.grad_bytes),
        "num_parameters": num_params,
        "buckets": [list(b) for b in getattr(ddp, "buckets", None) or []],
        "memory": mem.to_dict(),
        "threads": torch.get_num_threads(),
        "tokens_per_step": cfg.batch_size * cfg.block_size,
        "config": asdict(cfg),
        "device": str(ctx.device),
        "backend": ctx.backend,
    }
    if cfg.record_timeline:
        result["timeline"] = rec["timeline"]
    return result


def summarize(result: dict[str, Any]) -> dict[str, float]:
    """Medians over steps of one rank's times (ms), and its peak RSS (MiB)."""
    med = {k: 1e3 * statistics.median(result[k]) for k in ("step_s", "compute_s", "comm_exposed_s", "optimizer_s")}
    peak = result["memory"].get("peak_rss") or 0
    return {**{k.replace("_s", "_ms"): v for k, v in med.items()}, "peak_rss_mib": peak / 2**20}


def worker(**kwargs: Any) -> dict[str, Any]:
    """One rank of a data-parallel run; ``kwargs`` are :class:`DDPConfig` fields.

    Every rank returns its own record (see the module doc); ``losses`` is the global
    per-step loss on every rank. Rank 0 writes the record of all ranks to ``out``
    (JSON: ``losses``, ``config`` and ``ranks``, one entry per rank) when it is set.
    """
    cfg = DDPConfig(**kwargs)
    device = None if cfg.device == "auto" else cfg.device
    with init_distributed(device=device, seed=cfg.seed) as ctx:
        result = _train(cfg, ctx)  # checks cfg against this world size first
        if cfg.out:
            _write_log(cfg, ctx, result)
        return result


def compare(runs: list[dict[str, Any]], **common: Any) -> list[dict[str, Any]]:
    """Several runs one after another in *one* process group (one launch, no start-up cost per run).

    Run ``i`` uses ``DDPConfig(**common, **runs[i])``, from the same seed, so e.g.
    ``runs=[{"variant": v} for v in VARIANTS]`` trains every variant on identical
    weights and data. Returns this rank's record of each run (see :func:`worker`);
    the ledger is reset between runs. ``out`` is ignored.
    """
    cfgs = [DDPConfig(**{**common, **r, "out": None}) for r in runs]
    device = None if cfgs[0].device == "auto" else cfgs[0].device
    with init_distributed(device=device, seed=cfgs[0].seed) as ctx:
        records = []
        for cfg in cfgs:
            ctx.comm.ledger.reset()
            records.append(_train(cfg, ctx))
        return records


def _write_log(cfg: DDPConfig, ctx: ParallelContext, result: dict[str, Any]) -> None:
    # Gather the per-rank time medians and memory to rank 0 (a small fixed-size tensor).
    keys = ("step_ms", "compute_ms", "comm_exposed_ms", "optimizer_ms", "peak_rss_mib")
    mine = torch.tensor([summarize(result)[k] for k in keys], dtype=torch.float64, device=ctx.device)
    out = torch.empty(ctx.world_size * len(keys), dtype=torch.float64, device=ctx.device)
    ctx.comm.all_gather(list(out.chunk(ctx.world_size)), mine, label=REPORT_LABEL)
    if ctx.rank == 0:
        ranks = [dict(zip(keys, row.tolist()), rank=r) for r, row in enumerate(out.view(ctx.world_size, -1))]
        log = {"losses": result["losses"], "step_s": result["step_s"], "compute_s": result["compute_s"],
               "comm_exposed_s": result["comm_exposed_s"], "comm_bytes": result["comm_bytes"],
               "grad_bytes": result["grad_bytes"], "num_parameters": result["num_parameters"],
               "tokens_per_step": result["tokens_per_step"], "world_size": result["world_size"],
               "config": result["config"], "ranks": ranks, "memory_rank0": result["memory"]}
        atomic_write_bytes(Path(cfg.out), (json.dumps(log, indent=1) + "\n").encode("utf-8"))


def run(nproc: int = 2, *, runs: list[dict[str, Any]] | None = None, timeout: float = 600.0, output: str = "rank0",
        **kwargs: Any) -> Any:
    """Validate the settings for ``nproc`` ranks, then ``lslm.launch`` the job.

    Without ``runs``: :func:`worker` with ``DDPConfig(**kwargs)``; the result is one
    record per rank. With ``runs``: :func:`compare`, and ``result[rank][i]`` is run
    ``i``'s record. Bad settings raise ``ValueError`` here, before any process starts.
    """
    from lslm.runtime.launch import launch

    for extra in runs or [{}]:
        check_config(DDPConfig(**{**kwargs, **extra}), nproc)
    if runs is not None:
        return launch("lslm.recipes.ddp:compare", nproc=nproc, timeout=timeout, output=output, runs=runs, **kwargs)
    return launch("lslm.recipes.ddp:worker", nproc=nproc, timeout=timeout, output=output,
                  **asdict(DDPConfig(**kwargs)))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lslm.recipes.ddp",
                                     description="Data-parallel training (run under torchrun, or pass --nproc).")
    parser.add_argument("--nproc", type=int, default=2,
                        help="processes to launch when not started by torchrun (default: 2)")
    defaults = DDPConfig()
    for f in fields(DDPConfig):
        default = getattr(defaults, f.name)
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = str if f.name == "out" else type(default)
            choices = {"variant": tuple(VARIANTS), "model": MODELS, "sampler": SAMPLERS}.get(f.name)
            parser.add_argument(flag, dest=f.name, type=kind, default=default, choices=choices,
                                help=f"(default: {default})")
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Command line: under torchrun run this rank; otherwise launch ``--nproc`` ranks. Returns the records."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    nproc = args.pop("nproc")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        cfg = DDPConfig(**args)
        check_config(cfg, int(os.environ["WORLD_SIZE"]) if under_torchrun else nproc)
    except ValueError as exc:
        parser.error(str(exc))
    results = [worker(**asdict(cfg))] if under_torchrun else list(run(nproc, **asdict(cfg)))
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
    main()
