"""The overlap conditions of DP, ZeRO-3 and TP: predicted by the plan's model on this machine, read from a trace.

``python -m lslm.bench.overlap_verdicts [--out bench/results]`` launches :func:`worker` on 2 processes: every
rank runs the DDP (bucketed), ZeRO-3 and TP recipes on their default tiny GPT for two steps each, both traced
(``trace=``: :mod:`lslm.metrics.trace`). :func:`verdicts` then reads the traces back
(:func:`lslm.metrics.overlap.analyse_files`: each collective's issue-to-wait time and the part the main thread
was blocked in it) and puts each technique's condition beside it (:mod:`lslm.plan.overlap`), priced on the
``cpu-box`` preset (this machine's calibrated rates) with the exact bytes the traced collectives moved:

* DP: the mean bucket's all-reduce against the backward that fills the next bucket;
* ZeRO-3: one block's all-gather against one block's forward;
* TP: an all-reduce of one block's activation (``b·s·h``) against nothing: the next op needs it, so it is
  exposed in the plain schedule; the compute printed is what ``async_grad_allreduce`` could hide the backward's
  input-gradient all-reduce behind, the block's weight-gradient matmuls.

Writes ``overlap_verdicts.txt`` and ``.json``. Timings vary from run to run and with the machine's load; the
verdicts are what the table is for.
"""

from __future__ import annotations

import argparse
import glob
import json
import tempfile
from pathlib import Path
from typing import Any

from lslm.harness import Report, run_in_context
from lslm.metrics.overlap import analyse_files, overlap_table
from lslm.plan.hardware import hardware_presets
from lslm.plan.model import ModelSpec
from lslm.plan.overlap import (
    OverlapRow,
    block_forward_s,
    collective_s,
    model_backward_s,
    traced_share,
    verdict_row,
    weight_grad_s,
)
from lslm.plan.validate import results_dir
from lslm.recipes.ddp import RECIPE as DDP
from lslm.recipes.tp import RECIPE as TP
from lslm.recipes.zero import RECIPE as ZERO
from lslm.runtime import init_distributed, seed_everything

__all__ = ["RUNS", "load_committed", "main", "verdicts", "worker"]

#: technique -> (recipe, settings): the recipes' default tiny GPT (2 blocks of width 64, batch 8 of 64 tokens).
RUNS: dict[str, tuple[Any, dict[str, Any]]] = {
    "dp": (DDP, {"variant": "bucketed", "bucket_cap_mb": 0.25}),
    "zero3": (ZERO, {"stage": 3}),
    "tp": (TP, {"tp": 2}),
}


def worker(trace: str, steps: int = 2, **_: Any) -> dict[str, Any]:
    """This rank's run record of each technique of :data:`RUNS`, traced into ``<trace>/<technique>/``."""
    ctx = init_distributed()
    out: dict[str, Any] = {"rank": ctx.rank, "world_size": ctx.world_size}
    for name, (recipe, settings) in RUNS.items():
        seed_everything(0)
        (rec,) = run_in_context(recipe, ctx, [settings], trace=f"{trace}/{name}", steps=steps, log_every=1000)
        out[name] = {"trace": rec["trace"], "model": {k: rec.get(k) for k in ("n_layer", "n_embd", "n_head")}}
    return out


def _spec(batch: int, sequences_per_rank: int) -> ModelSpec:
    cfg = DDP.config()  # the recipes share TrainConfig's defaults
    return ModelSpec(n_layer=cfg.n_layer, hidden=cfg.n_embd, n_head=cfg.n_head, vocab=cfg.vocab_size,
                     seq_len=cfg.block_size, micro_batch=sequences_per_rank, global_batch=batch)


def load_committed(path: str | Path | None = None) -> dict[str, Any]:
    """The committed ``overlap_verdicts.json`` (``path``: its folder; default as :func:`lslm.plan.validate.results_dir`:
    ``bench/results`` here, else the one next to the package)."""
    return json.loads((results_dir(path) / "overlap_verdicts.json").read_text())


