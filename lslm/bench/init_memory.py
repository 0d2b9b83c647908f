"""What building the model costs a rank at start: the whole model then sharded, or the meta device then its part.

Per rank, the exact peak of the bytes allocated while the model is built and split
(:func:`~lslm.metrics.allocations.track_live_bytes`: every storage from its allocation to its
free, on the CPU as on a GPU), and what is still held once it is done, for two ways of doing it:

* ``full``: ``build_model(cfg)`` (the whole model on every rank, as the serial run builds it),
  then :func:`~lslm.tensor_parallel.apply.apply_tensor_parallel` or
  :func:`~lslm.pipeline.apply.apply_pipeline` keeps this rank's part;
* ``meta``: ``build_model(cfg, meta=True)`` (shapes only) and the same call with
  ``init_seed=cfg.seed``: the serial build is replayed one layer at a time and only this
  rank's shards or stages get memory (:mod:`lslm.models.deferred_init`).

Both give bit-for-bit the same parameters on every rank (checked in the run: ``equal``).
The numbers are exact counts, not timings, so any machine gives the same table::

    python -m lslm.bench.init_memory            # writes bench/results/init_memory.{txt,json}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lslm.bench.checks import memory_bench_args
from lslm.launcher.launch import launch
from lslm.metrics.allocations import track_live_bytes
from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.apply import PipelinePlan, apply_pipeline
from lslm.recipes.train import TrainConfig, build_model
from lslm.runtime.startup import init_distributed
from lslm.tensor_parallel.apply import apply_tensor_parallel

__all__ = ["BENCH_MODEL", "QUICK_MODEL", "leaf_bytes", "main", "measure", "run", "worker"]

#: 8 blocks of width 256, vocabulary 4096: 8.4 M parameters, 33.6 MB in fp32. The largest layers
#: (the embedding and the head, 4 MB each) are an eighth of it.
BENCH_MODEL = dict(vocab_size=4096, block_size=64, n_layer=8, n_head=8, n_embd=256)

#: A tiny model for a smoke run (``--quick``).
QUICK_MODEL = dict(vocab_size=512, block_size=32, n_layer=4, n_head=4, n_embd=64)

WAYS = ("full", "meta")


def _bytes(params: Any) -> int:
    seen: dict[int, int] = {}
    for p in params:
        seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def leaf_bytes(config: GPTConfig) -> dict[str, int]:
    """Bytes of the whole model and of its largest leaf module (weight and bias together), from shapes alone."""
    with torch.device("meta"):
        model = GPT(config)
    leaves = [_bytes(m.parameters(recurse=False)) for m in model.modules()]
    return {"model_bytes": _bytes(model.parameters()), "largest_leaf_bytes": max(leaves)}


def _build(cfg: TrainConfig, ctx: Any, technique: str, meta: bool) -> Any:
    model = build_model(cfg, meta=meta)
    seed = cfg.seed if meta else None
    if technique == "tp":
        return apply_tensor_parallel(model, ctx, init_seed=seed)
    return apply_pipeline(model, ctx, PipelinePlan(schedule="1f1b", microbatches=ctx.pp_size), init_seed=seed)


def measure(cfg: TrainConfig, ctx: Any, technique: str) -> dict[str, Any]:
    """On this rank: peak and held bytes of each way of building ``technique`` (``"tp"`` or ``"pp"``), and
    whether both ways give identical parameters."""
    out: dict[str, Any] = {}
    params: dict[str, list[nn.Parameter]] = {}
    for way in WAYS:
        with track_live_bytes() as live:
            built = _build(cfg, ctx, technique, meta=way == "meta")  # alive until held_bytes is read, as in a recipe
        device = ctx.device.type
        params[way] = list(built.parameters())
        out[way] = {"peak_bytes": live.peak[device], "held_bytes": live.current[device],
                    "local_param_bytes": _bytes(params[way])}
        del built
    full, meta = params["full"], params["meta"]
    out["equal"] = len(full) == len(meta) and all(
        a.shape == b.shape and torch.equal(a.detach(), b.detach()) and a.requires_grad == b.requires_grad
        and getattr(a, "tensor_model_parallel", None) == getattr(b, "tensor_model_parallel", None)
        and getattr(a, "partition_dim", None) == getattr(b, "partition_dim", None)
        for a, b in zip(full, meta, strict=False))
    return out


def worker(config: dict[str, int], techniques: list[str], seed: int = 0) -> list[dict[str, Any]]:
    """One rank: each technique (``"tp"``, ``"pp"``) over the whole world, both ways (:func:`measure`)."""
    bad = [t for t in techniques if t not in ("tp", "pp")]
    if bad:
        raise ValueError(f"techniques must be 'tp' or 'pp', got {bad}")
    base = init_distributed()
    cfg = TrainConfig(seed=seed, **config)
    records = []
    for technique in techniques:
        ctx = base.with_grid(**{technique: base.world_size})
        records.append({"rank": ctx.rank, "world_size": ctx.world_size, "technique": technique,
                        **measure(cfg, ctx, technique), **leaf_bytes(cfg.model_config())})
    return records


def run(config: dict[str, int] | None = None, sizes: tuple[int, ...] = (1, 2, 4),
        techniques: tuple[str, ...] = ("tp", "pp"), timeout: float = 300.0) -> list[dict[str, Any]]:
    """Launch :func:`worker` once per world size; every rank's record of every technique."""
    config = dict(BENCH_MODEL if config is None else config)
    records: list[dict[str, Any]] = []
    for n in sizes:
        for per_rank in launch("lslm.bench.init_memory:worker", nproc=n, timeout=timeout, output="none",
                               config=config, techniques=list(techniques)):
            records += per_rank
    return records


