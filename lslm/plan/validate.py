"""The calculator's time model against the step times the TP, pipeline and ZeRO benches measured, side by side.

For every lslm configuration in the committed ``bench/results/{tp,pipeline,zero}.json`` (measured on this
2-core machine with nothing else running), :func:`validate` builds the calculator's :class:`ModelSpec` and
:class:`Layout` from the bench's own config (model shape, batch, world size, schedule, ZeRO stage, optimizer)
and predicts the step with :func:`lslm.plan.estimate` on the ``cpu-box`` hardware, whose every number was
calibrated once from committed measurements (:mod:`lslm.plan.calibrate`), never from the step times compared
here. No timing is taken: the same artifacts give the same table.

What each bench's step holds, and so what is predicted:

* ``tp`` (``lslm bench tp``, rows ``lslm``): forward, backward and an SGD-with-momentum step on one batch,
  tensor-parallel over all processes, sequence parallelism off and on.
* ``pipeline`` (``lslm bench pipeline``, lslm's schedules): forward and backward of the batch in ``m``
  micro-batches, no optimizer. The calculator's schedule is 1F1B (interleaved with ``v = 2``): GPipe has its
  step time; ZB-H1 and DualPipeV are zero-bubble schedules the calculator does not model, so they are
  predicted as 1F1B / interleaved (flagged in ``note``; their bubble is smaller).
* ``zero`` (``lslm bench zero``, entries ``ddp`` (torch DDP) and lslm's ``zero1-3``, ``zero3-offload``,
  ``zero3-disk``): forward, backward, gradient sync and an AdamW step; with offload, the host copies (and the
  disk's reads and writes) of each rank's slice, at the rates ``zero_offload.json`` measured on another,
  25x larger model (out of sample), for the exact bytes the bench recorded.

``error = predicted / measured - 1``. Every row is within :data:`TOLERANCE` on the committed artifacts; the
model still under-predicts almost everywhere (mean about -9 %): it has no term for the step's fixed cost outside
the layers (the batch copy, the loss, ``zero_grad``, Python between the calls; the pipeline bench measured
2.4-6.5 ms of it per step outside its schedule) and prices the zero-bubble schedules as 1F1B.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from lslm.plan.calibrate import calibrate_cpu_box, cpu_box_hardware
from lslm.plan.estimate import estimate
from lslm.plan.hardware import Hardware, hardware_presets
from lslm.plan.layout import Layout
from lslm.plan.model import ModelSpec

__all__ = ["BENCHES", "TOLERANCE", "format_validation", "load_results", "results_dir", "validate"]

BENCHES = ("tp", "pipeline", "zero", "collectives", "zero_offload")
TOLERANCE = 0.20  #: issue 22's target: within 20 % per configuration
ZERO_ENTRIES = {"ddp": (0, "none"), "zero1": (1, "none"), "zero2": (2, "none"), "zero3": (3, "none"),
                "zero3-offload": (3, "cpu"), "zero3-disk": (3, "disk")}


def results_dir(path: str | Path | None = None) -> Path:
    """``path``, else ``bench/results`` under the working directory, else the one next to the package."""
    if path is not None:
        return Path(path)
    here = Path("bench/results")
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "bench" / "results"


def load_results(path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """The committed ``tp``, ``pipeline``, ``zero``, ``collectives`` and ``zero_offload`` results (JSON) as dicts."""
    folder = results_dir(path)
    missing = [name for name in BENCHES if not (folder / f"{name}.json").is_file()]
    if missing:
        run = "python -m lslm.bench.zero_offload" if missing[0] == "zero_offload" else f"lslm bench {missing[0]}"
        raise ValueError(f"{folder} lacks {', '.join(f'{m}.json' for m in missing)}: run `{run}` (quiet machine) "
                         "or pass the folder that holds them")
    return {name: json.loads((folder / f"{name}.json").read_text()) for name in BENCHES}


def _spec(cfg: dict[str, Any], micro_batch: int, global_batch: int) -> ModelSpec:
    """lslm's GPT of a bench's model dict (untied head, biases, no dropout: the benches' GPTConfig defaults)."""
    return ModelSpec(cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["vocab_size"], cfg["block_size"],
                     micro_batch=micro_batch, global_batch=global_batch, tied=False, bias=True,
                     max_positions=cfg["block_size"], dropout=False, name="lslm GPT")


def _row(bench: str, config: str, measured_ms: float, model: ModelSpec, layout: Layout, hw: Hardware,
         note: str = "") -> dict[str, Any]:
    est = estimate(model, layout, hw)
    predicted = est.step_s * 1e3
    return {"bench": bench, "config": config, "measured_ms": measured_ms, "predicted_ms": predicted,
            "error": predicted / measured_ms - 1, "terms_ms": {k: t.value * 1e3 for k, t in est.times.items()},
            "note": note}


def validate(results: dict[str, dict[str, Any]] | None = None, hardware: Hardware | None = None
             ) -> list[dict[str, Any]]:
    """One row per lslm configuration of the committed benches: ``bench``, ``config``, ``measured_ms``,
    ``predicted_ms``, ``error`` (predicted / measured - 1), ``terms_ms`` (the calculator's time terms) and a
    ``note`` where the calculator leaves something of the bench out (module doc).

    ``results``: :func:`load_results`'s dicts (default: read them); ``hardware``: default the ``cpu-box`` preset.
    """
    results = load_results() if results is None else results
    hw = hardware_presets()["cpu-box"] if hardware is None else hardware
    rows = []
    for t, res in sorted(results["tp"].items(), key=lambda kv: int(kv[0])):
        model = _spec(res["model"], res["batch"], res["batch"])
        for r in res["rows"]:
            if r["variant"] != "lslm":
                continue
            sp = r["sequence_parallel"]
            layout = Layout(tp=int(t), sequence_parallel=sp, precision="fp32", optimizer="sgd-momentum")
            rows.append(_row("tp", f"tp={t} SP {'on' if sp else 'off'}", r["step_ms"], model, layout, hw))
    no_optimizer = dataclasses.replace(hw, optimizer_Bps=None)  # the pipeline bench times no optimizer step
    for p, res in sorted(results["pipeline"].items(), key=lambda kv: int(kv[0])):
        for r in res["rows"]:
            seqs = res["batch"] // r["m"]
            model = _spec(res["model"], seqs, res["batch"])
            layout = Layout(pp=int(p), v=r["v"], precision="fp32")
            note = "" if r["pair"] in ("GPipe", "1F1B", "Interleaved1F1B") else \
                "zero-bubble schedule predicted as " + ("interleaved 1F1B" if r["v"] > 1 else "1F1B")
            rows.append(_row("pipeline", f"p={p} {r['pair']} m={r['m']}", r["lslm_ms"], model, layout,
                             no_optimizer, note))
    for world, res in sorted(results["zero"].items(), key=lambda kv: int(kv[0])):
        n = int(world)
        model = _spec(res["model"], res["rows_per_rank"], res["rows_per_rank"] * n)
        for r in res["rows"]:
            if r["entry"] not in ZERO_ENTRIES:
                continue
            stage, offload = ZERO_ENTRIES[r["entry"]]
            layout = Layout(dp=n, zero=stage, offload=offload, precision="fp32")
            note = {"ddp": "torch DDP"}.get(r["entry"], "")
            rows.append(_row("zero", f"dp={world} {r['entry']}", r["step_ms"], model, layout, hw, note))
    return rows


def format_validation(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> str:
    """The rows as a side-by-side table; the last line is the worst error and how many rows are within
    ``tolerance``."""
    lines = [f"{'bench':<9}{'configuration':<28}{'measured ms':>12}{'predicted ms':>13}{'error':>8}  note"]
    for r in rows:
        flag = "" if abs(r["error"]) <= tolerance else " *"
        lines.append(f"{r['bench']:<9}{r['config']:<28}{r['measured_ms']:>12.1f}{r['predicted_ms']:>13.1f}"
                     f"{r['error']:>+8.1%}{flag}  {r['note']}")
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= tolerance for r in rows)
    lines.append(f"(* beyond {tolerance:.0%}) {within} of {len(rows)} configurations within {tolerance:.0%}; "
                 f"worst error {worst['error']:+.1%} ({worst['bench']} {worst['config']})")
    return "\n".join(lines)


def calibrated_from(results: dict[str, dict[str, Any]]) -> Hardware:
    """The cpu-box hardware calibrated afresh from ``results`` (what the preset's rounded numbers come from)."""
    return cpu_box_hardware(calibrate_cpu_box(results["pipeline"], results["collectives"], results["zero"],
                                              results["zero_offload"]))
