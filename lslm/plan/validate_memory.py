"""The calculator's memory against lslm's GPT measured on one H200 in bf16 autocast: peak and model states per run.

Two committed artifacts (``bench/results/gpu/``, copies of the project's shared GPU data, measured by
``calibrate.py`` there with torch 2.11 + CUDA 13.0): ``h200_recompute_2026-11-28.json`` (407M and 1.4B parameters,
recomputation none / selective / full; superseded by the newest ``lslm gpu-check`` record of an H200 that measured
them again, :func:`recompute_file`) and the eager rows of ``gpt`` in ``h200_2026-11-28.json`` (124M to 2.7B).
Every run: lslm's GPT (untied head, biases, no dropout, ``block_size`` = the sequence), one micro-batch per step
on one GPU, ``torch.autocast("cuda", torch.bfloat16)`` over fp32 weights, flash attention through
``F.scaled_dot_product_attention``, fused AdamW, ``zero_grad(set_to_none=True)``, the logits kept by the caller
(``_, loss = model(idx, idx)``). The measured bytes are ``torch.cuda.memory_allocated()`` before the step's
forward (``mem_states_bytes``: fp32 weights and Adam's moments, the gradients having been set to None) and
``torch.cuda.max_memory_allocated()`` over the step (``mem_peak_bytes``).

For each run :func:`validate_memory` builds the :class:`ModelSpec` and the :class:`Layout` from the row
(``mixed="autocast"``, ``flash_attention=True``, the row's recomputation) and predicts the peak
(:attr:`StageMemory.total`) and the states before the forward (:attr:`StageMemory.states_before_forward`),
``error = predicted / measured - 1``. Nothing in :mod:`lslm.plan` was fitted to these rows: the counts are
tensor by tensor (:mod:`lslm.plan.autocast`). Beside them, the prediction with ``mixed="masters"`` (the calculator
before it modelled autocast: 2-byte activations, 18 bytes per parameter of states, all resident).

What the calculator leaves out, and so where the rows miss. Bytes that are not the model's: the measured states
exceed Adam's and the weights' ``12 Ψ`` by 65-122 MiB in the ``gpt`` rows and in the recompute file's first run
(the process's own allocations, e.g. cuBLAS workspaces; not modelled), and the recompute file's later runs, made
one after another in one process, start with 0.45-1.48 GB more than that (450 MiB at 407M full, 453 MiB at
1.4B none and selective, 1,479 MiB at 1.4B full): allocations left alive by the runs before them, by
expectation, since the script that measured that file is not committed (its committed successor,
:func:`lslm.bench.calibrate.gpt_recompute`, frees each run before the next, a recomputed model being a reference
cycle, and records what was left allocated before each as ``mem_start_bytes``). No term is added for them. The
allocator's slack: these are allocated bytes (``memory_allocated``, which include the caching allocator's
rounding of each block to 512 bytes, not counted); what it reserved beyond them (``reserved_bytes`` in the
``gpt`` rows: 0.1-5.4 GB over the peak) is fragmentation the calculator leaves to
:attr:`~lslm.plan.hardware.Hardware.reserved_bytes`, not modelled. Those rows give both figures from one process
(``calibrate.py``: ``max_memory_allocated`` over a step, ``memory_reserved`` after the timed steps, which the
caching allocator does not give back), so :func:`reserved_ratio_range` reads the range of reserved / allocated
from them: data measured here, not fitted to any published row; :func:`lslm.plan.published.format_published`
sets a reported reserved peak (torchtitan's) beside the predicted tensor bytes times it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lslm.plan.layout import Layout
from lslm.plan.memory import stage_memory
from lslm.plan.model import ModelSpec

__all__ = ["GPU_FILES", "MEMORY_TOLERANCE", "format_memory_validation", "load_gpu_rows", "recompute_file",
           "recompute_rows", "reserved_ratio_range", "validate_memory"]

GPU_FILES = ("h200_recompute_2026-11-28.json", "h200_2026-11-28.json")
MEMORY_TOLERANCE = 0.10  #: the issue's target: peak memory within 10 % per run


def recompute_file(folder: str | Path) -> Path:
    """The recomputation runs :func:`load_gpu_rows` reads under ``folder``: the newest ``lslm gpu-check`` record
    of an H200 (``gpu-check_h200_<date>*.json``, not a dry run) whose ``recompute`` step measured every run
    (:func:`lslm.bench.calibrate.gpt_recompute`, replays under autocast), else ``GPU_FILES[0]``, the shared runs
    of 2026-11-28 (whose full-recomputation replays ran in fp32)."""
    found = []
    for path in Path(folder).glob("gpu-check_h200_*.json"):
        data = json.loads(path.read_text())
        runs = data.get("recompute")
        if data.get("dry_run") or not isinstance(runs, list) or not runs or any("error" in r for r in runs):
            continue
        found.append((str(data.get("date", "")), path.name, path))
    return max(found)[2] if found else Path(folder) / GPU_FILES[0]


def load_gpu_rows(folder: str | Path) -> list[dict[str, Any]]:
    """The runs under ``folder`` (``bench/results/gpu``), each with a ``source`` label and its ``file``: every
    recomputation run of :func:`recompute_file`, then the eager rows of ``GPU_FILES[1]``'s ``gpt`` table."""
    folder = Path(folder)
    missing = [name for name in GPU_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder} lacks {', '.join(missing)}: copy them from the project's shared GPU data "
                         "(../shared/gpu/) or pass the folder that holds them")
    source = recompute_file(folder)
    recompute = json.loads(source.read_text())
    table = json.loads((folder / GPU_FILES[1]).read_text())
    rows = [dict(r, source="recompute", file=source.name) for r in recompute_rows(recompute, source.name)]
    rows += [dict(r, source="gpt", recompute="none", file=GPU_FILES[1]) for r in table["gpt"]
             if not r.get("compiled") and "mem_peak_bytes" in r]
    return rows