def verdicts(records: list[dict[str, Any]], trace_dir: str | Path, hardware: str = "cpu-box") -> dict[str, Any]:
    """The rows of every technique (:class:`~lslm.plan.overlap.OverlapRow` as dicts) and each traced run's
    overlap table, from the worker's records and the trace files under ``trace_dir``."""
    hw = hardware_presets()[hardware]
    n = records[0]["world_size"]
    spare = hw.cores is None or n < hw.cores
    cfg = DDP.config()
    rows: list[OverlapRow] = []
    tables = {}
    per_run = {}
    for name in RUNS:
        per_run[name] = analyse_files(sorted(glob.glob(f"{trace_dir}/{name}/*-rank*.json")))
        tables[name] = overlap_table(per_run[name])
    ledger = [c for calls in records[0]["dp"]["trace"]["ledger"].values() for c in calls]

    # DP: the mean bucket's all-reduce against the backward that fills the next one (its share of the bytes).
    buckets = [c[2] for c in ledger if c[0] == "all_reduce" and c[3] == "ddp-grad"]
    dp_key = next(f"all_reduce@{c[1] or '-'}" for c in ledger if c[0] == "all_reduce" and c[3] == "ddp-grad")
    per_step = len(records[0]["dp"]["trace"]["steps"])
    bucket = sum(buckets) / len(buckets)
    dp_model = _spec(cfg.batch_size, cfg.batch_size // n)
    backward = model_backward_s(dp_model, hw, cfg.batch_size // n) * bucket / (sum(buckets) / per_step)
    rows.append(verdict_row("dp", f"all_reduce of a {bucket / 1e3:.0f} kB bucket",
                            "backward of a bucket's layers >= its all-reduce", backward,
                            collective_s(hw, "all_reduce_ring", bucket, n),
                            traced_share(per_run["dp"], dp_key), spare))

    # ZeRO-3: one block's parameter all-gather against one block's forward (the prefetch window).
    zl = [c for calls in records[0]["zero3"]["trace"]["ledger"].values() for c in calls]
    gathers = [c[2] for c in zl if c[0] == "all_gather"]
    block = max(set(gathers), key=gathers.count)  # the blocks' units: the most frequent size (the root unit, with
    # the embeddings and the head, is gathered once a step and differs)
    key = next(f"all_gather@{c[1] or '-'}" for c in zl if c[0] == "all_gather")
    rows.append(verdict_row("zero3", f"all_gather of a {block / 1e3:.0f} kB unit",
                            "forward of the block in hand >= the next block's all-gather",
                            block_forward_s(dp_model, hw, cfg.batch_size // n),
                            collective_s(hw, "all_gather_ring", block, n), traced_share(per_run["zero3"], key),
                            spare))

    # TP: one block's all-reduce of b·s·h. Plain schedule: exposed whatever the sizes (spare_core=False stands for
    # "nothing to overlap with"); the number beside it is what async_grad_allreduce could hide it behind.
    tl = [c for calls in records[0]["tp"]["trace"]["ledger"].values() for c in calls]
    acts = [c[2] for c in tl if c[0] == "all_reduce" and c[3].startswith("blocks.")]
    act = max(acts)
    tp_model = _spec(cfg.batch_size, cfg.batch_size)
    key = next(f"all_reduce@{c[1] or '-'}" for c in tl if c[0] == "all_reduce" and c[3].startswith("blocks."))
    row = verdict_row("tp", f"all_reduce of a {act / 1e3:.0f} kB activation",
                      "none in the plain schedule (the next op needs the result); async backward: weight-gradient "
                      "matmul >= input-gradient all-reduce",
                      weight_grad_s(tp_model, hw, cfg.batch_size, tp=n),
                      collective_s(hw, "all_reduce_ring", act, n), traced_share(per_run["tp"], key), False)
    rows.append(OverlapRow(**{**row.__dict__, "predicted": "exposed (next op needs it)"}))
    return {"hardware": hardware, "world_size": n, "spare_core": spare, "rows": [r.to_dict() for r in rows],
            "tables": tables}


def print_table(result: dict[str, Any], report: Report) -> None:
    """The verdicts, one line each, then each run's overlap table."""
    report.print(f"Overlap conditions at {result['world_size']} processes, predicted on '{result['hardware']}' "
                 f"(spare core: {result['spare_core']}) and traced (2 steps per rank, both ranks)")
    report.print(f"{'technique':<9} {'collective':<32} {'compute ms':>10} {'comm ms':>8} {'predicted':<47} "
                 f"{'calls':>5} {'traced ms/call':>14} {'exposed':>8} {'traced':<14} agree")
    for r in result["rows"]:
        frac = r["traced_exposed_fraction"]
        traced_ms = r["traced_comm_s"]
        report.print(f"{r['technique']:<9} {r['collective']:<32} {1e3 * r['predicted_compute_s']:>10.3f} "
                     f"{1e3 * r['predicted_comm_s']:>8.3f} {r['predicted']:<47} {r['traced_calls']:>5} "
                     f"{(1e3 * traced_ms if traced_ms is not None else float('nan')):>14.3f} "
                     f"{(f'{100 * frac:.0f} %' if frac is not None else '-'):>8} {r['traced']:<14} {r['agree']}")
    for r in result["rows"]:
        report.print(f"  {r['technique']}: condition: {r['condition']}")
    for name, table in result["tables"].items():
        report.print(f"\n{name}: the traced steps (lslm.metrics.overlap)\n{table}")


def main(out_dir: str | Path | None = None, nproc: int = 2, timeout: float = 600.0) -> dict[str, Any]:
    """Launch, read the traces, print the table; write ``overlap_verdicts.{txt,json}`` to ``out_dir`` if given."""
    from lslm.launcher.launch import launch

    with tempfile.TemporaryDirectory() as trace_dir:  # the traces are read here and dropped
        records = launch("lslm.bench.overlap_verdicts:worker", nproc=nproc, timeout=timeout, output="none",
                         trace=trace_dir)
        result = verdicts(list(records), trace_dir)
    with Report("overlap_verdicts", out_dir) as report:
        print_table(result, report)
        report.write(result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="folder for overlap_verdicts.txt/.json (e.g. bench/results)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    ns = parser.parse_args()
    main(ns.out, ns.nproc)
