"""``lslm bench launch|collectives|ddp``: the bench part of the ``lslm`` command (see :mod:`lslm.cli`)."""

from __future__ import annotations

import argparse

from lslm.bench.devices import BENCH_DEVICES

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``lslm bench`` flags (the same for every bench; each uses the ones it needs)."""
    p.add_argument("name", choices=("launch", "collectives", "ddp"))
    p.add_argument("--sizes-kib", type=int, nargs="+", default=None,
                   help="collectives: message sizes in KiB (default 4 KiB ... 64 MiB)")
    p.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="folder for the .txt, .json and .png (default: bench/results)")
    p.add_argument("--device", choices=BENCH_DEVICES, default="cpu",
                   help="collectives, ddp: cpu (gloo), cuda (NCCL, one GPU per process) or auto (default: cpu)")
    p.add_argument("--quick", action="store_true",
                   help="ddp: tiny model and few steps (checks structure and bytes; timings meaningless)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="ddp: the bucket size every variant uses (MiB; default 4)")
    p.add_argument("--sweep-mb", type=float, nargs="+", default=None,
                   help="ddp: bucket sizes of the sweep (MiB; default 0.25 1 4 16)")
    p.add_argument("--steps", type=int, default=None, help="ddp: timed steps per variant (default 15)")


def run(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the bench ``ns.name`` with the parsed flags; bad settings end in ``parser.error``."""
    out_dir = ns.out or "bench/results"
    try:
        if ns.name == "launch":
            from lslm.bench import launch_overhead

            launch_overhead.main(out_dir, tuple(ns.nprocs), ns.repeats)
        elif ns.name == "collectives":
            from lslm.bench import collectives

            sizes = tuple(k * 1024 for k in ns.sizes_kib) if ns.sizes_kib else collectives.DEFAULT_SIZES
            collectives.run(tuple(ns.nprocs), sizes, ns.repeats, out_dir=out_dir, device=ns.device)
        else:
            from lslm.bench import ddp

            ddp.run(tuple(ns.nprocs), quick=ns.quick, steps=ns.steps,
                    bucket_cap_mb=ns.bucket_mb if ns.bucket_mb is not None else ddp.DEFAULT_BUCKET_MB,
                    sweep_mb=tuple(ns.sweep_mb) if ns.sweep_mb else None, out_dir=out_dir, device=ns.device)
    except ValueError as exc:
        parser.error(str(exc))
    return 0