def recompute_rows(data: dict[str, Any], name: str = "the file") -> list[dict[str, Any]]:
    """The recomputation runs of one file: ``rows`` of the shared ``h200_recompute_*.json``, or ``recompute`` of a
    ``lslm gpu-check`` record (:func:`lslm.bench.calibrate.gpt_recompute`, same fields plus the dtypes the replays
    ran in), runs that failed left out. ValueError unless it was measured on an H200 (the ``h200`` preset's GPU)."""
    if "H200" not in str(data.get("device", "")):
        raise ValueError(f"{name} was measured on {data.get('device')!r}; these checks price the h200 preset")
    runs = data.get("rows", data.get("recompute"))
    if not isinstance(runs, list):
        raise ValueError(f"{name} holds no recomputation runs (neither 'rows' nor a gpu-check 'recompute' list)")
    return [r for r in runs if "error" not in r]


def _spec(r: dict[str, Any]) -> ModelSpec:
    return ModelSpec(r["n_layer"], r["n_embd"], r["n_head"], r["vocab"], r["seq"], micro_batch=r["micro_batch"],
                     global_batch=r["micro_batch"], tied=False, bias=True, max_positions=r["seq"], dropout=False,
                     name="lslm GPT")


def validate_memory(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: ``source``, ``config``, measured ``peak`` / ``states`` / ``activations`` bytes, the
    predictions (``mixed="autocast"``) and their errors, and ``before_*``: the same with ``mixed="masters"``
    (module doc). ``activations`` is the measured peak less the states before the forward."""
    out = []
    for r in rows:
        spec = _spec(r)
        found = {}
        for mixed in ("autocast", "masters"):
            mem = stage_memory(spec, Layout(flash_attention=True, recompute=r["recompute"], mixed=mixed), 1, 0)
            found[mixed] = (mem.total, mem.states_before_forward, mem.activations.value)
        (peak, states, acts), (peak0, states0, acts0) = found["autocast"], found["masters"]
        m_peak, m_states = r["mem_peak_bytes"], r["mem_states_bytes"]
        m_acts = m_peak - m_states
        out.append({"source": r["source"], "config": f"{r['params'] / 1e9:.2f}B b={r['micro_batch']} {r['recompute']}",
                    "measured_peak": m_peak, "measured_states": m_states, "measured_activations": m_acts,
                    "peak": peak, "states": states, "activations": acts,
                    "peak_error": peak / m_peak - 1, "states_error": states / m_states - 1,
                    "activations_error": acts / m_acts - 1,
                    "before_peak_error": peak0 / m_peak - 1, "before_states_error": states0 / m_states - 1,
                    "before_activations_error": acts0 / m_acts - 1})
    return out


def format_memory_validation(rows: list[dict[str, Any]], tolerance: float = MEMORY_TOLERANCE) -> str:
    """The rows side by side (GB = 1e9 bytes); the last line is the worst peak error and how many are within."""
    gb = 1e9
    lines = [f"{'file':<10}{'run':<20}{'peak GB':>8}{'pred':>7}{'err':>7}{'states':>8}{'pred':>7}{'err':>7}"
             f"{'act GB':>8}{'err':>7}   before (masters): peak / states / act err"]
    for r in rows:
        flag = "" if abs(r["peak_error"]) <= tolerance else " *"
        lines.append(f"{r['source']:<10}{r['config']:<20}{r['measured_peak'] / gb:>8.2f}{r['peak'] / gb:>7.2f}"
                     f"{r['peak_error']:>+7.1%}{r['measured_states'] / gb:>8.2f}{r['states'] / gb:>7.2f}"
                     f"{r['states_error']:>+7.1%}{r['measured_activations'] / gb:>8.2f}{r['activations_error']:>+7.1%}"
                     f"   {r['before_peak_error']:+.1%} / {r['before_states_error']:+.1%} / "
                     f"{r['before_activations_error']:+.1%}{flag}")
    worst = max(rows, key=lambda r: abs(r["peak_error"]))
    within = sum(abs(r["peak_error"]) <= tolerance for r in rows)
    lines.append(f"(* peak beyond {tolerance:.0%}) {within} of {len(rows)} runs' peaks within {tolerance:.0%}; worst "
                 f"{worst['peak_error']:+.1%} ({worst['source']} {worst['config']}); states before the forward: "
                 f"worst {max(abs(r['states_error']) for r in rows):.1%}")
    return "\n".join(lines)


def reserved_ratio_range(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(least, most) of ``reserved_bytes / mem_peak_bytes`` over the runs of ``rows`` that report both (the eager
    ``gpt`` rows of :func:`load_gpu_rows`): how far the caching allocator's reserved bytes stood above its
    allocated peak on the H200 (module doc)."""
    ratios = [r["reserved_bytes"] / r["mem_peak_bytes"] for r in rows if r.get("reserved_bytes")]
    if not ratios:
        raise ValueError("no run reports both reserved_bytes and mem_peak_bytes (the gpt rows of "
                         f"{GPU_FILES[1]} do)")
    return min(ratios), max(ratios)
