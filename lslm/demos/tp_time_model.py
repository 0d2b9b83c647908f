"""A time model of a tensor-parallel step, against the measurement (notebook 05, section 11).

The prediction for one forward + backward of lslm's GPT at tensor-parallel size ``t`` (no sequence parallelism) is

    compute (measured on one rank, no communication) + sum over the step's collectives of alpha-beta(op, bytes)

* **compute**: :func:`compute_worker` runs the same sharded model alone, in torch's fake process group (``t`` ranks
  in name, one process; every collective returns at once, so the time is the rank's matmuls, the Python around
  them and nothing else). It times the whole model's forward + backward and one transformer block's alone: the
  per-layer compute, and the rest (embedding, head, loss) as the difference.
* **communication**: the collectives the real run issued (read from its ledger: op, bytes, group size), each
  priced with :func:`lslm.metrics.collective_costs.model_time` and a fit of alpha, beta, gamma (see
  :func:`fit_gloo`).
* **measured**: :func:`tp_worker` runs the ``t``-rank job on gloo, a barrier before every step, a step costing its
  slowest rank's time, the median over steps.

The fake group is torch's internal testing API, reached through :func:`lslm.runtime.fake_world.fake_world`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lslm.metrics.collective_costs import fit_alpha_beta, model_time
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.runtime.fake_world import fake_world
from lslm.runtime.grid import RankGrid
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

__all__ = ["ALGORITHM", "compute_worker", "fit_gloo", "predict", "tp_worker"]

#: the ring algorithm whose alpha-beta-gamma coefficients price each torch (gloo) collective
ALGORITHM = {"all_reduce": "all_reduce_ring", "all_gather": "all_gather_ring",
             "reduce_scatter": "reduce_scatter_ring"}


@contextmanager
def _fake_world(world_size: int) -> Iterator[ParallelContext]:
    """This process as rank 0 of a ``world_size``-rank tensor-parallel world of torch's fake backend (no peers)."""
    with fake_world(0, world_size):
        grid = RankGrid.build(world_size, tp=world_size)
        yield ParallelContext.create(grid, rank=0, local_rank=0, node_rank=0, device=torch.device("cpu"),
                                     backend="fake")


def _data(cfg: GPTConfig, batch: int, seq: int, n: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)  # the same tokens on every rank
    return [torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)  # lslm: cpu-ok (then moved)
            for _ in range(n)]


def _step(model: torch.nn.Module, ctx: ParallelContext, cfg: GPTConfig, xy: torch.Tensor) -> None:
    """One forward + backward with the vocabulary-parallel loss (no optimizer: it does not communicate)."""
    model.zero_grad(set_to_none=True)
    logits, _ = model(xy[:, :-1])
    vocab_parallel_cross_entropy(logits, xy[:, 1:], ctx, vocab_size=cfg.vocab_size).backward()


def _model(cfg: GPTConfig, ctx: ParallelContext) -> torch.nn.Module:
    torch.manual_seed(0)
    return apply_tensor_parallel(GPT(cfg).to(ctx.device), ctx)


def compute_worker(ranks: int, models: list[dict[str, Any]], batch: int, seq: int, steps: int = 10, warmup: int = 2,
                   threads: int = 1) -> dict[str, Any]:
    """Per model of ``models``: one rank's compute at tensor-parallel size ``ranks`` (medians, seconds).

    ``compute_s``: one forward + backward of the whole sharded model; ``per_layer_s``: of one transformer block
    alone, on an input of the residual stream's shape; ``rest_s``: the difference (embedding, head, loss). The
    two are timed alternately, so a slow moment of a shared machine hits both. Runs in one process (launch it
    with ``nproc=1``), in torch's fake ``ranks``-rank group: no collective waits for anything.
    """
    torch.set_num_threads(threads)
    out = []
    with _fake_world(ranks) as ctx:
        for spec in models:
            cfg = GPTConfig(**spec)
            model, data = _model(cfg, ctx), _data(cfg, batch, seq, warmup + steps, ctx.device)
            block = model.blocks[0]
            h = torch.randn(batch, seq, cfg.n_embd, device=ctx.device, requires_grad=True)
            whole, one = [], []
            for i, xy in enumerate(data):
                start = time.perf_counter()
                _step(model, ctx, cfg, xy)
                mid = time.perf_counter()
                block(h).sum().backward()
                end = time.perf_counter()
                if i >= warmup:
                    whole.append(mid - start)
                    one.append(end - mid)
            compute, per_layer = statistics.median(whole), statistics.median(one)
            out.append({"model": spec, "compute_s": compute, "per_layer_s": per_layer,
                        "rest_s": compute - spec["n_layer"] * per_layer})
    return {"rank": 0, "tp": ranks, "threads": threads, "models": out}


