"""What offloading ZeRO's optimizer states costs and saves: peak RSS and step time, states in memory, host, disk.

The ZeRO recipe (:mod:`lslm.recipes.zero`) at stage 3 in bf16 on 2 processes, three times on the
same GPT and data (and all three again under a fixed glibc mmap threshold, :data:`ALLOCATORS`):
states with the parameters (``offload=None``), in host memory (``"cpu"``) and in files streamed
through memory in chunks (``"disk"``, a temporary folder). Per run and rank: the process's peak
RSS (the whole process: Python, the model's build, activations, states), the median step time
after the first step, and the bytes moved to and from the host and the disk per step. On a
CPU-only machine host and device are one memory: ``cpu`` cannot lower the RSS (it moves the
states within the same memory and adds a gradient buffer) and measures the copies' cost;
``disk`` really takes the fp32 masters and Adam's moments out of memory.

    python -m lslm.bench.zero_offload        # writes bench/results/zero_offload.{txt,json}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["ALLOCATORS", "BENCH_MODEL", "main", "run", "table"]

#: GPT-2 small's 12 blocks of width 768 (vocabulary 1024): 86.5 M parameters; in bf16 with fp32 masters, Adam's
#: states and masters are 12 bytes per parameter, 519 MB per rank at 2 ranks: large enough that the states, not
#: the interpreter and the activations, decide the peak (at 26 M parameters the 16 MiB chunk buffers ate most of
#: the saving).
BENCH_MODEL = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=1024, block_size=64)
QUICK_MODEL = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1024, block_size=64)
MODES = (None, "cpu", "disk")


#: The glibc allocator settings each mode runs under. By default glibc raises its mmap threshold to the size of
#: the largest block freed (up to 32 MiB), so blocks of a few MiB then come from the heap and freed ones stay in
#: the process: its peak counts them. A fixed threshold (``MALLOC_MMAP_THRESHOLD_``, read at process start)
#: returns every block above it to the system when freed. Both are run, every mode under each.
ALLOCATORS = {"glibc default": None, "mmap threshold 1 MiB": str(2**20)}


def run(model: dict[str, Any] | None = None, steps: int = 6, nproc: int = 2, timeout: float = 900.0,
        allocators: dict[str, str | None] | None = None) -> list[dict[str, Any]]:
    """One recipe launch per allocator setting (default :data:`ALLOCATORS`) and offload mode; a record per launch
    with every rank's figures."""
    from lslm.recipes import zero as recipe

    model = dict(model or BENCH_MODEL)
    rows = []
    for allocator, threshold in (allocators or ALLOCATORS).items():
        for mode in MODES:
            saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
            if threshold is not None:  # the launched processes inherit it (glibc reads it once, at their start)
                os.environ["MALLOC_MMAP_THRESHOLD_"] = threshold
            try:
                with tempfile.TemporaryDirectory(prefix="lslm-zero-offload-") as folder:
                    res = recipe.run(nproc, output="none", timeout=timeout, stage=3, precision="bf16", steps=steps,
                                     batch_size=2 * nproc, log_every=1000, offload=mode,
                                     offload_dir=folder if mode == "disk" else None, **model)
            finally:
                os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
                if saved is not None:
                    os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
            rows.append({"allocator": allocator, "offload": mode or "none",
                         "num_parameters": res[0]["num_parameters"], "owned_params": res[0]["owned_params"],
                         "peak_rss_bytes": [r["memory"]["peak_rss"] for r in res],
                         "step_ms": [1e3 * statistics.median(r["step_s"][1:]) for r in res],
                         "to_host_bytes": res[0]["offload_to_host_bytes"][-1],
                         "to_device_bytes": res[0]["offload_to_device_bytes"][-1],
                         "disk_read_bytes": res[0]["disk_read_bytes"][-1],
                         "disk_write_bytes": res[0]["disk_write_bytes"][-1],
                         "losses": res[0]["losses"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as text: peak RSS and step time (the largest over ranks), bytes moved per step, vs no offload under
    the same allocator setting."""
    mb = 1e6
    first = rows[0]
    owned = first.get("owned_params")
    lines = [f"ZeRO stage 3, bf16, {len(first['peak_rss_bytes'])} processes, GPT {first['num_parameters']:,} params"
             + (f" ({owned:,} owned by rank 0: {12 * owned / mb:,.1f} MB of fp32 masters + Adam moments)"
                if owned else "") + "; per rank (largest over ranks):",
             f"{'allocator':<21} {'offload':<8} {'peak RSS MB':>11} {'vs none':>8} {'step ms':>8} {'vs none':>8} "
             f"{'host MB/step':>12} {'disk MB/step':>12} {'same losses':>11}"]
    for r in rows:
        base = next(b for b in rows if b.get("allocator") == r.get("allocator") and b["offload"] == "none")
        rss, ms = max(r["peak_rss_bytes"]), max(r["step_ms"])
        host = (r["to_host_bytes"] + r["to_device_bytes"]) / mb
        disk = (r["disk_read_bytes"] + r["disk_write_bytes"]) / mb
        lines.append(f"{r.get('allocator', ''):<21} {r['offload']:<8} {rss / mb:>11.1f} "
                     f"{rss / max(base['peak_rss_bytes']):>7.2f}x {ms:>8.1f} {ms / max(base['step_ms']):>7.2f}x "
                     f"{host:>12.1f} {disk:>12.1f} {str(r['losses'] == base['losses']):>11}")
    lines.append("peak RSS: the whole process (interpreter, model build, activations, states); host MB: gradient "
                 "slice down + weights up; disk MB: states read + written. On a CPU-only machine host and device "
                 "are one memory: `cpu` moves the states within it (no RSS saved); `disk` takes them out of memory "
                 "(3 chunk buffers stay). RSS and bytes are exact; step times are noisy here (2 cores shared with "
                 "other jobs): read them as a rough slowdown.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Command line: run, print the table, write ``--out`` (``.txt`` and ``.json``)."""
    parser = argparse.ArgumentParser(prog="python -m lslm.bench.zero_offload", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/zero_offload", help="path without extension")
    parser.add_argument("--steps", type=int, default=6, help="training steps per mode (the first is not timed)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, glibc's default allocator only (a smoke "
                        "run, not the committed table)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first step is not timed), got {args.steps}")
    model = QUICK_MODEL if args.quick else BENCH_MODEL
    rows = run(model, steps=args.steps, allocators=dict(list(ALLOCATORS.items())[:1]) if args.quick else None)
    text = table(rows)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"model": model, "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