def table(records: list[dict[str, Any]]) -> str:
    """The records as a text table: per technique and size, rank 0's and the largest rank's bytes."""
    first = records[0]
    mb = 1e6
    lines = [f"GPT {first['model_bytes'] / mb:.1f} MB of fp32 parameters, largest layer "
             f"{first['largest_leaf_bytes'] / mb:.1f} MB; per rank, the most of any rank (MB):",
             f"{'':4} {'n':>2} | {'full: peak':>10} {'held':>7} | {'meta: peak':>10} {'held':>7} | "
             f"{'own params':>10} | {'peak meta/full':>14} | equal"]
    keys = sorted({(r["technique"], r["world_size"]) for r in records}, key=lambda k: (k[0] != "tp", k[1]))
    for technique, n in keys:
        rs = [r for r in records if (r["technique"], r["world_size"]) == (technique, n)]
        f_peak = max(r["full"]["peak_bytes"] for r in rs)
        m_peak = max(r["meta"]["peak_bytes"] for r in rs)
        f_held = max(r["full"]["held_bytes"] for r in rs)
        m_held = max(r["meta"]["held_bytes"] for r in rs)
        own = max(r["meta"]["local_param_bytes"] for r in rs)
        lines.append(f"{technique:4} {n:>2} | {f_peak / mb:10.2f} {f_held / mb:7.2f} | {m_peak / mb:10.2f} "
                     f"{m_held / mb:7.2f} | {own / mb:10.2f} | {m_peak / f_peak:14.3f} | {all(r['equal'] for r in rs)}")
    lines.append("full: the whole model built, then this rank's part kept; meta: built on the meta device, this "
                 "rank's part materialised layer by layer. held: still allocated after the build, the built "
                 "model alive (a pipeline keeps the GPT it was cut from: with `full`, every stage rank holds the "
                 "whole model).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Command line: run :func:`run`, print the table, write ``--out`` (``.txt`` and ``.json``)."""
    args = memory_bench_args("python -m lslm.bench.init_memory", __doc__, "bench/results/init_memory", "1,2,4", argv)
    sizes = args.sizes
    model = QUICK_MODEL if args.quick else BENCH_MODEL
    records = run(model, sizes=sizes)
    text = table(records)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"model": model, "records": records}, indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
