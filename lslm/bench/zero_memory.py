"""ZeRO's step peaks by the allocator and by lslm's counters: stages 1, 2, 3, 3 kept gathered and 3 without
prefetch, 2 and 4 ranks.

Per rank, in the same processes, every variant trains the same GPT (one seed, the same tokens) for
three fp32 AdamW steps: a warm-up (Adam's states come to exist), one counted by lslm
(:func:`~lslm.metrics.held.held_by_owner` after it plus :func:`~lslm.metrics.allocations.track_live_bytes`'
peak during it) and one read from glibc's allocator (:func:`~lslm.metrics.step_memory.measure_step_memory`:
before, peak and after, and glibc's reading after each unit's forward). ``total`` is the allocator's peak
over what the process held before the variant's model and optimizer were built: states and step together.
Next to them, :mod:`lslm.metrics.zero3_window`'s prediction of the gaps (stage 3 against keep and against
stage 2) from the unit sizes. Then one more stage-3 step under PyTorch's memory profiler gives its bytes by
category at the peak. The numbers are byte counts, not timings: load does not skew them::

    python -m lslm.bench.zero_memory       # writes bench/results/zero_memory.{txt,json}
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lslm.bench.checks import memory_bench_args
from lslm.launcher.launch import launch
from lslm.metrics.allocations import track_live_bytes
from lslm.metrics.held import held_by_owner
from lslm.metrics.malloc import malloc_in_use_bytes
from lslm.metrics.step_memory import measure_step_memory
from lslm.metrics.zero3_window import zero3_freed_bytes, zero3_saving_vs_stage2, zero3_window_bytes
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.startup import init_distributed
from lslm.zero import ZeroOptimizer

__all__ = ["MODEL", "QUICK_MODEL", "VARIANTS", "main", "predictions", "run", "table", "worker"]

#: The course GPT with six blocks of width 256 and a 256-token vocabulary: each block (3.2 MB in fp32) is five
#: times the root (embeddings, head and final norm), so the units' tensors dominate what the allocator sees; and
#: with :data:`ROWS` rows the activations put every variant's peak at the start of backward, where
#: :mod:`lslm.metrics.zero3_window` predicts the gaps (with fewer, the gradients' staging and reduce-scatter
#: buffers in the middle of backward set stage 3's peak instead).
MODEL = dict(vocab_size=256, block_size=64, n_layer=6, n_head=4, n_embd=256)
#: A smaller one for a smoke run (``--quick``): four blocks, still more units than stage 3 keeps at once.
QUICK_MODEL = dict(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64)
#: Stages 1-3, stage 3 keeping each unit gathered from its forward to its backward, and stage 3 gathering each unit
#: only when it is needed (``prefetch=0``): its gap to keep has no gloo copy of a prefetched unit in it, so the
#: formula predicts it exactly.
VARIANTS = ("zero1", "zero2", "zero3", "zero3-keep", "zero3-prefetch0")
ROWS = 8  # rows per rank per step
LR = 1e-3


def _adamw(net: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(net.parameters(), lr=LR, betas=(0.9, 0.95), foreach=False)


def _zero(kind: str, serial: GPT, ctx: Any, bucket_cap_mb: float) -> tuple[nn.Module, ZeroOptimizer]:
    net = copy.deepcopy(serial)
    return net, ZeroOptimizer(net, _adamw(net), ctx, stage=int(kind[4]), bucket_cap_mb=bucket_cap_mb,
                              reshard_after_forward="keep" not in kind, prefetch=0 if "prefetch0" in kind else 1)


def _unit_samples(net: nn.Module) -> tuple[list[int], list[Any]]:
    """glibc's reading after each block's forward (after stage 3's own hook, registered first, has freed it)."""
    readings: list[int] = []
    handles = [block.register_forward_hook(lambda *_: readings.append(malloc_in_use_bytes() or 0))
               for block in net.blocks]
    return readings, handles


def predictions(buckets: list[int], stage2_param_numel: int, world: int, gather_copy: bool,
                itemsize: int = 4) -> dict[str, Any]:
    """The gaps :mod:`lslm.metrics.zero3_window` predicts from stage 3's bucket sizes (units in backward order,
    then the root, as ``ZeroOptimizer.buckets`` lists them) and stage 2's padded parameter count; ``gather_copy``:
    the backend copies a unit while gathering it (gloo)."""
    units = [itemsize * n for n in buckets[:-1]][::-1]  # forward order
    root = itemsize * buckets[-1]
    return {"window": zero3_window_bytes(units, root), "gather_copy": gather_copy,
            "window_with_copy": zero3_window_bytes(units, root, gather_copy=gather_copy),
            "keep_minus_zero3": zero3_freed_bytes(units),
            "keep_minus_zero3_with_copy": zero3_freed_bytes(units, gather_copy=gather_copy),
            "keep_minus_zero3_prefetch0": zero3_freed_bytes(units, prefetch=0),
            "zero2_minus_zero3": zero3_saving_vs_stage2(itemsize * stage2_param_numel, itemsize * sum(buckets),
                                                        world, units, root, gather_copy=gather_copy),
            "units": units, "root": root}


def worker(model: dict[str, int] | None = None, rows: int = ROWS, variants: list[str] | None = None,
           bucket_cap_mb: float = 0.5, categories: bool = True, counted: bool = True) -> dict[str, Any]:
    """One rank: every variant (:data:`VARIANTS`, or those named) measured as the module doc says; ``categories``:
    the profiled stage-3 step too; ``counted``: lslm's count too (each costs a step; the tests skip both)."""
    variants = list(VARIANTS if variants is None else variants)
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"variants must be among {VARIANTS}, got {bad}")
    with init_distributed(seed=0) as ctx:
        world, rank = ctx.world_size, ctx.rank
        torch.manual_seed(0)
        serial = GPT(GPTConfig(**(model or MODEL))).to(ctx.device)
        cfg = serial.config
        g = torch.Generator().manual_seed(1)
        data = [torch.randint(0, cfg.vocab_size, (rows * world, cfg.block_size + 1),
                              generator=g)[rank * rows:(rank + 1) * rows].to(ctx.device)  # lslm: cpu-ok (moved)
                for _ in range(4)]
        out: dict[str, Any] = {"rank": rank, "world": world, "model": dict(model or MODEL), "rows": rows,
                               "bucket_cap_mb": bucket_cap_mb, "glibc": malloc_in_use_bytes() is not None,
                               "variants": {}}
        # A throwaway stage-3 step: a process's first collectives and optimizer steps allocate for good (gloo's
        # transport buffers, kernels' caches), which the first variant's readings would otherwise carry.
        net, zero = _zero("zero3", serial, ctx, bucket_cap_mb)
        zero.backward(net(data[0][:, :-1], data[0][:, 1:])[1])
        zero.step()
        del net, zero
        for kind in variants:
            gc.collect()
            before_build = malloc_in_use_bytes() or 0
            net, zero = _zero(kind, serial, ctx, bucket_cap_mb)

            def step(batch: torch.Tensor, net: nn.Module = net, zero: ZeroOptimizer = zero) -> None:
                zero.zero_grad()
                _, loss = net(batch[:, :-1], batch[:, 1:])
                zero.backward(loss)
                zero.step()

            step(data[0])  # warm-up: Adam's states exist from here on
            total_counted = None
            if counted:
                with track_live_bytes() as live:  # lslm's count, on a step of its own: its bookkeeping mallocs too
                    step(data[1])
                total_counted = sum(held_by_owner(net, zero).values()) + int(live.peak[ctx.device.type])
            readings, handles = _unit_samples(net)
            mem = measure_step_memory(functools.partial(step, data[2]), ctx.device)
            for h in handles:
                h.remove()
            row: dict[str, Any] = {"counted_peak": total_counted, "before": mem.before, "peak": mem.peak,
                                   "after": mem.after, "step_peak": mem.step_peak,
                                   "total": mem.peak - before_build if mem.peak is not None else None,
                                   "after_unit_forward": [r - mem.before for r in readings] if mem.before else None,
                                   "buckets": [z - a for a, z, _, _ in zero.buckets], "numel": zero.numel}
            if kind == "zero3" and categories:
                for _ in range(3):  # the profiler's own trace check fails now and then: another step then
                    prof = measure_step_memory(functools.partial(step, data[3]), ctx.device,
                                               categories=True)
                    # Every rank must take the same number of steps (their collectives pair up): agree on success.
                    failed = torch.tensor([float(prof.categories is None)], device=ctx.device)
                    ctx.comm.all_reduce(failed, label="zero_memory: profiled step failed somewhere")
                    if not failed.item():
                        break
                row["categories_at_peak"] = prof.categories
                row["categories_error"] = prof.categories_error
                row["profiled_peak"] = prof.profiled_peak
            out["variants"][kind] = row
            # Nothing of this variant may outlive it: the next one's ``before_build`` must not count it.
            del net, zero, mem, step
        if "zero3" in out["variants"] and "zero2" in out["variants"]:
            out["predicted"] = predictions(out["variants"]["zero3"]["buckets"], out["variants"]["zero2"]["numel"],
                                           world, gather_copy=ctx.backend == "gloo")
    return out


