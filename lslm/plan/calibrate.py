"""The ``cpu-box`` hardware calibrated from committed quiet measurements (``bench/results/*.json``), no new timing.

Each number of :func:`calibrate_cpu_box` comes from one artifact, measured on this 2-core machine with nothing
else running, and each stands for one physical effect:

* **compute** (``peak_flops["fp32"]`` and ``layer_overhead_s``): ``lslm bench pipeline``'s per-stage compute
  times at 2 processes (``pipeline.json``: the median forward ``F`` and backward ``B`` of stage 0, one core per
  process, no communication inside an action; GPipe, 1F1B and interleaved rows: chunks of 2 or 4 layers on
  micro-batches of 2 or 4 sequences). A layer's pass is fitted as ``flops / R + c`` (relative least squares):
  ``R`` the matmul rate of one thread, ``c_F`` and ``c_B`` a pass's fixed cost (elementwise ops, dispatch).
  Three constants from 12 measurements; TP (width 256) and ZeRO (width 192) are then predicted out of sample.
* **links** (``intra``: groups of 2 processes; ``inter``: more, where processes outnumber the cores):
  ``lslm bench collectives``' torch rows (``collectives.json``: gloo's own all-reduce, all-gather and
  reduce-scatter at 4 KiB to 64 MiB, the calls lslm makes), one alpha-beta fit per algorithm and group size,
  priced as rings; point-to-point sends use the bench's stored fit of lslm's algorithms (``fit``).
  Where the rows bracket a call's payload, the call is priced off the rows themselves (``measured``: each
  algorithm's 5 sizes at its group size, read in log time against log size) rather than the fit, which over
  four decades misses the middle (gloo's 4-process all-gathers of 64 KiB-1 MiB by 40 %).
* **offload copies** (``host_copy_Bps``, ``disk_Bps``): ``python -m lslm.bench.zero_offload``'s rows with glibc's
  default allocator (``zero_offload.json``: ZeRO-3 on a separate 86.7M-parameter GPT, 2 processes, offload
  ``none``, ``cpu`` and ``disk``, with the exact bytes each step copies): the host rate is the bytes copied to
  and from the host over what ``cpu`` adds to ``none``'s step, the disk rate the bytes read and written over
  what ``disk`` adds to ``cpu``'s. Out of sample for the ZeRO rows validated here (another model, 25x larger).
* **optimizer step** (``optimizer_Bps``): ``lslm bench zero``'s torch-DDP entry at 2 processes (``zero.json``:
  the AdamW step on all parameters, no communication): ``N x 80 bytes / t``.
* **cores**: 2, the machine the benches ran on (``nproc``; DESIGN.md's 2-core CI machine), not read from a file.
"""

from __future__ import annotations

from typing import Any

from lslm.metrics.collective_costs import cost_coefficients
from lslm.plan.hardware import OPTIMIZER_BYTES, Hardware, Link
from lslm.plan.model import ModelSpec
from lslm.plan.timing import layer_forward_flops

__all__ = ["CORES", "FIT_SCHEDULES", "RING", "calibrate_cpu_box", "cpu_box_hardware", "fit_link", "measured_table",
           "offload_rates"]

CORES = 2
#: the pipeline bench's schedules whose stage costs are a forward and a whole backward (F, B)
FIT_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
#: gloo collective -> the ring algorithm of :func:`cost_coefficients` that prices it
RING = {"all_reduce": "all_reduce_ring", "all_gather": "all_gather_ring", "reduce_scatter": "reduce_scatter_ring"}