def tp_worker(models: list[dict[str, Any]], batch: int, seq: int, steps: int = 10, warmup: int = 2,
              threads: int = 1) -> dict[str, Any]:
    """Per model: the measured step (forward + backward, slowest rank, median) and one step's collectives.

    ``comm_s``: the time the slowest rank spent inside collectives per step (the ledger's issue-to-completion
    times, median), to tell which half of the prediction missed.
    """
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = []
    with init_distributed(tp=world) as ctx:
        torch.set_num_threads(threads)
        for spec in models:
            cfg = GPTConfig(**spec)
            model, data = _model(cfg, ctx), _data(cfg, batch, seq, warmup + steps, ctx.device)
            samples, in_comm, records = [], [], []
            for i, xy in enumerate(data):
                dist.barrier(group=ctx.tp_group)
                first = len(ctx.comm.ledger.records)
                start = time.perf_counter()
                with ctx.comm.ledger.timed():  # completion times: how long each collective held this rank
                    _step(model, ctx, cfg, xy)
                step_s = time.perf_counter() - start
                comm_s = sum(r.duration_s or 0.0 for r in ctx.comm.ledger.records[first:])
                took = torch.tensor([step_s, comm_s], dtype=torch.float64, device=ctx.device)
                dist.all_reduce(took, op=dist.ReduceOp.MAX, group=ctx.tp_group)  # the slowest rank's times
                if i >= warmup:
                    samples.append(took[0].item())
                    in_comm.append(took[1].item())
                if i == 0:
                    records = [[r.op, r.nbytes, r.group_size, r.label] for r in ctx.comm.ledger.records[first:]]
                ctx.comm.ledger.reset()
            out.append({"model": spec, "step_s": statistics.median(samples), "comm_s": statistics.median(in_comm),
                        "records": records})
        return {"rank": ctx.rank, "tp": ctx.tp_size, "models": out}


def fit_gloo(collectives: dict[str, Any], world_size: int) -> dict[str, float]:
    """alpha, beta, gamma fitted on ``lslm bench collectives``' torch rows (the gloo calls TP makes) at one size.

    ``collectives`` is ``bench/results/collectives.json`` read as a dict. Each torch all-reduce, all-gather and
    reduce-scatter row is priced as the ring algorithm of :data:`ALGORITHM` (gloo's own algorithm is not
    visible from Python: the ring is the bandwidth-optimal one it approaches on large messages).
    """
    rows = [{**r, "algorithm": ALGORITHM[r["kind"]]} for r in collectives[str(world_size)]["rows"]
            if r["algorithm"].startswith("torch.") and r["kind"] in ALGORITHM]
    if not rows:
        raise ValueError(f"no torch all_reduce/all_gather/reduce_scatter rows at world size {world_size}")
    return fit_alpha_beta(rows)


def predict(compute: dict[str, Any], measured: dict[str, Any], fit: dict[str, float]) -> dict[str, Any]:
    """Compute + alpha-beta against the measured step, for one model (``compute`` and ``measured`` its entries).

    Communication per layer is the collectives labelled ``blocks.<i>``, divided by the layers; the rest (the
    embedding's, the head's, the loss's) is counted once.
    """
    n_layer = measured["model"]["n_layer"]
    cost = {"layer": 0.0, "rest": 0.0}
    for op, nbytes, n, label in measured["records"]:
        cost["layer" if label.startswith("blocks.") else "rest"] += model_time(fit, ALGORITHM[op], n, nbytes)
    layer_s = compute["per_layer_s"] + cost["layer"] / n_layer
    predicted = compute["rest_s"] + cost["rest"] + n_layer * layer_s
    return {"per_layer_compute_s": compute["per_layer_s"], "per_layer_comm_s": cost["layer"] / n_layer,
            "rest_compute_s": compute["rest_s"], "rest_comm_s": cost["rest"], "predicted_s": predicted,
            "measured_s": measured["step_s"], "error": predicted / measured["step_s"] - 1,
            "collectives": len(measured["records"]), "measured_comm_s": measured.get("comm_s")}
