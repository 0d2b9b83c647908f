"""What the communication ledger costs per call: a bare ``torch.distributed`` call vs lslm's ``Comm``.

Four variants of the same all-reduce of one fp32 number, interleaved round by round in one
process: ``torch`` (``dist.all_reduce``), ``disabled`` (``Comm``
with ``ledger.enabled = False``: counted, nothing recorded), ``enabled`` (the default: a
record with its issue time, the axis name) and ``timed`` (enabled with completion times,
``ledger.record_completion = True``, as timelines ask for). Each round times ``calls`` calls
per variant; the table gives the median over rounds of the time per call and the overhead
over ``torch``. Synchronous and ``async_op=True`` (then the work is waited) are measured
separately: a timed asynchronous call also gets a work wrapper and a callback on its future.

The world is torch's fake process group (2 ranks) whose collectives return at once, so what
is timed is the Python around the call and nothing else (it lives in torch's internal testing
package, imported here only). A real gloo group adds its own ~45 us per call, handed to
gloo's thread and back, which is noisier than the overhead being measured.

    python -m lslm.bench.ledger                   # writes bench/results/ledger_overhead.{txt,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lslm.runtime.fake_world import fake_world
from lslm.runtime.ledger import Comm, CommLedger

__all__ = ["main", "measure"]

VARIANTS = ("torch", "disabled", "enabled", "timed")


def measure(calls: int = 2000, rounds: int = 15, async_op: bool = False) -> dict[str, float]:
    """Median microseconds per call of each variant (and overheads over torch); needs an initialised group."""
    x = torch.zeros(1)  # lslm: cpu-ok (the bench runs in torch's fake group: nothing leaves the host)
    comms = {"disabled": Comm(), "enabled": Comm(), "timed": Comm(CommLedger(record_completion=True))}
    comms["disabled"].ledger.enabled = False

    def one(variant: str) -> None:
        if variant == "torch":
            work = dist.all_reduce(x, async_op=async_op)
        else:
            work = comms[variant].all_reduce(x, async_op=async_op, label="bench")
        if async_op:
            work.wait()

    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(3):  # warm-up
        for v in VARIANTS:
            one(v)
    for r in range(rounds):
        k = r % len(VARIANTS)
        order = VARIANTS[k:] + VARIANTS[:k]  # rotate: no variant always runs first
        for v in order:
            t0 = time.perf_counter()
            for _ in range(calls):
                one(v)
            samples[v].append((time.perf_counter() - t0) / calls * 1e6)
        comms["enabled"].ledger.reset()
        comms["timed"].ledger.reset()
    med = {v: statistics.median(s) for v, s in samples.items()}
    return {**{f"{v}_us": med[v] for v in VARIANTS},
            **{f"{v}_overhead_us": med[v] - med["torch"] for v in VARIANTS[1:]},
            "dropped": comms["disabled"].ledger.dropped}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line: measure both call styles in torch's fake group and write the table and JSON."""
    parser = argparse.ArgumentParser(prog="python -m lslm.bench.ledger", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds; the table shows medians (default 15)")
    parser.add_argument("--out", default="bench/results", help="folder for ledger_overhead.txt and .json")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be >= 1")
    torch.set_num_threads(1)
    with fake_world(0, 2):
        rows = {style: measure(args.calls, args.rounds, async_op=style == "async")
                for style in ("sync", "async")}
    lines = [f"per-call cost of an all-reduce of 1 float in torch's fake 2-rank group (no communication), "
             f"median of {args.rounds} rounds x {args.calls} calls (torch {torch.__version__})",
             "enabled: records with issue times (the default); timed: with completion times too (for timelines)",
             f"{'call':<6} {'torch us':>9} {'disabled us':>12} {'enabled us':>11} {'timed us':>9} "
             f"{'disabled-torch':>15} {'enabled-torch':>14} {'timed-torch':>12}"]
    for style, r in rows.items():
        lines.append(f"{style:<6} {r['torch_us']:9.2f} {r['disabled_us']:12.2f} {r['enabled_us']:11.2f} "
                     f"{r['timed_us']:9.2f} {r['disabled_overhead_us']:15.2f} {r['enabled_overhead_us']:14.2f} "
                     f"{r['timed_overhead_us']:12.2f}")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ledger_overhead.txt").write_text(text + "\n")
    (out / "ledger_overhead.json").write_text(json.dumps({"calls": args.calls, "rounds": args.rounds,
                                                          "backend": "fake", "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