def _lstsq_positive(rows: list[list[float]], t: list[float]) -> list[float]:
    """Least squares of ``rows @ x = t`` in relative error, coefficients that come out negative dropped."""
    import numpy as np

    A, y = np.array(rows, dtype=float), np.array(t, dtype=float)
    cols = list(range(A.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(A[:, cols] / y[:, None], np.ones_like(y), rcond=None)
        if (coef >= 0).all() or len(cols) == 1:
            break
        cols = [c for c, v in zip(cols, coef) if v >= 0]
    out = [0.0] * A.shape[1]
    for c, v in zip(cols, coef):
        out[c] = float(v)
    return out


def fit_link(rows: list[dict[str, Any]], algorithm: str) -> tuple[float, float]:
    """``(alpha_s, bandwidth_Bps)`` of ``algorithm`` fitted to ``rows`` (``bytes``, ``time_s``, ``world_size``)."""
    coeffs = [cost_coefficients(algorithm, r["world_size"]) for r in rows]
    alpha, beta = _lstsq_positive([[a, b * r["bytes"]] for (a, b, _), r in zip(coeffs, rows)],
                                  [r["time_s"] for r in rows])
    return alpha, (1 / beta if beta > 0 else float("inf"))


def _compute_fit(pipeline: dict[str, Any]) -> dict[str, Any]:
    res = pipeline["2"]
    cfg = res["model"]
    obs = []
    for r in res["rows"]:
        if r["pair"] not in FIT_SCHEDULES:
            continue
        seqs = res["batch"] // r["m"]
        spec = ModelSpec(cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["vocab_size"], cfg["block_size"],
                         micro_batch=seqs, global_batch=seqs)
        flops = sum(layer_forward_flops(spec, seqs))
        layers = cfg["n_layer"] // (res["p"] * r["v"])
        cost = r["stage_costs_ms"]["0"]
        obs += [("F", layers, flops, cost["F"] * 1e-3), ("B", layers, 2 * flops, cost["B"] * 1e-3)]
    inv_rate, c_f, c_b = _lstsq_positive([[n * f, n * (k == "F"), n * (k == "B")] for k, n, f, _ in obs],
                                         [t for *_, t in obs])
    errors = [(n * (f * inv_rate + (c_f if k == "F" else c_b))) / t - 1 for k, n, f, t in obs]
    return {"rate_flops": 1 / inv_rate, "layer_forward_s": c_f, "layer_backward_s": c_b,
            "points": len(obs), "max_rel_error": max(abs(e) for e in errors)}


def measured_table(rows: list[dict[str, Any]]) -> tuple[tuple[float, float], ...]:
    """``(bytes, time_s)`` of ``rows`` (one algorithm at one group size) in increasing size."""
    return tuple(sorted((float(r["bytes"]), float(r["time_s"])) for r in rows))


def offload_rates(zero_offload: dict[str, Any], allocator: str = "glibc default") -> dict[str, float]:
    """``host_copy_Bps`` and ``disk_Bps`` from ``zero_offload.json``'s rows with ``allocator`` (module doc): bytes
    moved per step per process over the step time each offload adds (the mean over ranks of each step)."""
    rows = {r["offload"]: r for r in zero_offload["rows"] if r["allocator"] == allocator}
    step = {k: sum(r["step_ms"]) / len(r["step_ms"]) * 1e-3 for k, r in rows.items()}
    host = rows["cpu"]["to_host_bytes"] + rows["cpu"]["to_device_bytes"]
    disk = rows["disk"]["disk_read_bytes"] + rows["disk"]["disk_write_bytes"]
    if not (step["cpu"] > step["none"] and step["disk"] > step["cpu"] and host > 0 and disk > 0):
        raise ValueError(f"zero_offload.json ({allocator}): offload must add time and move bytes to give a rate; "
                         f"got steps {step} s, host {host} B, disk {disk} B: rerun "
                         "`python -m lslm.bench.zero_offload` quietly")
    return {"host_copy_Bps": host / (step["cpu"] - step["none"]), "disk_Bps": disk / (step["disk"] - step["cpu"])}


def calibrate_cpu_box(pipeline: dict[str, Any], collectives: dict[str, Any], zero: dict[str, Any],
                      zero_offload: dict[str, Any]) -> dict[str, Any]:
    """The cpu-box constants from the four committed artifacts read as dicts (module doc), with their sources."""
    compute = _compute_fit(pipeline)
    links = {}
    for world in ("2", "4"):
        res = collectives[world]
        per, measured = {}, {}
        for kind, algorithm in RING.items():
            rows = [r for r in res["rows"] if r["algorithm"] == f"torch.{kind}"]
            assert {r["world_size"] for r in rows} == {int(world)}, "a table holds one group size"
            per[algorithm] = fit_link(rows, algorithm)
            measured[algorithm] = measured_table(rows)
        fit = res["fit"]
        links[world] = {"alpha_s": fit["alpha_s"], "bandwidth_Bps": 1 / fit["beta_s_per_byte"], "per_algorithm": per,
                        "measured": measured}
    ddp = next(r for r in zero["2"]["rows"] if r["entry"] == "ddp")
    n = zero["2"]["num_parameters"]
    optimizer_Bps = n * OPTIMIZER_BYTES["adamw"] / (ddp["optimizer_ms"] * 1e-3)
    return {"compute": compute, "links": links, "optimizer_Bps": optimizer_Bps, "cores": CORES,
            **offload_rates(zero_offload),
            "sources": {"compute": "bench/results/pipeline.json, p=2, stage 0's F and B (GPipe/1F1B/interleaved)",
                        "links": "bench/results/collectives.json, torch rows per algorithm (per-algorithm fits and "
                                 "measured tables) and 'fit' (point-to-point), at 2 (intra) and 4 (inter) processes",
                        "host_copy_Bps": "bench/results/zero_offload.json, glibc default, offload cpu vs none",
                        "disk_Bps": "bench/results/zero_offload.json, glibc default, offload disk vs cpu",
                        "optimizer_Bps": "bench/results/zero.json, p=2, entry 'ddp', optimizer_ms (fp32 AdamW)",
                        "cores": "the benches' machine: 2 cores"}}


def cpu_box_hardware(cal: dict[str, Any]) -> Hardware:
    """The :class:`Hardware` that :func:`calibrate_cpu_box`'s constants describe (``hardware_presets()["cpu-box"]``
    holds the same numbers, rounded; a test keeps the two equal)."""
    def link(world: str) -> Link:
        d = cal["links"][world]
        return Link(d["alpha_s"], d["bandwidth_Bps"],
                    tuple((name, a, bw) for name, (a, bw) in sorted(d["per_algorithm"].items())),
                    tuple((name, int(world), points) for name, points in sorted(d["measured"].items())))

    c = cal["compute"]
    return Hardware("CPU box (gloo)", {"fp32": c["rate_flops"]}, hbm_bytes=11 * 2**30, devices_per_node=2,
                    intra=link("2"), inter=link("4"), dropout_mask_bytes=4,
                    layer_overhead_s=(c["layer_forward_s"], c["layer_backward_s"]),
                    optimizer_Bps=cal["optimizer_Bps"], cores=cal["cores"], host_copy_Bps=cal["host_copy_Bps"],
                    disk_Bps=cal["disk_Bps"])