def run(model: dict[str, int] | None = None, sizes: tuple[int, ...] = (2, 4), timeout: float = 600.0,
        **kwargs: Any) -> dict[int, list[dict[str, Any]]]:
    """Launch :func:`worker` once per world size; every rank's record, by world size."""
    return {n: list(launch("lslm.bench.zero_memory:worker", nproc=n, timeout=timeout, output="none",
                           model=dict(model or MODEL), **kwargs)) for n in sizes}


def table(results: dict[int, list[dict[str, Any]]]) -> str:
    """Per world size, rank 0: each variant's peak counted and by the allocator, the gaps against the formula, and
    the profiler's categories at stage 3's peak."""
    mb = 1e6
    lines = []
    for n, ranks in results.items():
        r = ranks[0]
        v, p = r["variants"], r.get("predicted", {})
        lines.append(f"{n} ranks, rank 0 (MB; total = allocator peak over what the rank held before building the "
                     f"variant; counted = lslm's held states + its step peak):")
        lines.append(f"{'variant':>15} | {'counted':>8} | {'total':>8} | {'step peak':>9} | {'after':>8}")
        for kind, row in v.items():
            total = row["total"] / mb if row["total"] is not None else float("nan")
            step_peak = row["step_peak"] / mb if row["step_peak"] is not None else float("nan")
            lines.append(f"{kind:>15} | {row['counted_peak'] / mb:8.3f} | {total:8.3f} | {step_peak:9.3f} | "
                         f"{(row['after'] - row['before']) / mb if row['before'] else float('nan'):8.3f}")
        if p and all(v[k]["total"] is not None for k in ("zero2", "zero3", "zero3-keep")):
            got = v["zero3-keep"]["total"] - v["zero3"]["total"]
            lo, hi = p["keep_minus_zero3_with_copy"], p["keep_minus_zero3"]
            lines.append(f"  zero3-keep - zero3: measured {got / mb:.3f}; predicted {hi / mb:.3f} (the units freed "
                         f"but the window), {lo / mb:.3f} with gloo's copy of the prefetched unit in flight: "
                         f"{got / hi:.3f}x and {got / lo:.3f}x")
            if v.get("zero3-prefetch0", {}).get("total") is not None:
                got0, want0 = v["zero3-keep"]["total"] - v["zero3-prefetch0"]["total"], p["keep_minus_zero3_prefetch0"]
                lines.append(f"  zero3-keep - zero3-prefetch0: measured {got0 / mb:.3f}; predicted {want0 / mb:.3f} "
                             f"(every unit but the forward's last; nothing prefetched): {got0 / want0:.3f}x")
            got = v["zero2"]["total"] - v["zero3"]["total"]
            lines.append(f"  zero2 - zero3: measured {got / mb:.3f}; parameters alone predict "
                         f"{p['zero2_minus_zero3'] / mb:.3f} (the gradients' buffers at the two peaks differ)")
            lines.append(f"  stage 3's window (root + current + prefetch): {p['window'] / mb:.3f}; after each "
                         f"block's forward, zero3 - zero2: " + ", ".join(
                             f"{(a - b) / mb:.3f}" for a, b in zip(v["zero3"]["after_unit_forward"],
                                                                  v["zero2"]["after_unit_forward"], strict=True)))
        cats = v.get("zero3", {}).get("categories_at_peak")
        if cats:
            lines.append("  zero3's step at its profiled peak, by the profiler's category (MB): " + ", ".join(
                f"{k} {b / mb:.3f}" for k, b in cats.items() if b))
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> dict[int, list[dict[str, Any]]]:
    """Command line: run :func:`run`, print the table, write ``--out`` (``.txt`` and ``.json``, with the command)."""
    args = memory_bench_args("python -m lslm.bench.zero_memory", __doc__, "bench/results/zero_memory", "2,4", argv)
    sizes = args.sizes
    command = " ".join(["python -m lslm.bench.zero_memory", *map(shlex.quote, sys.argv[1:] if argv is None
                                                                  else argv)])
    model = QUICK_MODEL if args.quick else MODEL
    results = run(model, sizes=sizes)
    text = table(results) + f"\ncommand: {command}"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"command": command, "model": model,
                                                    "results": {str(n): r for n, r in results.items()}},
                                                   indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
